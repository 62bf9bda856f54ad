#!/usr/bin/env python
"""Convert checkpoints between datastates, megatron-core torch_dist and a consolidated safetensors file.

    python tools/convert_checkpoint.py --from datastates --to torch_dist  --input ckpt     --output ckpt_td
    python tools/convert_checkpoint.py --from torch_dist --to datastates  --input ckpt_td  --output ckpt_ds
    python tools/convert_checkpoint.py --from datastates --to safetensors --input ckpt     --output model.safetensors
    python tools/convert_checkpoint.py --from datastates --to hf          --input ckpt     --output hf_model
    python tools/convert_checkpoint.py --from hf         --to datastates  --input hf_model --output ckpt_ft

--to hf / --from hf: a transformers model directory (Llama or GPT-2), see docs/huggingface.md.

--input is a save root (its latest published iteration is converted; --iteration N picks another) or an
iteration directory. A datastates input must be published (metadata.json present, no `.partial`) and complete
(every rank's files, every global tensor fully covered by written shards): otherwise the tool stops with a
message naming the path and what is missing, before writing anything.

What is carried over (one process does it all; the whole state is held in memory once):
- global tensors (megatron-core ShardedTensors: name = sharded key, global shape with prepended axes) are
  assembled into their full value from every rank's shards (every byte checksum-verified while reading) and
  written as one unsharded tensor each: a torch_dist checkpoint any layout can load with stock
  `megatron.core.dist_checkpointing.load`, a datastates checkpoint of world size 1 the trainer can load into
  any TP/PP/DP layout (resharding on load is the engine's job);
- global objects named `key@o1,o2,...` (megatron-core ShardedObjects) become ShardedObjects with that grid
  offset; the grid's global shape is the largest offset + 1 along each axis;
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
import json
import logging
import os
import re
import shutil
import sys
import tempfile

if __package__ in (None, ""):  # run as `python tools/convert_checkpoint.py`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from datastates import _native, commit  # noqa: E402
from datastates import format as fmt  # noqa: E402
from datastates.errors import CheckpointError  # noqa: E402
from datastates.logs import setup_logging  # noqa: E402
from datastates.schema import dtype_from_name  # noqa: E402
from datastates.providers import (ContainerProvider, ItemRef, ObjectProvider, ProviderRegistry,  # noqa: E402
                                  StateProvider, TensorProvider)
from datastates.restore import CheckpointReader  # noqa: E402
from datastates.snapshot import HostCopyBackend  # noqa: E402
from datastates.staging import StagingPool  # noqa: E402

try:
    from tools.inspect_checkpoint import Problems, Scan, UsageError  # noqa: E402
except ImportError:  # run as a script: tools/ is on sys.path
    from inspect_checkpoint import Problems, Scan, UsageError  # noqa: E402
from tools.hf import cli as hf_cli  # noqa: E402

FORMATS_IN = ("datastates", "torch_dist", "hf")
FORMATS_OUT = ("datastates", "torch_dist", "safetensors", "hf")
OBJ_NAME_RE = re.compile(r"^(?P<key>.+)@(?P<offset>\d+(?:,\d+)*)$")
STACK_SEGMENTS = ("layers", "local_experts")
COMMON_PREFIX = "common:"
TORCH_DIST_COMMON_FILE = "common.pt"            # megatron-core <= 0.16
TORCH_DIST_COMMON_OBJECT = "common_state"       # megatron-core 0.19: a ShardedObject inside the DCP files


log = logging.getLogger("tools.convert_checkpoint")

class ConvertError(Exception):
    """The input cannot be converted (exit status 1); the message names the path and the problem."""


class Bundle:
    """A whole checkpoint in memory, format-neutral."""

    def __init__(self, source: str, iteration):
        self.source = source
        self.iteration = iteration
        self.tensors: dict[str, torch.Tensor] = {}  # sharded key -> full (unsharded) tensor
        self.objects: dict[tuple, object] = {}  # (key, grid offset) -> value
        self.object_shapes: dict[str, tuple] = {}  # key -> grid shape
        self.common: dict = {}


# ----- paths -----

def resolve_input(path: str, iteration: int | None, what: str) -> str:
    path = os.path.normpath(path)
    if not os.path.exists(path):
        raise ConvertError(f"input {path!r} does not exist")
    if not os.path.isdir(path):
        raise ConvertError(f"input {path!r} is not a directory ({what} checkpoints are directories)")
    if path.endswith(commit.PARTIAL):
        raise ConvertError(f"input {path!r} is not published: a '.partial' directory is an unfinished or failed save")
    if iteration is not None:
        cand = commit.checkpoint_dir(path, iteration)
        if not os.path.isdir(cand):
            if os.path.isdir(commit.partial_dir(cand)):
                raise ConvertError(f"iteration {iteration} under {path!r} is not published "
                                   f"({commit.partial_dir(cand)!r} is an unfinished or failed save)")
            raise ConvertError(f"input {path!r} has no iteration {iteration} ({cand!r} does not exist)")
        return cand
    if os.path.isfile(os.path.join(path, fmt.METADATA)) or commit.iteration_of(path) is not None:
        return path
    latest = commit.find_latest(path)
    if latest.path is None:
        raise ConvertError(f"input {path!r} is not a {what} checkpoint directory (no metadata.json) nor a save root "
                           f"holding a published one: {latest.why_none()}")
    return latest.path


def resolve_output(path: str, iteration) -> tuple[str, str | None]:
    """(checkpoint directory, save root whose tracker to update or None)."""
    path = os.path.normpath(path)
    if commit.iteration_of(path) is not None:
        out, root = path, os.path.dirname(path) or "."
    else:
        it = iteration if isinstance(iteration, int) else 0
        out, root = commit.checkpoint_dir(path, it), path
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise ConvertError(f"output {out!r} already exists and is not empty: refusing to overwrite it")
    return out, root


# ----- reading datastates -----

class _Whole:
    def __init__(self, name, tensor):
        self.name, self.tensor = name, tensor


class _GlobalObject:
    def __init__(self, name):
        self.name = name


class _WholeProvider(StateProvider):
    """Asks the engine's reader for a whole logical tensor (global offset 0) or a named global object."""

    def accepts(self, value):
        return isinstance(value, (_Whole, _GlobalObject))

    def flatten(self, value, path, ctx):
        if isinstance(value, _GlobalObject):
            return ctx.add_object(path, None, scope="global", name=value.name)
        t = value.tensor
        return ctx.add_tensor(path, t, scope="global", name=value.name, global_shape=tuple(t.shape),
                              global_offset=(0,) * t.dim())


def read_datastates(path: str, iteration: int | None, threads: int = 4) -> Bundle:
    ckpt = resolve_input(path, iteration, "datastates")
    problems = Problems()
    try:
        scan = Scan(ckpt, problems)
    except UsageError as e:
        raise ConvertError(str(e)) from None
    tensors = scan.global_tensors()
    scan.check_coverage(tensors)
    objects = scan.objects()
    if problems:
        raise ConvertError(f"input checkpoint {ckpt!r} is unusable:\n" +
                           "\n".join(f"  {p['file']}: {p['problem']}" for p in problems.items))
    bundle = Bundle(ckpt, scan.index.iteration)
    registry = ProviderRegistry([_WholeProvider(), ContainerProvider(), TensorProvider(), ObjectProvider()])
    template = {"t": {name: _Whole(name, torch.empty(t["global_shape"], dtype=dtype_from_name(t["dtype"])))
                      for name, t in tensors.items()},
                "o": {name: _GlobalObject(name) for name in objects["global"]}}
    from tqdm import tqdm
    io, pool, backend = _native.IOPool(threads), StagingPool(1 << 30, threads), HostCopyBackend()
    try:
        reader = CheckpointReader(ckpt, io, pool, backend, registry)
        # tensor by tensor for the progress bar; each load reads in parallel, checks every chunk's crc32c and
        # the coverage of the tensor
        total = sum(w.tensor.numel() * w.tensor.element_size() for w in template["t"].values())
        with tqdm(total=total, unit="B", unit_scale=True, desc=f"read {ckpt}", disable=None) as bar:
            for name, whole in template["t"].items():
                bundle.tensors[name] = reader.load(0, {"t": {name: whole}})["t"][name]
                bar.update(whole.tensor.numel() * whole.tensor.element_size())
        globals_ = reader.load(0, {"o": template["o"]})["o"]
        own = reader.items(0)
        skeleton = reader.read_item(0, own[fmt.SKELETON_ID])
        local_values = {it.id: reader.read_item(0, it) for it in own.values()
                        if it.scope == "local" and it.id != fmt.SKELETON_ID}
    except CheckpointError as e:
        raise ConvertError(f"reading {ckpt!r} failed: {e}") from None
    finally:
        io.close()
        backend.close()
        pool.close()

    for name, value in globals_.items():
        if name.startswith(COMMON_PREFIX):
            continue
        m = OBJ_NAME_RE.match(name)
        key, offset = (m.group("key"), tuple(int(x) for x in m.group("offset").split(","))) if m else (name, (0,))
        bundle.objects[(key, offset)] = value
    for key in {k for k, _ in bundle.objects}:
        offs = [o for k, o in bundle.objects if k == key]
        bundle.object_shapes[key] = tuple(max(o[d] for o in offs) + 1 for d in range(len(offs[0])))

    drop = object()

    def kept(v, r) -> bool:
        """A value of the common state: not a sharded item, nor a container that held only sharded items."""
        return r is not drop and not (_container(v) and _container(r) and not r)

    def resolve(node):
        if isinstance(node, ItemRef):
            it = own.get(node.id)
            if it is None:
                raise ConvertError(f"{ckpt!r}: the state skeleton of rank 0 refers to item {node.id!r}, which its "
                                   f"manifest lacks")
            if it.scope == "global":
                return globals_[it.name] if it.kind == "object" and it.name.startswith(COMMON_PREFIX) else drop
            return local_values[it.id]
        if isinstance(node, dict):
            out = type(node)() if type(node) is not dict else {}
            for k, v in node.items():
                r = resolve(v)
                if kept(v, r):
                    out[k] = r
            return out
        if isinstance(node, (list, tuple)):
            vals = [r for v, r in ((v, resolve(v)) for v in node) if kept(v, r)]
            if isinstance(node, list):
                return vals
            return type(node)(*vals) if hasattr(node, "_fields") else tuple(vals)
        return node

    common = resolve(skeleton)
    if not isinstance(common, dict):
        common = {"state": common}
    # drop the redundant `a/b` copies this tool adds when it writes datastates (see _common_paths)
    bundle.common = {k: v for k, v in common.items()
                     if not (isinstance(k, str) and "/" in k and k.split("/", 1)[0] in common)}
    return bundle


def _container(x) -> bool:
    return isinstance(x, (dict, list, tuple))


# ----- megatron-core -----

_DIST_TMP = None


def init_megatron():
    """A gloo world of one process, and megatron-core's CUDA calls made harmless on a CPU-only machine."""
    global _DIST_TMP
    try:
        from megatron.training import cpu_shim
        cpu_shim.install()
    except ImportError:
        if not torch.cuda.is_available():
            raise ConvertError("megatron/training/cpu_shim.py is needed to run megatron-core's torch_dist on a "
                               "machine without CUDA") from None
    from megatron.core import dist_checkpointing  # noqa: F401
    dist = torch.distributed
    if not dist.is_initialized():
        _DIST_TMP = tempfile.mkdtemp(prefix="ds_convert_")
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(_DIST_TMP, 'store')}", rank=0,
                                world_size=1)
    elif dist.get_world_size() != 1:
        raise ConvertError("convert_checkpoint runs in a single process (torch.distributed world size 1)")


def close_megatron():
    global _DIST_TMP
    if _DIST_TMP is not None:
        torch.distributed.destroy_process_group()
        shutil.rmtree(_DIST_TMP, ignore_errors=True)
        _DIST_TMP = None


def read_torch_dist(path: str, iteration: int | None) -> Bundle:
    ckpt = resolve_input(path, iteration, "torch_dist")
    meta_path = os.path.join(ckpt, fmt.METADATA)
    try:
        with open(meta_path) as f:
            doc = json.load(f)
    except FileNotFoundError:
        raise ConvertError(f"{ckpt!r} is not a published torch_dist checkpoint: {meta_path!r} is missing") from None
    except (OSError, ValueError) as e:
        raise ConvertError(f"cannot read {meta_path!r}: {e}") from None
    if doc.get("sharded_backend") != "torch_dist":
        raise ConvertError(f"{ckpt!r} is not a torch_dist checkpoint: its metadata.json says "
                           f"{ {k: doc.get(k) for k in ('format', 'sharded_backend')} }")
    init_megatron()
    from megatron.core.dist_checkpointing import serialization
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
    try:
        meta = serialization.load_sharded_metadata(ckpt)
        # the sharded strategy itself: megatron-core 0.16's dist_checkpointing.load insists on common.pt
        loaded = serialization.get_default_load_sharded_strategy(ckpt).load(meta, ckpt)
        common = _torch_dist_common(ckpt, meta, loaded)
    except ConvertError:
        raise
    except Exception as e:  # megatron-core raises many types (CheckpointingException, RuntimeError, OSError)
        raise ConvertError(f"reading torch_dist checkpoint {ckpt!r} failed: {type(e).__name__}: {e}") from None
    it = common.get("iteration") if isinstance(common, dict) else None
    bundle = Bundle(ckpt, it if isinstance(it, int) else commit.iteration_of(ckpt))
    bundle.common = common if isinstance(common, dict) else {"state": common}
    for k, sh in meta.items():
        if isinstance(sh, ShardedTensor):
            bundle.tensors[sh.key] = loaded[k]
        elif isinstance(sh, ShardedObject):
            bundle.objects[(sh.key, tuple(sh.global_offset))] = loaded[k]
            bundle.object_shapes[sh.key] = tuple(sh.global_shape)
    return bundle


def _torch_dist_common(ckpt: str, meta: dict, loaded: dict):
    """The common state dict of a torch_dist checkpoint in either form: `common.pt` beside the DCP files
    (megatron-core up to 0.16), or the ShardedObject `common_state` inside them (0.19). Takes the latter out of
    `meta`/`loaded`: it is not one of the checkpoint's sharded objects."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    inside = [k for k, sh in meta.items() if isinstance(sh, ShardedObject) and sh.key == TORCH_DIST_COMMON_OBJECT]
    for k in inside:
        del meta[k]
    values = [loaded.pop(k) for k in inside]
    if os.path.exists(os.path.join(ckpt, TORCH_DIST_COMMON_FILE)):
        from megatron.core import dist_checkpointing
        return dist_checkpointing.load_common_state_dict(ckpt)
    if not values:
        raise ConvertError(f"torch_dist checkpoint {ckpt!r} has no common state: neither {TORCH_DIST_COMMON_FILE} "
                           f"nor a {TORCH_DIST_COMMON_OBJECT!r} object")
    return values[0]


# ----- writers -----

def write_torch_dist(bundle: Bundle, output: str) -> str:
    out, root = resolve_output(output, bundle.iteration)
    init_megatron()
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
    state = dict(bundle.common)
    sharded = {}
    for name, t in bundle.tensors.items():
        sharded[f"t:{name}"] = ShardedTensor.from_rank_offsets(name, t.contiguous(), replica_id=0)
    for (key, offset), value in bundle.objects.items():
        sharded[f"o:{key}@{offset}"] = ShardedObject(key, value, bundle.object_shapes[key], offset, replica_id=0)
    bad = [k for k, _ in bundle.objects if "/" in k]
    if bad:
        raise ConvertError(f"object keys {bad[:3]} contain '/', which torch_dist cannot name")
    key = "__datastates_sharded__"
    while key in state:
        key += "_"
    state[key] = sharded
    os.makedirs(out, exist_ok=True)
    try:
        dist_checkpointing.save(state, out)
    except Exception as e:  # noqa: BLE001
        raise ConvertError(f"writing torch_dist checkpoint {out!r} failed: {type(e).__name__}: {e}") from None
    if root is not None and commit.iteration_of(out) is not None:
        commit.write_latest(root, commit.iteration_of(out))
    return out


def _common_paths(common: dict, prefix: str = "") -> dict:
    """{'a': v, 'a/b': v['b'], ...}: every value of the (nested) common dict by its slash-joined path."""
    out = {}
    for k, v in common.items():
        path = f"{prefix}/{k}" if prefix else str(k)
        out[path] = v
        if isinstance(v, dict) and v:
            out.update(_common_paths(v, path))
    return out


def write_datastates(bundle: Bundle, output: str, threads: int = 4) -> str:
    out, root = resolve_output(output, bundle.iteration)
    from datastates import CheckpointEngine
    from datastates.megatron import Common, make_registry, save_sharded
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
    state = {path: Common(v) for path, v in _common_paths(bundle.common).items()}
    key = "__datastates_sharded__"
    while key in state:
        key += "_"
    state[key] = {
        "tensors": {name: ShardedTensor.from_rank_offsets(name, t.contiguous(), replica_id=0)
                    for name, t in bundle.tensors.items()},
        "objects": {f"{k}@{o}": ShardedObject(k, v, bundle.object_shapes[k], o, replica_id=0)
                    for (k, o), v in bundle.objects.items()}}
    largest = max((t.numel() * t.element_size() for t in bundle.tensors.values()), default=0)
    budget = max(64 << 20, min(1 << 30, largest))
    try:
        with CheckpointEngine(host_buffer_bytes=budget, writer_threads=threads, rank=0, world_size=1,
                              registry=make_registry()) as engine:
            save_sharded(engine, state, out)
            engine.wait()
    except CheckpointError as e:
        raise ConvertError(f"writing datastates checkpoint {out!r} failed: {e}") from None
    return out


def stacked_names(key: str, shape: tuple) -> list[tuple[str, tuple]] | None:
    """Per-layer names of a tensor stacked over layers (megatron-core's prepended axes), or None."""
    parts = key.split(".")
    slots = [i for i, p in enumerate(parts) if p in STACK_SEGMENTS and not (i + 1 < len(parts) and
                                                                           parts[i + 1].isdigit())]
    if not slots or len(slots) > len(shape):
        return None
    out = []

    def rec(depth, idx):
        if depth == len(slots):
            named = list(parts)
            for slot, i in sorted(zip(slots, idx), reverse=True):
                named.insert(slot + 1, str(i))
            out.append((".".join(named), tuple(idx)))
            return
        for i in range(shape[depth]):
            rec(depth + 1, idx + [i])
    rec(0, [])
    return out


def write_safetensors(bundle: Bundle, output: str, exclude_prefixes: list[str], split_layers: bool) -> str:
    from safetensors.torch import save_file
    output = os.path.normpath(output)
    if os.path.isdir(output):
        raise ConvertError(f"output {output!r} is a directory: --to safetensors writes one file")
    if os.path.exists(output):
        raise ConvertError(f"output {output!r} already exists: refusing to overwrite it")
    tensors, name_map = {}, {}
    for key in sorted(bundle.tensors):
        if any(key.startswith(p) for p in exclude_prefixes) or key.endswith("|flat"):
            continue
        full = bundle.tensors[key]
        split = stacked_names(key, tuple(full.shape)) if split_layers else None
        if split is None:
            pieces = [(key, (), full)]
        else:
            pieces = [(name, idx, full[idx]) for name, idx in split]
        for name, idx, t in pieces:
            if name in tensors:
                raise ConvertError(f"two tensors map to the safetensors name {name!r} (from {key!r}); use "
                                   f"--no-split-layers")
            tensors[name] = t.contiguous().clone()
            name_map[name] = {"key": key, "index": list(idx), "global_shape": list(full.shape),
                              "dtype": str(full.dtype).replace("torch.", "")}
    if not tensors:
        raise ConvertError(f"{bundle.source!r} holds no model weights (every global tensor name starts with one of "
                           f"{exclude_prefixes})")
    meta = {"format": "pt", "converted_from": bundle.source, "iteration": str(bundle.iteration),
            "name_map": json.dumps(name_map, sort_keys=True)}
    os.makedirs(os.path.dirname(output) or ".", exist_ok=True)
    tmp = f"{output}.tmp.{os.getpid()}"
    try:
        save_file(tensors, tmp, metadata=meta)
        os.replace(tmp, output)
    except Exception as e:  # safetensors raises ValueError/TypeError/SafetensorError
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise ConvertError(f"writing {output!r} failed: {type(e).__name__}: {e}") from None
    with open(output + ".names.json", "w") as f:
        json.dump({"source": bundle.source, "iteration": bundle.iteration, "tensors": name_map}, f, indent=1,
                  sort_keys=True)
    return output


# ----- main -----

def _convert_hf(args) -> int:
    """--to hf streams the checkpoint out (tools/hf); --from hf streams in to datastates, or reads the model whole
    for torch_dist's writer above."""
    try:
        if args.src == args.dst:
            raise ConvertError("--from hf --to hf: nothing to convert")
        if args.dst == "hf":
            hf_cli.export(args, init_megatron)
            return 0
        if args.dst not in ("datastates", "torch_dist"):
            raise ConvertError(f"--from hf writes datastates or torch_dist, not {args.dst}")
        imported = hf_cli.read(args)
        lazy, objects, shapes, common, flags = imported
        if args.dst == "datastates":  # streamed: built layer by layer as the engine writes
            out = hf_cli.save_datastates(imported, resolve_output(args.output, 0)[0], args.threads)
        else:  # megatron-core's writer takes the whole model in memory
            bundle = Bundle(os.path.normpath(args.input), 0)
            bundle.tensors = {name: lazy.materialised(name) for name in lazy.tensors}
            bundle.objects, bundle.object_shapes, bundle.common = objects, shapes, common
            out = write_torch_dist(bundle, args.output)
        print(f"converted {os.path.normpath(args.input)} (hf) -> {out} ({args.dst}); fine-tune with: "
              f"pretrain_gpt.py --finetune --load {args.output} {' '.join(flags)}")
        return 0
    except (ConvertError, hf_cli.HFError) as e:
        log.error("%s", e)
        return 1
    finally:
        close_megatron()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="convert_checkpoint.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--input", required=True, help="input save root or iteration directory")
    ap.add_argument("--output", required=True, help="output save root / iteration directory, or .safetensors file")
    ap.add_argument("--from", dest="src", required=True, choices=FORMATS_IN, help="input format")
    ap.add_argument("--to", dest="dst", required=True, choices=FORMATS_OUT, help="output format")
    ap.add_argument("--iteration", type=int, help="with a save root as --input: convert this iteration "
                                                  "(default: the latest published one)")
    ap.add_argument("--exclude-prefix", action="append", default=None, metavar="PREFIX",
                    help="--to safetensors: skip global tensors whose name starts with PREFIX (repeatable; "
                         "default: optimizer.)")
    ap.add_argument("--no-split-layers", action="store_true",
                    help="--to safetensors: keep layer-stacked tensors whole instead of one tensor per layer")
    ap.add_argument("--threads", type=int, default=4, help="native reader/writer threads [4]")
    hf_cli.add_arguments(ap)
    args = ap.parse_args(argv)
    setup_logging(rank=0)
    if "hf" in (args.src, args.dst):
        return _convert_hf(args)
    try:
        if args.src == "datastates":
            bundle = read_datastates(args.input, args.iteration, args.threads)
        else:
            bundle = read_torch_dist(args.input, args.iteration)
        if args.dst == "torch_dist":
            out = write_torch_dist(bundle, args.output)
        elif args.dst == "datastates":
            out = write_datastates(bundle, args.output, args.threads)
        else:
            out = write_safetensors(bundle, args.output, args.exclude_prefix or ["optimizer."],
                                    not args.no_split_layers)
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
