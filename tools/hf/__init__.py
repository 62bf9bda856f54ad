"""Hugging Face transformers in and out: `convert_checkpoint.py --to hf` / `--from hf` (docs/huggingface.md).

arch.py      which transformers architecture a run's flags are, each way, and what is refused
deepseek.py  the DeepSeek-style (MLA, shared experts, sigmoid routing) flags <-> DeepseekV3's config, each way
deepseek_mapping.py  its megatron-core <-> transformers names, per layer
mapping.py   megatron-core sharded keys <-> transformers names, with the fused-tensor splits
source.py    reads a datastates or torch_dist checkpoint one tensor (one layer of it) at a time
writer.py    streamed, sharded safetensors in a directory published by one rename
export.py    checkpoint -> transformers model directory
load_hf.py   transformers model directory -> the convert tool's in-memory checkpoint
"""


class HFError(Exception):
    """The input cannot be converted to or from transformers (exit status 1); the message says what and where."""


def saved_flag(args, name: str, default=None):
    """A flag of a run's saved `args` (a Namespace, or a dict when read back as one)."""
    return args.get(name, default) if isinstance(args, dict) else getattr(args, name, default)
