#!/usr/bin/env python
"""Convert checkpoints between datastates, megatron-core torch_dist, upstream's torch_dcp and a consolidated
safetensors file.

    python tools/convert_checkpoint.py --from datastates --to torch_dist  --input ckpt     --output ckpt_td
    python tools/convert_checkpoint.py --from torch_dist --to datastates  --input ckpt_td  --output ckpt_ds
    python tools/convert_checkpoint.py --from datastates --to safetensors --input ckpt     --output model.safetensors
    python tools/convert_checkpoint.py --from datastates --to hf          --input ckpt     --output hf_model
    python tools/convert_checkpoint.py --from hf         --to datastates  --input hf_model --output ckpt_ft
    python tools/convert_checkpoint.py --from torch_dcp  --to datastates  --input up_ckpt  --output ckpt_ds
    python tools/convert_checkpoint.py --from datastates --to torch_dcp   --input ckpt     --output up_ckpt
    python tools/convert_checkpoint.py --from fsdp_dtensor --to datastates --input up_ckpt --output ckpt_ds
    python tools/convert_checkpoint.py --from datastates --to fsdp_dtensor --input ckpt    --output up_ckpt

--to hf / --from hf: a transformers model directory (Llama, Qwen2, Qwen3, Qwen3-MoE, Mixtral, DeepSeek-V3 or GPT-2),
streamed layer by layer, see docs/huggingface.md.

--from torch_dcp / --to torch_dcp: upstream Megatron-LM's `--use-torch-fsdp2 --ckpt-format torch_dcp` checkpoint
(plain PyTorch DCP, keyed by module names, Adam's states by parameter id), of a GPT model (dense or MoE) at TP 1,
PP 1: read to every output format (to hf through a datastates checkpoint staged beside the output), written from a datastates
checkpoint of an FSDP2 or DDP run, from a transformers model, and from torch_dist without its optimizer
(`--exclude-prefix optimizer.`: torch_dist does not record the parameter order the optimizer's ids follow); names,
ids and what is kept: docs/fsdp.md.

--from fsdp_dtensor / --to fsdp_dtensor: upstream Megatron-LM's `--use-megatron-fsdp --ckpt-format fsdp_dtensor`
checkpoint (DCP, per-layer names under `model.module.`, SwiGLU's fc1 split in `_w`/`_v` halves, Adam's states by
parameter name) of a dense GPT model: read to every output format after checking that its shards cover every
tensor, written from datastates or torch_dist as upstream's converter lays it out; docs/fsdp.md.

--input is a save root (its latest published iteration is converted; --iteration N picks another) or an
iteration directory. A datastates input must be published (metadata.json present, no `.partial`) and complete
(every rank's files, every global tensor fully covered by written shards): otherwise the tool stops with a
message naming the path and what is missing, before writing anything.

What is carried over (one process does it all; the whole state is held in memory once: for a state larger than
one host's memory, convert between datastates and torch_dist with the trainer, `--load IN --save OUT
--save-after-load --ckpt-format FORMAT`, docs/from-megatron-lm.md):
- global tensors (megatron-core ShardedTensors: name = sharded key, global shape with prepended axes) are
  assembled into their full value from every rank's shards (every byte checksum-verified while reading) and
  written whole: a torch_dist checkpoint (one DCP chunk per layer, and per expert, of a layer-stacked tensor) any
  layout can load with stock `megatron.core.dist_checkpointing.load`, a datastates checkpoint of world size 1 the
  trainer can load into any TP/PP/DP layout (resharding on load is the engine's job);
- global objects named `key@o1,o2,...` (megatron-core ShardedObjects) become ShardedObjects with that grid
  offset; the grid's global shape is the largest offset + 1 along each axis;
- the experts of a MoE model (megatron-core's `local_experts` axis) and both parts of its chained dense +
  expert optimizer are global tensors and common objects like any other: carried the same way;
- common objects (datastates `common:<path>`, megatron-core's common state dict) and rank 0's rank-local items
  form the common state dict, in the structure rank 0 saved it. Rank-local items of other ranks are dropped (the
  output has one rank). To datastates, every sub-dict of the common state dict is also saved as its own common
  object (`common:a/b`), so the trainer finds whichever level its template wraps in `Common`.
- distributed-optimizer flattened ranges (datastates names ending in `|flat`) are carried as plain 1-D tensors
  under their datastates name: a non-distributed layout cannot use them.

--to safetensors writes ONLY MODEL WEIGHTS: global tensors whose name does not start with one of the
--exclude-prefix prefixes (default: `optimizer.`, which is where megatron-core and this trainer put optimizer
state) and is not a `|flat` range; rank-local tensors and objects are skipped. Tensors stacked over layers (a
prepended axis per `layers.` / `local_experts.` segment of the key not followed by an index, megatron-core's
layout) are split per layer: `decoder.layers.self_attention.linear_qkv.weight` of global shape (L, 3h, h) becomes
`decoder.layers.0.self_attention.linear_qkv.weight` ... `decoder.layers.{L-1}...`, each (3h, h) (--no-split-layers
keeps them stacked). The map from each safetensors name to its megatron key and layer index is stored in the
file's metadata (`name_map`, JSON) and in a sidecar `<output>.names.json`.

--output: for datastates and torch_dist, an iteration directory (`.../iter_0000100`, the tracker
latest_checkpointed_iteration.txt is written next to it) or a save root (the iteration directory is created in
it, named after the source's iteration); it must not exist yet or be empty. For safetensors, a file name.

Exit status: 0 on success, 1 when the input is unusable or the conversion fails, 2 for usage errors.
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shutil
import sys
import tempfile

if __package__ in (None, ""):  # run as `python tools/convert_checkpoint.py`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from datastates.logs import setup_logging  # noqa: E402
from tools.checkpoint.bundle import Bundle, read_datastates  # noqa: E402
from tools.checkpoint.paths import ConvertError, check_locations, resolve_input  # noqa: E402
from tools.checkpoint.torch_dist import close_megatron, init_megatron, read_torch_dist, write_torch_dist  # noqa: E402
from tools.checkpoint.torch_dcp import read_torch_dcp, write_torch_dcp  # noqa: E402
from tools.checkpoint.fsdp_dtensor import read_fsdp_dtensor, write_fsdp_dtensor  # noqa: E402
from tools.checkpoint.writers import write_datastates, write_safetensors  # noqa: E402
from tools.hf import cli as hf_cli  # noqa: E402

__all__ = ["ConvertError", "main", "read_datastates", "resolve_input"]
FORMATS_IN = ("datastates", "torch_dist", "torch_dcp", "fsdp_dtensor", "hf")
FORMATS_OUT = ("datastates", "torch_dist", "torch_dcp", "fsdp_dtensor", "safetensors", "hf")
READERS = {"datastates": read_datastates, "torch_dist": read_torch_dist, "torch_dcp": read_torch_dcp,
           "fsdp_dtensor": read_fsdp_dtensor}
# read through a datastates checkpoint staged beside the output for --to hf (the export's own input)
STAGED_TO_HF = ("torch_dcp", "fsdp_dtensor")
# fsdp_dtensor names Adam's states by parameter: any model-space checkpoint gives them
FSDP_DTENSOR_FROM = ("datastates", "torch_dist", "fsdp_dtensor")
# torch_dcp numbers the optimizer's states in the module's parameter order, which these formats' keys keep
MODULE_ORDERED = ("datastates", "torch_dcp")

log = logging.getLogger("tools.convert_checkpoint")


# ----- main -----

def _convert_hf(args) -> int:
    """--to hf streams the checkpoint out, --from hf streams it in, layer by layer (tools/hf)."""
    try:
        if args.src == args.dst:
            raise ConvertError("--from hf --to hf: nothing to convert")
        if args.dst == "hf" and args.src in STAGED_TO_HF:
            return _staged_to_hf(args)
        if args.dst == "hf":
            hf_cli.export(args, init_megatron)
            return 0
        if args.dst not in ("datastates", "torch_dist", "torch_dcp"):
            raise ConvertError(f"--from hf writes datastates, torch_dist or torch_dcp, not {args.dst}")
        imported = hf_cli.read(args)
        flags = imported[-1]
        out = _hf_to_torch_dcp(args, imported) if args.dst == "torch_dcp" else \
            hf_cli.save(imported, args.dst, args.output, args.threads)
        fsdp2 = " --use-torch-fsdp2" if args.dst == "torch_dcp" else ""  # the only layout a torch_dcp load takes
        print(f"converted {os.path.normpath(args.input)} (hf) -> {out} ({args.dst}); fine-tune with: "
              f"pretrain_gpt.py --finetune --load {args.output} {' '.join(flags)}{fsdp2}")
        return 0
    except (ConvertError, hf_cli.HFError) as e:
        log.error("%s", e)
        return 1
    finally:
        close_megatron()


@contextlib.contextmanager
def _staged_beside(output: str, name: str):
    """A datastates save root beside `output` for a conversion that goes through one, removed after."""
    parent = os.path.dirname(os.path.abspath(output))
    os.makedirs(parent, exist_ok=True)
    staged = tempfile.mkdtemp(prefix=f".{name}.", dir=parent)
    try:
        yield staged
    finally:
        shutil.rmtree(staged, ignore_errors=True)


def _staged_to_hf(args) -> int:
    """--from torch_dcp|fsdp_dtensor --to hf: through a datastates checkpoint, the export's own input."""
    with _staged_beside(args.output, "staged_to_hf") as staged:
        bundle = READERS[args.src](args.input, args.iteration)
        write_datastates(bundle, staged, args.threads)
        hf_cli.export(argparse.Namespace(**{**vars(args), "src": "datastates", "input": staged,
                                            "iteration": None}), init_megatron)
        return 0


def _hf_to_torch_dcp(args, imported) -> str:
    """--from hf --to torch_dcp: the import written as datastates (model only, in megatron-core's order), then as
    torch_dcp."""
    with _staged_beside(args.output, "hf_to_torch_dcp") as staged:
        hf_cli.save(imported, "datastates", staged, args.threads)
        return write_torch_dcp(read_datastates(staged, None, args.threads), args.output)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="convert_checkpoint.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--input", required=True, help="input save root or iteration directory")
    ap.add_argument("--output", required=True, help="output save root / iteration directory, or .safetensors file")
    ap.add_argument("--from", dest="src", required=True, choices=FORMATS_IN, help="input format")
    ap.add_argument("--to", dest="dst", required=True, choices=FORMATS_OUT, help="output format")
    ap.add_argument("--iteration", type=int, help="with a save root as --input: convert this iteration "
                                                  "(default: the latest published one)")
    ap.add_argument("--exclude-prefix", action="append", default=None, metavar="PREFIX",
                    help="--to safetensors or torch_dcp: skip tensors and state whose name starts with PREFIX "
                         "(repeatable; default: optimizer. to safetensors, nothing to torch_dcp)")
    ap.add_argument("--no-split-layers", action="store_true",
                    help="--to safetensors: keep layer-stacked tensors whole instead of one tensor per layer")
    ap.add_argument("--threads", type=int, default=4, help="native reader/writer threads [4]")
    hf_cli.add_arguments(ap)
    return ap


def _convert(args) -> tuple[Bundle, str]:
    if args.dst == "fsdp_dtensor" and args.src not in FSDP_DTENSOR_FROM:
        raise ConvertError(f"--to fsdp_dtensor reads {', '.join(FSDP_DTENSOR_FROM)}: convert {args.src} to "
                           "datastates first")
    if args.src == "datastates":
        bundle = read_datastates(args.input, args.iteration, args.threads)
    else:
        bundle = READERS[args.src](args.input, args.iteration)
    if args.dst == "torch_dcp":
        return bundle, write_torch_dcp(bundle.without(args.exclude_prefix or []), args.output,
                                       module_ordered=args.src in MODULE_ORDERED)
    if args.dst == "fsdp_dtensor":
        return bundle, write_fsdp_dtensor(bundle, args.output)
    if args.dst == "torch_dist":
        return bundle, write_torch_dist(bundle, args.output)
    if args.dst == "datastates":
        return bundle, write_datastates(bundle, args.output, args.threads)
    return bundle, write_safetensors(bundle, args.output, args.exclude_prefix or ["optimizer."],
                                     not args.no_split_layers)


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    setup_logging(rank=0)
    try:
        check_locations(args.src, args.input, args.dst, args.output)
    except ConvertError as e:
        log.error("%s", e)
        return 1
    if "hf" in (args.src, args.dst):
        return _convert_hf(args)
    try:
        bundle, out = _convert(args)
    except ConvertError as e:
        log.error("%s", e)
        return 1
    finally:
        close_megatron()
    n_bytes = sum(t.numel() * t.element_size() for t in bundle.tensors.values())
    print(f"converted {bundle.source} ({args.src}, iteration {bundle.iteration}: {len(bundle.tensors)} tensors, "
          f"{n_bytes / 1e6:.1f} MB, {len(bundle.objects)} sharded objects, {len(bundle.common)} common entries) "
          f"-> {out} ({args.dst})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
