"""torch DTensors (FSDP2's sharded parameters and optimizer states) as the engine's items: a DTensor is saved as
its local shard with that shard's box in the global tensor, uneven shards included, and nothing is gathered.

A rank's box follows from the DTensor's own mesh and placements (torch's chunking rule, the same on every rank),
so no collective is needed to plan a save or a load. Placements may shard (`Shard`) or replicate (`Replicate`)
along the mesh's dimensions; of the replicas of a shard, the one at coordinate 0 of every replicating mesh
dimension writes it (the others restore it, they do not save it). A `Partial` DTensor holds pending reductions,
not values: it is refused.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

__all__ = ["LocalShard", "local_shard", "is_dtensor"]


class LocalShard(NamedTuple):
    """One rank's part of a DTensor: its local tensor (the DTensor's own storage: a save reads it, a load fills
    it in place), the global shape, the local tensor's offset in it, and whether this rank writes it."""
    tensor: torch.Tensor
    global_shape: tuple
    global_offset: tuple
    writes: bool


def is_dtensor(value) -> bool:
    return isinstance(value, DTensor)


def local_shard(dt: DTensor, where: str = "") -> LocalShard:
    """This rank's shard of `dt` and its box; `where` names it in errors."""
    placements = tuple(dt.placements)
    for p in placements:
        if isinstance(p, Partial) or not isinstance(p, (Shard, Replicate)):
            raise ValueError(f"cannot checkpoint the DTensor {where or ''} with placement {p}: only Shard and "
                             "Replicate placements hold values (reduce a Partial one first)")
    mesh = dt.device_mesh
    local = dt._local_tensor  # the shard itself (to_local() may wrap it in an autograd view)
    shape, offset = compute_local_shape_and_global_offset(dt.shape, mesh, placements)
    if tuple(local.shape) != tuple(shape):
        raise ValueError(f"the DTensor {where} holds a local tensor of shape {tuple(local.shape)}, but its mesh and "
                         f"placements {placements} give this rank {tuple(shape)} (a padded or custom layout)")
    coordinate = mesh.get_coordinate() or [0] * mesh.ndim
    writes = all(c == 0 for c, p in zip(coordinate, placements) if isinstance(p, Replicate))
    return LocalShard(local, tuple(int(n) for n in dt.shape), tuple(int(o) for o in offset), writes)
