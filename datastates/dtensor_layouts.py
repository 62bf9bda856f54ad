"""Where each rank's shard of a DTensor lies when only the ranks' local shapes say so: Megatron-FSDP's parameters
and optimizer states, cut unevenly where its flat per-group buffers put the boundaries, made with
`DTensor.from_local(..., shape=, stride=)` and not by torch's chunking rule.

`ShardLayouts.offsets` learns the boxes of all the DTensors of one walk of a state together: the first time a
structure is seen (its DTensors' names, global and local shapes, placements and meshes on this rank), ONE
`all_gather_object` of every rank's local shapes, after which the boxes come from a cache keyed by that
structure; the next saves and loads of the same structure run no collective. Every rank walks the same
structure at the same saves and loads (a model's layout changes on every rank at once), so every rank enters
that collective or none does; a state without sharded DTensors never enters it.

Shards nest as torch nests them: a mesh dimension before another shards the outer level (Megatron-FSDP's
`_shard_order` on the mesh, TP outside FSDP, says otherwise and is followed). torch's own even split is one case
of the rule, so FSDP2's DTensors get the boxes torch gives them.
"""
from __future__ import annotations

from collections import OrderedDict

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

__all__ = ["ShardLayouts"]

_KEPT = 8  # structures cached (a model's and its optimizer's saves and loads; a few more)


def _structure(named: list[tuple[str, DTensor]]) -> tuple:
    """What the boxes of `named` depend on, as this rank sees it."""
    return tuple((name, tuple(dt.shape), tuple(dt._local_tensor.shape), tuple(map(repr, dt.placements)),
                  tuple(dt.device_mesh.mesh.shape), tuple(dt.device_mesh.mesh.flatten().tolist()),
                  tuple(getattr(dt.device_mesh, "_shard_order", None) or ())) for name, dt in named)


def _every_rank(local: dict) -> dict[int, dict]:
    """Every rank's `local` by global rank: one all_gather_object (none in a single process)."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return {dist.get_rank() if dist.is_available() and dist.is_initialized() else 0: local}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    return dict(enumerate(gathered))


def _nesting(dt: DTensor) -> list[int]:
    """The mesh dimensions from the innermost shard to the outermost."""
    order = getattr(dt.device_mesh, "_shard_order", None)
    return list(reversed(order)) if order else list(reversed(range(dt.device_mesh.ndim)))


def _offset(name: str, dt: DTensor, shapes: dict[int, dict]) -> tuple:
    """This rank's offset in `dt`'s global shape, from every mesh rank's local shape (`shapes[rank][name]`)."""
    mesh = dt.device_mesh.mesh
    ndim = dt.dim()
    sizes = torch.empty((*mesh.shape, ndim), dtype=torch.int64)  # each mesh rank's extent along each tensor dim
    for coordinate in torch.cartesian_prod(*[torch.arange(n) for n in mesh.shape]).view(-1, mesh.dim()).tolist():
        rank = int(mesh[tuple(coordinate)])
        if name not in shapes.get(rank, {}):
            raise ValueError(f"the DTensor {name!r}: rank {rank} is in its mesh but holds no DTensor of that name")
        sizes[tuple(coordinate)] = torch.tensor(shapes[rank][name], dtype=torch.int64)
    offsets = torch.zeros_like(sizes)
    for mesh_dim in _nesting(dt):
        placement = dt.placements[mesh_dim]
        if isinstance(placement, Replicate):
            continue
        assert isinstance(placement, Shard)  # local_shard's check ran first
        d = placement.dim
        extent = sizes[..., d]
        offsets[..., d] += extent.cumsum(mesh_dim) - extent  # the rows of the ranks before it at this level
        sizes[..., d] = extent.sum(mesh_dim, keepdim=True).expand_as(extent)
    if not bool((sizes == torch.tensor(dt.shape, dtype=torch.int64)).all()):
        got = sorted({tuple(s) for s in sizes.view(-1, ndim).tolist()})
        raise ValueError(f"the DTensor {name!r}: its ranks' local shards cover {got}, not its global shape "
                         f"{tuple(dt.shape)}")
    here = tuple(dt.device_mesh.get_coordinate())
    return tuple(int(o) for o in offsets[here].tolist())


class ShardLayouts:
    """Boxes of DTensors learned once per structure (see the module's docstring)."""

    def __init__(self):
        self._known: OrderedDict[tuple, list[tuple]] = OrderedDict()

    def offsets(self, named: list[tuple[str, DTensor]]) -> list[tuple]:
        """This rank's global offset of each DTensor in `named` (a name, the same on the ranks of its mesh, and
        the DTensor), in order. Collective the first time this structure is seen: every rank calls it."""
        if not named:
            return []
        key = _structure(named)
        if key in self._known:
            self._known.move_to_end(key)
            return self._known[key]
        shapes = _every_rank({name: tuple(dt._local_tensor.shape) for name, dt in named})
        learned = [_offset(name, dt, shapes) for name, dt in named]
        self._known[key] = learned
        while len(self._known) > _KEPT:
            self._known.popitem(last=False)
        return learned
