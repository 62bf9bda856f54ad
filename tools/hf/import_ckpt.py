"""Write an imported transformers model as a datastates checkpoint, layer by layer, within a stated budget.

The engine's writer gets the model's tensors as the engine's `built_on_copy` tensors, each unit (a layer, a layer's
expert) built as the copier reaches it (tools/hf/lazy.py): host memory holds the engine's staging budget
(STAGING_BYTES) plus one unit of one megatron-core tensor and the transformers tensors it is made of, never the
model. The engine writes
`<iteration>.partial`, fsyncs it and publishes it by rename; a failed save removes it.
"""
from __future__ import annotations

import ctypes
import ctypes.util

from datastates import CheckpointEngine
from datastates.errors import CheckpointError

from . import HFError
from .lazy import LazyTensors

STAGING_BYTES = 32 << 20
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def _return_large_frees_to_the_system() -> None:
    """glibc raises its mmap threshold after each large free, so the next layers come from a heap it keeps: host
    memory would creep up layer by layer. A fixed threshold maps (and unmaps) every buffer over 1 MiB."""
    try:
        ctypes.CDLL(ctypes.util.find_library("c")).mallopt(M_MMAP_THRESHOLD, 1 << 20)
    except (OSError, AttributeError, TypeError):  # not glibc: nothing to set
        pass


def save_datastates(lazy: LazyTensors, objects: dict, object_shapes: dict, common: dict, out: str,
                    threads: int) -> str:
    """Save the imported model (meta tensors of `lazy`, per-layer `objects`, the `common` state) to `out`."""
    from tqdm import tqdm
    from datastates.megatron import Common, make_registry, save_sharded
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
    state = {key: Common(value) for key, value in common.items()}
    state["__datastates_sharded__"] = {
        "tensors": {name: ShardedTensor.from_rank_offsets(name, t, replica_id=0)
                    for name, t in lazy.tensors.items()},
        "objects": {f"{k}@{o}": ShardedObject(k, v, object_shapes[k], o, replica_id=0)
                    for (k, o), v in objects.items()}}
    _return_large_frees_to_the_system()
    with tqdm(total=lazy.nbytes(), unit="B", unit_scale=True, desc="import", disable=None) as bar:
        try:
            lazy.progress = bar
            with CheckpointEngine(host_buffer_bytes=STAGING_BYTES, writer_threads=threads, rank=0, world_size=1,
                                  registry=make_registry()) as engine:
                save_sharded(engine, state, out)
                engine.wait()
        except CheckpointError as e:
            raise HFError(f"writing datastates checkpoint {out!r} failed: {e}") from None
    return out
