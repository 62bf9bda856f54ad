"""Write an imported transformers model as a datastates or torch_dist checkpoint, layer by layer, within a stated
budget.

The engine's writer gets the model's tensors as the engine's `built_on_copy` tensors, each unit (a layer, a layer's
expert) built as the copier reaches it (tools/hf/lazy.py): host memory holds the engine's staging budget
(STAGING_BYTES) plus one unit of one megatron-core tensor and the transformers tensors it is made of, never the
model. The engine writes
`<iteration>.partial`, fsyncs it and publishes it by rename; a failed save removes it. torch_dist's writer
(tools/checkpoint/torch_dist_writer.py) takes the same units as chunks, one at a time, and publishes the same way.
"""
from __future__ import annotations

from datastates import CheckpointError

from datastates.hf import HFError
from .lazy import LazyTensors

STAGING_BYTES = 32 << 20


def _progress(lazy: LazyTensors):
    from tqdm import tqdm
    lazy.progress = tqdm(total=lazy.nbytes(), unit="B", unit_scale=True, desc="import", disable=None)
    return lazy.progress


def save_datastates(lazy: LazyTensors, objects: dict, object_shapes: dict, common: dict, out: str,
                    threads: int) -> str:
    """Save the imported model (meta tensors of `lazy`, per-layer `objects`, the `common` state) to `out`."""
    from datastates.megatron import Common
    from tools.checkpoint.writers import save_whole
    state = {key: Common(value) for key, value in common.items()}
    with _progress(lazy):
        try:
            save_whole(state, lazy.tensors, objects, object_shapes, out, STAGING_BYTES, threads)
        except CheckpointError as e:
            raise HFError(f"writing datastates checkpoint {out!r} failed: {e}") from None
    return out


def save_torch_dist(lazy: LazyTensors, objects: dict, object_shapes: dict, common: dict, output: str) -> str:
    """The same as a torch_dist checkpoint at `output` (an iteration directory or a save root)."""
    from tools.checkpoint.torch_dist import write_pieces
    with _progress(lazy):
        return write_pieces(lazy.pieces(), objects, object_shapes, common, output, 0)
