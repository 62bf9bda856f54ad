"""torch DTensors (FSDP2's sharded parameters and optimizer states) as the engine's items: a DTensor is saved as
its local shard with that shard's box in the global tensor, uneven shards included, and nothing is gathered.

`local_shard` gives a rank's box from the DTensor's own mesh and placements (torch's chunking rule, the same on
every rank), with no collective. `DTensorProvider` also takes shards that do not follow that rule (Megatron-FSDP's,
cut where its flat buffers put them): their boxes are learned from the ranks' local shapes once per structure
(datastates/dtensor_layouts.py: one collective at the first save or load of a structure, none after it; never one
per tensor). Placements may shard (`Shard`) or replicate (`Replicate`)
along the mesh's dimensions; of the replicas of a shard, the one at coordinate 0 of every replicating mesh
dimension writes it (the others restore it, they do not save it). A `Partial` DTensor holds pending reductions,
not values: it is refused.

`DTensorProvider` (in the default registry) makes a DTensor one global tensor item named by its path in the state,
so that a load matches it by name and box across any number of ranks and fills its local tensor in place; the
loaded state holds the DTensor itself. `GlobalState` wraps a torch.distributed state dict (torch's
`get_model_state_dict` / `get_optimizer_state_dict`), whose other values (Adam's `step`, the param groups) are the
same on every rank: each is saved once, by rank 0, and read by every rank, so the whole state loads into another
number of ranks.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from .dtensor_layouts import ShardLayouts
from .providers import (ItemRef, ObjectProvider, ProviderRegistry, StateProvider, TensorProvider,
                        default_registry)
from .schema import Scope

__all__ = ["LocalShard", "local_shard", "is_dtensor", "DTensorProvider", "GlobalState", "GlobalStateProvider"]


class LocalShard(NamedTuple):
    """One rank's part of a DTensor: its local tensor (the DTensor's own storage: a save reads it, a load fills
    it in place), the global shape, the local tensor's offset in it, and whether this rank writes it."""
    tensor: torch.Tensor
    global_shape: tuple
    global_offset: tuple
    writes: bool


def is_dtensor(value) -> bool:
    return isinstance(value, DTensor)


def _writes(dt: DTensor, where: str) -> bool:
    """Whether this rank writes its shard of `dt` (coordinate 0 of every replicating mesh dimension); refuses
    placements that hold no values."""
    for p in dt.placements:
        if isinstance(p, Partial) or not isinstance(p, (Shard, Replicate)):
            raise ValueError(f"cannot checkpoint the DTensor {where or ''} with placement {p}: only Shard and "
                             "Replicate placements hold values (reduce a Partial one first)")
    coordinate = dt.device_mesh.get_coordinate() or [0] * dt.device_mesh.ndim
    return all(c == 0 for c, p in zip(coordinate, dt.placements) if isinstance(p, Replicate))


def local_shard(dt: DTensor, where: str = "") -> LocalShard:
    """This rank's shard of `dt` and its box by torch's chunking rule; `where` names it in errors."""
    writes = _writes(dt, where)
    local = dt._local_tensor  # the shard itself (to_local() may wrap it in an autograd view)
    shape, offset = compute_local_shape_and_global_offset(dt.shape, dt.device_mesh, tuple(dt.placements))
    if tuple(local.shape) != tuple(shape):
        raise ValueError(f"the DTensor {where} holds a local tensor of shape {tuple(local.shape)}, but its mesh and "
                         f"placements {tuple(dt.placements)} give this rank {tuple(shape)} (a padded or custom "
                         "layout)")
    return LocalShard(local, tuple(int(n) for n in dt.shape), tuple(int(o) for o in offset), writes)


class DTensorRef(ItemRef):
    """A DTensor's leaf in the skeleton: a load's result holds the DTensor, its local tensor filled in place.
    (It pickles as a plain ItemRef: a load without a template rebuilds local tensors.)"""

    __slots__ = ("dtensor",)

    def __init__(self, id: str, dtensor: DTensor):
        super().__init__(id)
        self.dtensor = dtensor

    def rebuilt(self, value: Any) -> DTensor:
        local = self.dtensor._local_tensor
        if value is not local:  # the loader read into a new tensor (its target could not be written in place)
            local.copy_(value)
        return self.dtensor


class DTensorProvider(StateProvider):
    """A DTensor -> a global tensor item named by its path: this rank's shard, in its box, written by one replica.
    Nothing is copied or gathered here: the lazy snapshot copies the local tensor in the background. The boxes of
    one walk's DTensors are placed together once it ends, from `layouts` (learned once per structure)."""

    def __init__(self, layouts: ShardLayouts | None = None):
        self.layouts = layouts or ShardLayouts()

    def accepts(self, value):
        return isinstance(value, DTensor)

    def flatten(self, value, path, ctx):
        writes = _writes(value, repr(path))
        ref = ctx.add_tensor(path, value._local_tensor, scope=Scope.GLOBAL, name=path,
                             global_shape=tuple(int(n) for n in value.shape), write=writes)
        ctx.batch(self._place).append((path, value, ctx.entries[-1].item))
        return DTensorRef(ref.id, value)

    def _place(self, leaves: list) -> None:
        offsets = self.layouts.offsets([(path, dt) for path, dt, _ in leaves])
        for (_, _, item), offset in zip(leaves, offsets):
            item.global_offset = offset


class GlobalState:
    """A state whose every value is global, named by its path: DTensors by their shards, every other tensor and
    object the same on every rank (a torch.distributed state dict). `engine.save(GlobalState(state), path)`;
    `engine.load(path, template=GlobalState(state))` returns `state` loaded (in place), from any number of ranks."""

    __slots__ = ("state",)

    def __init__(self, state: Any):
        self.state = state


def _rank() -> int:
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class _SameOnEveryRank(StateProvider):
    """Inside a GlobalState, a plain tensor or object: a global item that rank 0 writes and every rank reads."""

    def accepts(self, value):
        return True

    def flatten(self, value, path, ctx):
        first = _rank() == 0
        if isinstance(value, torch.Tensor):
            return ctx.add_tensor(path, value, scope=Scope.GLOBAL, name=path, global_shape=tuple(value.shape),
                                  global_offset=(0,) * value.dim(), write=first)
        return ctx.add_object(path, value, scope=Scope.GLOBAL, name=path, write=first)


class GlobalStateProvider(StateProvider):
    """A GlobalState: its contents walked by the registry's own providers, but plain tensors and objects become
    global items (`_SameOnEveryRank`) instead of rank-local ones. Its skeleton is the contents' own."""

    def accepts(self, value):
        return isinstance(value, GlobalState)

    def flatten(self, value, path, ctx):
        outer = ctx.registry
        ctx.registry = ProviderRegistry([p for p in outer.providers if not isinstance(p, (TensorProvider,
                                                                                          ObjectProvider))]
                                        + [_SameOnEveryRank()])
        try:
            return ctx.flatten(value.state, path)
        finally:
            ctx.registry = outer


# every engine's default: DTensors and GlobalState handled like tensors (providers.py cannot import this module)
default_registry.register(GlobalStateProvider())
default_registry.register(DTensorProvider())
