"""Writing a `Bundle` out: as a datastates checkpoint of world size 1 (through the engine), or its model weights
as one safetensors file."""
from __future__ import annotations

import json
import os

import torch

from datastates import CheckpointEngine, CheckpointError, storage_for
from datastates.names import is_flat

from .bundle import Bundle
from .paths import ConvertError, resolve_output
from .summary import stack_slots
from .torch_dist import sharded_key


def _holds_tensor(value) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, dict):
        return any(_holds_tensor(v) for v in value.values())
    return isinstance(value, (list, tuple)) and any(_holds_tensor(v) for v in value)


def _common_state(common: dict, prefix: str = "") -> dict:
    """{'a': Common(v), 'a/b': Common(v['b']), ...}: every value of the (nested) common dict by its slash-joined
    path. A value that holds tensors is kept as it is, at its own path only: the engine saves its tensors as
    tensors, where a `Common` would pickle them, which the restricted unpickler refuses on load."""
    from datastates.megatron import Common
    out = {}
    for k, v in common.items():
        path = f"{prefix}/{k}" if prefix else str(k)
        if _holds_tensor(v):
            out[path] = v
            continue
        out[path] = Common(v)
        if isinstance(v, dict) and v:
            out.update(_common_state(v, path))
    return out


def save_whole(state: dict, tensors: dict, objects: dict, object_shapes: dict, out: str, host_buffer_bytes: int,
               threads: int) -> None:
    """Save a checkpoint of world size 1 to `out` through the engine: `state` (its common entries) and every
    tensor and object whole, as megatron-core's sharded tensors and objects. Raises CheckpointError."""
    from datastates.megatron import make_registry, save_sharded
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
    state[sharded_key(state)] = {
        "tensors": {name: ShardedTensor.from_rank_offsets(name, t, replica_id=0) for name, t in tensors.items()},
        "objects": {f"{k}@{o}": ShardedObject(k, v, object_shapes[k], o, replica_id=0)
                    for (k, o), v in objects.items()}}
    with CheckpointEngine(host_buffer_bytes=host_buffer_bytes, rank=0, world_size=1,
                          registry=make_registry(), storage=storage_for(out, writer_threads=threads)) as engine:
        save_sharded(engine, state, out)
        engine.wait()


def write_datastates(bundle: Bundle, output: str, threads: int = 4) -> str:
    out, _ = resolve_output(output, bundle.iteration)
    state = _common_state(bundle.common)
    largest = max((t.numel() * t.element_size() for t in bundle.tensors.values()), default=0)
    try:
        save_whole(state, {name: t.contiguous() for name, t in bundle.tensors.items()}, bundle.objects,
                   bundle.object_shapes, out, max(64 << 20, min(1 << 30, largest)), threads)
    except CheckpointError as e:
        raise ConvertError(f"writing datastates checkpoint {out!r} failed: {e}") from None
    return out


def stacked_names(key: str, shape: tuple) -> list[tuple[str, tuple]] | None:
    """Per-layer names of a tensor stacked over layers (megatron-core's prepended axes), or None."""
    parts = key.split(".")
    slots = stack_slots(parts)
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


def _weights(bundle: Bundle, exclude_prefixes: list[str], split_layers: bool) -> tuple[dict, dict]:
    """(safetensors name -> tensor, safetensors name -> where it came from) of the model weights."""
    tensors, name_map = {}, {}
    for key in sorted(bundle.tensors):
        if any(key.startswith(p) for p in exclude_prefixes) or is_flat(key):
            continue
        full = bundle.tensors[key]
        split = stacked_names(key, tuple(full.shape)) if split_layers else None
        pieces = [(key, (), full)] if split is None else [(name, idx, full[idx]) for name, idx in split]
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
    return tensors, name_map


def write_safetensors(bundle: Bundle, output: str, exclude_prefixes: list[str], split_layers: bool) -> str:
    from safetensors.torch import save_file
    output = os.path.normpath(output)
    if os.path.isdir(output):
        raise ConvertError(f"output {output!r} is a directory: --to safetensors writes one file")
    if os.path.exists(output):
        raise ConvertError(f"output {output!r} already exists: refusing to overwrite it")
    tensors, name_map = _weights(bundle, exclude_prefixes, split_layers)
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
