"""megatron-core's torch_dist format: read by megatron-core's own dist_checkpointing in a gloo world of one
process, written piece by piece by `torch_dist_writer` (megatron-core's writer would hold the whole state).
"""
from __future__ import annotations

import os
import shutil
import tempfile

import torch

from datastates import read_json
from datastates.paths import METADATA, iteration_of

from .bundle import Bundle
from .paths import ConvertError, resolve_input, resolve_output
from .torch_dist_writer import COMMON_FILE, Pieces, save_torch_dist

TORCH_DIST_COMMON_OBJECT = "common_state"       # megatron-core 0.19: a ShardedObject inside the DCP files
SHARDED_KEY = "__datastates_sharded__"          # where the sharded part goes in a state dict the engine saves

_WORLD: dict = {}  # the temporary store directory of the world `init_megatron` set up


def init_megatron() -> None:
    """A gloo world of one process for megatron-core's dist_checkpointing."""
    from megatron.core import dist_checkpointing  # noqa: F401  (fails early, naming the missing extra)
    dist = torch.distributed
    if dist.is_initialized():
        if dist.get_world_size() != 1:
            raise ConvertError("convert_checkpoint runs in a single process (torch.distributed world size 1)")
    elif not _WORLD:
        _WORLD["store"] = tempfile.mkdtemp(prefix="ds_convert_")
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(_WORLD['store'], 'store')}", rank=0,
                                world_size=1)


def close_megatron() -> None:
    """Tear down what `init_megatron` set up (a world that was up before it stays)."""
    store = _WORLD.pop("store", None)
    if store is not None:
        torch.distributed.destroy_process_group()
        shutil.rmtree(store, ignore_errors=True)


def read_torch_dist(path: str, iteration: int | None) -> Bundle:
    ckpt = resolve_input(path, iteration, "torch_dist")
    _check_torch_dist(ckpt)
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
    bundle = Bundle(ckpt, it if isinstance(it, int) else iteration_of(ckpt))
    bundle.common = common if isinstance(common, dict) else {"state": common}
    for k, sh in meta.items():
        if isinstance(sh, ShardedTensor):
            bundle.tensors[sh.key] = loaded[k]
        elif isinstance(sh, ShardedObject):
            bundle.objects[(sh.key, tuple(sh.global_offset))] = loaded[k]
            bundle.object_shapes[sh.key] = tuple(sh.global_shape)
    return bundle


def _check_torch_dist(ckpt: str) -> None:
    meta_path = os.path.join(ckpt, METADATA)
    try:
        doc = read_json(meta_path, "torch_dist metadata")
    except Exception as e:  # noqa: BLE001 - missing, unreadable or not JSON: named below
        raise ConvertError(f"{ckpt!r} is not a published torch_dist checkpoint: {e}") from None
    if doc.get("sharded_backend") != "torch_dist":
        raise ConvertError(f"{ckpt!r} is not a torch_dist checkpoint: its metadata.json says "
                           f"{ {k: doc.get(k) for k in ('format', 'sharded_backend')} }")


def _torch_dist_common(ckpt: str, meta: dict, loaded: dict):
    """The common state dict of a torch_dist checkpoint in either form: `common.pt` beside the DCP files
    (megatron-core up to 0.16), or the ShardedObject `common_state` inside them (0.19). Takes the latter out of
    `meta`/`loaded`: it is not one of the checkpoint's sharded objects."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    inside = [k for k, sh in meta.items() if isinstance(sh, ShardedObject) and sh.key == TORCH_DIST_COMMON_OBJECT]
    for k in inside:
        del meta[k]
    values = [loaded.pop(k) for k in inside]
    if os.path.exists(os.path.join(ckpt, COMMON_FILE)):
        from megatron.core import dist_checkpointing
        return dist_checkpointing.load_common_state_dict(ckpt)
    if not values:
        raise ConvertError(f"torch_dist checkpoint {ckpt!r} has no common state: neither {COMMON_FILE} "
                           f"nor a {TORCH_DIST_COMMON_OBJECT!r} object")
    return values[0]


def sharded_key(state: dict) -> str:
    """A key of `state` for its sharded part that none of its common entries uses."""
    key = SHARDED_KEY
    while key in state:
        key += "_"
    return key


def stacked_lead(key: str, shape: tuple) -> int:
    """How many leading axes of a tensor index its layers (and experts): the pieces torch_dist's writer makes."""
    from .summary import stack_slots
    return min(len(stack_slots(key.split("."))), max(len(shape) - 1, 0))


def write_torch_dist(bundle: Bundle, output: str) -> str:
    """`bundle` as a torch_dist checkpoint at `output`, each layer-stacked tensor a chunk per layer (and expert),
    so that a reader of one layer (the Hugging Face export) reads only it."""
    tensors = {name: Pieces.whole(t, stacked_lead(name, tuple(t.shape))) for name, t in bundle.tensors.items()}
    return write_pieces(tensors, bundle.objects, bundle.object_shapes, bundle.common, output, bundle.iteration)


def write_pieces(tensors: dict[str, Pieces], objects: dict, object_shapes: dict, common: dict, output: str,
                 iteration) -> str:
    """A torch_dist checkpoint at `output` (an iteration directory, or a save root whose tracker is updated)."""
    out, _ = resolve_output(output, iteration)
    bad = [k for k, _ in objects if "/" in k]
    if bad:
        raise ConvertError(f"object keys {bad[:3]} contain '/', which torch_dist cannot name")
    save_torch_dist(tensors, objects, object_shapes, common, out)  # published, its tracker pointed at it
    return out
