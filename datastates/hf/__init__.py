"""Hugging Face transformers in and out, as a library: the trainer's --save-hf and the tools'
`convert_checkpoint.py --to hf / --from hf` (docs/huggingface.md) both import it; it imports neither (the engine's
public surface, torch, megatron-core only where a torch_dist checkpoint is read).

arch.py      which registered architecture a run's flags or a config.json are, and the flags every one prints
architectures/  one module per transformers architecture (flags <-> config.json, names, splits, refusals); DeepSeek-V3,
             whose flags and config.json take more, is a package of its own (deepseek_v3/: flags.py and the names)
geometry.py  the sizes and choices every architecture's mapping needs, and the checks they share
mapping.py   what name mappings are made of: rules, the fused-tensor splits, units of stacked tensors
source.py    reads a datastates or torch_dist checkpoint one tensor (one layer of it) at a time
writer.py    streamed, sharded safetensors through the engine's storage contract (a file system, s3://, msc://)
export.py    the export plan: checkpoint -> transformers model directory

The command lines, and the import (a transformers model -> megatron-core's tensors and the trainer's flags), are
tools/hf/.
"""


class HFError(Exception):
    """The input cannot be converted to or from transformers (exit status 1); the message says what and where."""


def saved_flag(args, name: str, default=None):
    """A flag of a run's saved `args` (a Namespace, or a dict when read back as one)."""
    return args.get(name, default) if isinstance(args, dict) else getattr(args, name, default)
