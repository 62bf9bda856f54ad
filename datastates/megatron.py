"""Adapters between megatron-core's sharded state dicts and the engine's providers.

megatron-core describes a distributed training state with `ShardedTensor`s (a local shard of a logical tensor:
key, global shape, global offset, replica id), `ShardedObject`s (a picklable object with a position in a grid of
ranks), `ShardedTensorFactory`s (a tensor saved as a transformation of itself, e.g. the two halves of a SwiGLU
fc1) and `LocalNonpersistentObject`s (kept on load, never saved). This module makes the engine speak that
language without the engine importing megatron-core:

- `MegatronProvider` turns a ShardedTensor into one *global* tensor item named by its key with its box in GLOBAL
  coordinates (prepended axes included), and a ShardedObject into a global object item; on load the engine
  matches items by (name, global offset) across every rank's files, so TP/PP/DP layouts may change.
- `ReplicaOwnership` decides which of the ranks holding the same shard (DP replicas, TP-replicated layer norms)
  writes it: bytes are balanced across the holders (one all_gather_object of the shard list, cached while the
  structure holds) instead of always the main replica.
- `save_sharded` / `load_sharded` are the megatron-core `dist_checkpointing.save/load` equivalents on a
  `CheckpointEngine`: factories are applied before save and merged after load, non-persistent objects are
  dropped on save and restored on load, and loaded tensors land IN PLACE in the template's tensors.
"""
from __future__ import annotations

import hashlib
import math
from typing import Callable, Optional

import torch

from .names import (COMMON_PREFIX, FLAT_SUFFIX, common_name, common_path, flat_name, is_flat, parse_shard_name,
                    shard_name)
from .exchange import Exchange
from .schema import Kind, Scope
from .providers import (ContainerProvider, ObjectProvider, ProviderRegistry, StateProvider,
                        TensorProvider)

from megatron.core.dist_checkpointing.mapping import (  # noqa: E402  (megatron-core lives only here)
    LocalNonpersistentObject, ShardedObject, ShardedTensor, ShardedTensorFactory, apply_factories,
    apply_factory_merges)
from megatron.core.dist_checkpointing.dict_utils import (dict_list_map_inplace, extract_matching_values,
                                                         merge, nested_values)

__all__ = ["Common", "MegatronProvider", "ReplicaOwnership", "make_registry", "prepare_for_save", "prepare_for_load",
           "finalize_load", "save_sharded", "load_sharded", "shard_identity",
           # how items are named (datastates.names, for readers without megatron-core)
           "COMMON_PREFIX", "FLAT_SUFFIX", "common_name", "common_path", "shard_name", "parse_shard_name", "flat_name",
           "is_flat"]


def _flat_range(sh) -> Optional[tuple]:
    fr = getattr(sh, "flattened_range", None)
    return None if fr is None else (int(fr.start), int(fr.stop))


def shard_identity(sh) -> tuple:
    """What makes two ranks' shards replicas of each other: key, global offset and flattened range."""
    if isinstance(sh, ShardedTensor):
        return ("T", sh.key, tuple(int(x) for x in sh.global_offset), _flat_range(sh))
    return ("O", sh.key, tuple(int(x) for x in sh.global_offset), None)


def _is_main_replica(replica_id) -> bool:
    if isinstance(replica_id, int):
        return replica_id == 0
    return all(r == 0 for r in replica_id)


def _item_key(ident: tuple) -> str:
    kind, key, offset, fr = ident
    s = shard_name(key, offset)
    if fr is not None:
        s += f"[{fr[0]}:{fr[1]}]"
    return s


def _nbytes(sh) -> int:
    if isinstance(sh, ShardedTensor):
        if sh.data is not None:
            return sh.data.numel() * sh.data.element_size()
        return math.prod(sh.local_shape) * torch.empty((), dtype=sh.dtype).element_size()
    return 1  # objects: tiny, counted so that they spread too


PREFERENCE_SLACK = 0.05  # a preferred writer takes at most this much more than an even share of the bytes


class ReplicaOwnership:
    """Which rank writes each replicated shard, with the bytes balanced across the ranks that hold it.

    `compute(shards)` is a collective over `group` (every rank calls it at the same point, which holds because
    every rank saves at the same iteration); its result is cached under a digest of the local structure, so
    later saves of an unchanged structure cost nothing. The assignment is deterministic: shards held by one rank
    are that rank's; then each shard with a preferred writer goes to it while that keeps its bytes within 5% of an
    even share (`PREFERENCE_SLACK`: the checkpoint's slowest writer stays about as fast); the rest, by
    decreasing size, each to the least-loaded of its holders (ties: lowest rank).

    `prefer(shards)`, given the shards this rank may write: {shard identity: the rank of `group` that should
    write it}, for a caller whose later use of the written bytes wants them there (--save-hf: the rank that
    writes the weight's Hugging Face file). Called where the assignment is computed, on every rank of the world
    at the same point (it may be a collective).

    With `group` the data-parallel group, the exchange stays inside it (its cost does not grow with the world):
    a shard is balanced across the DP ranks holding it when it is the main replica in every other dimension of
    megatron-core's replica id (the last component is the DP one); other replicas never write. Without a group
    the whole world balances every shard.
    """

    def __init__(self, group=None, prefer: Optional[Callable[[list], dict]] = None):
        self.group = group
        self.prefer = prefer
        self._digest: Optional[str] = None
        self._owned: dict[tuple, bool] = {}
        self.bytes_per_rank: list[int] = []

    def _candidate(self, sh) -> bool:
        """Whether this rank's copy of `sh` may be chosen as the writer within the group."""
        rid = sh.replica_id
        return self.group is None or isinstance(rid, int) or all(r == 0 for r in tuple(rid)[:-1])

    def writes(self, ident: tuple, replica_id) -> bool:
        if ident in self._owned:
            return self._owned[ident]
        return _is_main_replica(replica_id)

    def compute(self, shards: list) -> None:
        local = sorted({(shard_identity(sh), _nbytes(sh)) for sh in shards if self._candidate(sh)}, key=repr)
        never = {shard_identity(sh): False for sh in shards if not self._candidate(sh)}
        digest = hashlib.sha1(repr((local, sorted(never, key=repr))).encode()).hexdigest()
        if digest == self._digest:
            return
        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(self.group) == 1:
            self._owned = {**never, **{ident: True for ident, _ in local}}
            self.bytes_per_rank = [sum(n for _, n in local)]
            self._digest = digest
            return
        world = dist.get_world_size(self.group)
        me = dist.get_rank(self.group)
        prefer = self.prefer([sh for sh in shards if self._candidate(sh)]) if self.prefer is not None else {}
        gathered: list = [None] * world
        dist.all_gather_object(gathered, [(ident, n, prefer.get(ident)) for ident, n in local], group=self.group)
        owner, load = _assign_owners(gathered)
        self._owned = {**never, **{ident: owner[ident] == me for ident, _ in local}}
        self.bytes_per_rank = load
        self._digest = digest


def _assign_owners(gathered: list) -> tuple[dict[tuple, int], list[int]]:
    """Who writes each shard, from every rank's (identity, bytes, preferred rank) of the shards it holds: a shard
    held once by its holder; then, largest first, by the rank preferred for it unless that rank would hold more
    than its share (plus PREFERENCE_SLACK); then by the least loaded holder. (owner of each shard, bytes a rank)."""
    holders: dict[tuple, list[int]] = {}
    sizes: dict[tuple, int] = {}
    preferred: dict[tuple, int] = {}
    for rank, entries in enumerate(gathered):
        for ident, n, p in entries:
            holders.setdefault(ident, []).append(rank)
            sizes[ident] = max(sizes.get(ident, 0), n)
            if p is not None:
                preferred.setdefault(ident, p)
    load = [0] * len(gathered)
    owner: dict[tuple, int] = {}

    def take(ident: tuple, r: int) -> None:
        owner[ident] = r
        load[r] += sizes[ident]
    order = sorted(holders, key=lambda i: (-sizes[i], repr(i)))
    for ident in order:
        if len(holders[ident]) == 1:
            take(ident, holders[ident][0])
    most = sum(sizes.values()) / len(gathered) * (1 + PREFERENCE_SLACK)
    for ident in order:
        p = preferred.get(ident)
        if ident not in owner and p in holders[ident] and load[p] + sizes[ident] <= most:
            take(ident, p)
    for ident in order:
        if ident not in owner:
            take(ident, min(holders[ident], key=lambda x: (load[x], x)))
    return owner, load


class Common:
    """A value that every rank holds identically (args, iteration, scheduler, optimizer hyper-parameters).

    Saved once, by global rank 0, as the global object `common_name(path)` (megatron-core's "common state");
    on load every rank reads it from rank 0's file, whatever the layout the checkpoint was saved with.
    """

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value


def _global_rank() -> int:
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class MegatronProvider(StateProvider):
    """ShardedTensor -> global tensor item; ShardedObject -> global object item; Common -> rank-0 object.

    `self_contained`: every rank writes every shard it holds and the common state, so that one rank's files
    restore that rank alone (the memory tier's per-rank checkpoints); no exchange between ranks."""

    def __init__(self, ownership: Optional[ReplicaOwnership] = None, self_contained: bool = False):
        self.ownership = ownership or ReplicaOwnership()
        self.self_contained = self_contained

    def accepts(self, value):
        return isinstance(value, (ShardedTensor, ShardedObject, ShardedTensorFactory, LocalNonpersistentObject,
                                  Common))

    def flatten(self, value, path, ctx):
        if isinstance(value, Common):
            return ctx.add_object(common_name(path), value.value, scope=Scope.GLOBAL, name=common_name(path),
                                  write=self.self_contained or _global_rank() == 0)
        if isinstance(value, (ShardedTensorFactory, LocalNonpersistentObject)):
            raise TypeError(f"{type(value).__name__} at {path!r}: call datastates.megatron.prepare_for_save / "
                            "prepare_for_load (or save_sharded/load_sharded) before handing the state to the engine")
        ident = shard_identity(value)
        write = self.self_contained or self.ownership.writes(ident, value.replica_id)
        key = _item_key(ident)
        if isinstance(value, ShardedObject):
            return ctx.add_object(key, value.data, scope=Scope.GLOBAL, name=key, write=write)
        data = value.data
        if data is None:
            raise ValueError(f"ShardedTensor {value.key!r} at {path!r} has no data")
        fr = _flat_range(value)
        if fr is not None:
            # A flattened range of the local shard (distributed optimizer): a 1-D logical tensor per local shard,
            # so DP resharding of the ranges works and TP/PP boxes stay apart.
            name = flat_name(value.key, value.global_offset)
            return ctx.add_tensor(key, data.reshape(-1), scope=Scope.GLOBAL, name=name,
                                  global_shape=(math.prod(value.local_shape),), global_offset=(fr[0],),
                                  write=write)
        box = (1,) * value.prepend_axis_num + tuple(value.local_shape)
        if tuple(data.shape) != box:
            data = data.view(box) if data.is_contiguous() else data.reshape(box)
        return ctx.add_tensor(key, data, scope=Scope.GLOBAL, name=value.key,
                              global_shape=tuple(int(x) for x in value.global_shape),
                              global_offset=tuple(int(x) for x in value.global_offset), write=write)


def make_registry(ownership: Optional[ReplicaOwnership] = None, self_contained: bool = False) -> ProviderRegistry:
    """A provider registry that understands megatron-core's sharded state dicts (for CheckpointEngine(registry=))."""
    return ProviderRegistry([MegatronProvider(ownership, self_contained), ContainerProvider(), TensorProvider(),
                             ObjectProvider()])


def _provider(registry: ProviderRegistry) -> MegatronProvider:
    for p in registry.providers:
        if isinstance(p, MegatronProvider):
            return p
    raise ValueError("the engine's registry has no MegatronProvider: build it with datastates.megatron.make_registry()")


def _sharded_leaves(state) -> list:
    return [x for x in nested_values(state) if isinstance(x, (ShardedTensor, ShardedObject))]


def _drop_empty_flat(state):
    """Drop ShardedTensors whose flattened range is empty (megatron-core skips them too)."""
    if isinstance(state, dict):
        return {k: _drop_empty_flat(v) for k, v in state.items()
                if not (isinstance(v, ShardedTensor) and _flat_range(v) is not None and v.data is not None
                        and v.data.numel() == 0)}
    if isinstance(state, list):
        return [_drop_empty_flat(v) for v in state]
    return state


def prepare_for_save(sharded_state_dict: dict) -> dict:
    """A copy of the structure with factories applied and non-persistent objects removed (tensors shared)."""
    sd, _ = extract_matching_values(sharded_state_dict, lambda x: True)
    sd = _drop_empty_flat(sd)
    apply_factories(sd)
    _, sd = extract_matching_values(sd, lambda x: isinstance(x, LocalNonpersistentObject))
    return sd


def prepare_for_load(sharded_state_dict: dict):
    """(template, nonpersistent, factories) like megatron-core's load_preprocess, without touching the input."""
    sd, _ = extract_matching_values(sharded_state_dict, lambda x: True)
    sd = _drop_empty_flat(sd)
    factories, _ = extract_matching_values(sd, lambda x: isinstance(x, ShardedTensorFactory),
                                           return_lists_as_dicts=True)
    apply_factories(sd)
    dict_list_map_inplace(ShardedTensorFactory.without_data, factories)
    nonpersistent, sd = extract_matching_values(sd, lambda x: isinstance(x, LocalNonpersistentObject))
    dict_list_map_inplace(lambda o: o.unwrap(), nonpersistent)
    return sd, nonpersistent, factories


def _resolve(template, loaded):
    """Megatron-style result: ShardedTensor -> its (filled in place) data tensor, ShardedObject -> its value."""
    if isinstance(template, ShardedTensor):
        target = template.data
        if isinstance(loaded, torch.Tensor) and target is not None and \
                loaded.untyped_storage().data_ptr() != target.untyped_storage().data_ptr():
            with torch.no_grad():
                target.copy_(loaded.reshape(target.shape))
        return target
    if isinstance(template, (ShardedObject, Common)):
        return loaded
    if isinstance(template, dict) and isinstance(loaded, dict):
        return type(loaded)({k: _resolve(template.get(k), v) for k, v in loaded.items()}) \
            if type(loaded) is not dict else {k: _resolve(template.get(k), v) for k, v in loaded.items()}
    if isinstance(template, (list, tuple)) and isinstance(loaded, (list, tuple)) and len(template) == len(loaded):
        vals = [_resolve(t, v) for t, v in zip(template, loaded)]
        return vals if isinstance(loaded, list) else type(loaded)(vals) if not hasattr(loaded, "_fields") \
            else type(loaded)(*vals)
    return loaded


def finalize_load(template: dict, loaded: dict, nonpersistent: dict, factories: dict) -> dict:
    """The loaded state in megatron-core's order: non-persistent values merged back first, then the factory
    merges, which may read them (a grouped-GEMM MLP's merge reads its sibling `singleton_local_shards`)."""
    state = _resolve(template, loaded)
    merge(state, nonpersistent)
    return apply_factory_merges(state, factories)


def save_sharded(engine, sharded_state_dict: dict, path: str, ownership: Optional[ReplicaOwnership] = None,
                 from_save=None, keep=None):
    """Save a megatron-core sharded state dict (plus plain objects/tensors) with `engine`; returns the handle.

    `ownership` is the ReplicaOwnership of the MegatronProvider in the engine's registry (found on the engine
    when not given). Collective on first use and whenever the structure changes; otherwise local. `from_save`:
    the memory tier's save of the same state, whose pages this save writes from, and `keep`, the tensors kept past
    the save (both as `CheckpointEngine.save` takes them).
    """
    sd = prepare_for_save(sharded_state_dict)
    provider = _provider(engine.registry)
    if not provider.self_contained:
        (ownership or provider.ownership).compute(_sharded_leaves(sd))
    return engine.save(sd, path, from_save=from_save, keep=keep)


def _fit_saved_shapes(sharded_state_dict: dict, saved_shapes) -> dict:
    """Honour megatron-core's `allow_shape_mismatch` (padded vocabularies: their size depends on TP).

    A ShardedTensor that allows a mismatch and whose saved global shape differs is zeroed and replaced by a
    factory that loads only the part of its box inside the saved shape (nothing when they do not overlap) and
    merges back to the whole local tensor, as megatron-core's torch_dist loader does. `saved_shapes(key)` gives
    the saved global shape of a key (None: not saved). Returns a structural copy; the input is not touched."""
    sd, _ = extract_matching_values(sharded_state_dict, lambda x: True)

    def fit(x):
        if not (isinstance(x, ShardedTensor) and x.allow_shape_mismatch and x.flattened_range is None
                and x.data is not None):
            return x
        saved = saved_shapes(x.key)
        if saved is None or tuple(saved) == tuple(x.global_shape) or len(saved) != len(x.global_shape):
            return x
        full = x.data
        with torch.no_grad():
            full.zero_()
        off, shape = [], []
        for o, n, g in zip(x.global_offset, (1,) * x.prepend_axis_num + tuple(x.local_shape), saved):
            off.append(min(o, g))
            shape.append(max(0, min(o + n, g) - o))
        if 0 in shape:
            build = lambda key, data, replica_id, flattened_range: {}  # noqa: E731
        else:
            local = tuple(slice(0, n) for n in shape[x.prepend_axis_num:])

            def build(key, data, replica_id, flattened_range, x=x, local=local, shape=shape, off=off):
                return ShardedTensor(key=key, data=full[local], dtype=x.dtype,
                                     local_shape=tuple(shape[x.prepend_axis_num:]), global_shape=tuple(saved),
                                     global_offset=tuple(off), axis_fragmentations=None, replica_id=replica_id,
                                     prepend_axis_num=x.prepend_axis_num, allow_shape_mismatch=True)
        return ShardedTensorFactory(x.key, full, build, lambda loaded, full=full: full, x.replica_id, None)

    dict_list_map_inplace(fit, sd)
    return sd


def _saved_global_shapes(engine, path: str):
    index = engine.checkpoint(path).global_index()

    def shape_of(key):
        shards = index.get(key)
        return None if not shards or shards[0].kind != Kind.TENSOR else shards[0].global_shape
    return shape_of


def _any_shape_mismatch_allowed(state) -> bool:
    return any(isinstance(x, ShardedTensor) and x.allow_shape_mismatch for x in _sharded_leaves(state))


def load_sharded(engine, sharded_state_dict: dict, path: str, exchange: Optional[Exchange] = None) -> dict:
    """Load into the tensors of `sharded_state_dict` (in place) and return a megatron-style state dict.

    `exchange`: every rank of its group loads at once, and each saved byte several of them want is read by one
    and passed to the others (--ckpt-fully-parallel-load)."""
    if _any_shape_mismatch_allowed(sharded_state_dict):
        sharded_state_dict = _fit_saved_shapes(sharded_state_dict, _saved_global_shapes(engine, path))
    template, nonpersistent, factories = prepare_for_load(sharded_state_dict)
    loaded = engine.load(path, template=template, exchange=exchange)
    return finalize_load(template, loaded, nonpersistent, factories)
