"""The --to hf / --from hf options of tools/convert_checkpoint.py and the calls it dispatches to."""
from __future__ import annotations

import ctypes
import ctypes.util

from datastates.hf import HFError  # noqa: F401 (the dispatcher catches it)
from datastates.hf.export import DEFAULT_SHARD_BYTES


def add_arguments(ap) -> None:
    g = ap.add_argument_group("Hugging Face (--to hf / --from hf, docs/huggingface.md)")
    g.add_argument("--tokenizer", metavar="DIR", help="--to hf: copy the tokenizer files of this transformers "
                                                      "tokenizer directory into the output")
    g.add_argument("--max-shard-size", type=int, default=DEFAULT_SHARD_BYTES, metavar="BYTES",
                   help=f"--to hf: safetensors shards of at most BYTES [{DEFAULT_SHARD_BYTES}]")
    g.add_argument("--drop-mtp", action="store_true",
                   help="--to hf: leave out the run's multi-token prediction layers (transformers' "
                        "DeepseekV3 has none; the main model's logits do not depend on them)")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128, metavar="N",
                   help="--from hf: pad the vocabulary as pretrain_gpt.py will, to a multiple of N x TP [128]")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1, metavar="TP",
                   help="--from hf: the TP of the fine-tuning run, for the vocabulary padding [1]")


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def _return_large_frees_to_the_system() -> None:
    """glibc raises its mmap threshold after each large free, so the next layers come from a heap it keeps: host
    memory would creep up layer by layer, by up to a few units in either direction, differently from run to run.
    A fixed threshold maps (and unmaps) every buffer over 1 MiB."""
    try:
        ctypes.CDLL(ctypes.util.find_library("c")).mallopt(M_MMAP_THRESHOLD, 1 << 20)
    except (OSError, AttributeError, TypeError):  # not glibc: nothing to set
        pass


def export(args, init_distributed) -> str:
    from datastates.hf.export import export as run
    _return_large_frees_to_the_system()
    return run(args.src, args.input, args.output, tokenizer=args.tokenizer, max_shard_bytes=args.max_shard_size,
               init_distributed=init_distributed, drop_mtp=args.drop_mtp)


def read(args):
    from .load_hf import read_hf
    _return_large_frees_to_the_system()
    if args.make_vocab_size_divisible_by < 1 or args.tensor_model_parallel_size < 1:
        raise HFError("--make-vocab-size-divisible-by and --tensor-model-parallel-size must be at least 1")
    return read_hf(args.input, args.make_vocab_size_divisible_by, args.tensor_model_parallel_size)


def save(imported, fmt: str, output: str, threads: int) -> str:
    """Write `read`'s result as a datastates or torch_dist checkpoint at `output`, layer by layer
    (tools/hf/import_ckpt.py)."""
    from . import import_ckpt
    lazy, objects, shapes, common, _ = imported
    if fmt == "datastates":
        from tools.checkpoint.paths import resolve_output
        return import_ckpt.save_datastates(lazy, objects, shapes, common, resolve_output(output, 0)[0], threads)
    return import_ckpt.save_torch_dist(lazy, objects, shapes, common, output)
