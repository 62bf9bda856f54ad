"""Read a published checkpoint back: verify, and reshard into whatever layout the target asks for.

Everything a load needs to know is in one file, the global index in metadata.json (schema 2; schema 1
checkpoints are read through their per-rank manifests). Rank-local items are found by id among the same rank's
items. Global items (shards of a logical tensor) are indexed by name across every rank's items; each target
shard reads exactly the rows of the saved shards it overlaps, widened to whole checksum chunks so every byte
read is verified: the load plan (`load_plan`), computed without I/O and executed here. Only the data files
holding wanted bytes are opened, through the storage (`DataSource`: on a file system one sequential stream, or
several O_DIRECT reads in flight); a whole item streams straight into a contiguous host target, other reads land
in the staging slots and are copied out into the targets while later reads are in flight.
"""
from __future__ import annotations

import copy
import functools
from typing import Any, Callable

import torch

from . import format as fmt
from . import layout, save_root, tracker
from .errors import CheckpointCorruptError, CheckpointError
from .load_plan import BoxRead, plan_global, plan_whole
from .problems import Problems
from .names import common_path
from .providers import ProviderRegistry, default_registry, item_ids, unflatten
from .reads import LoadStats, Reads
from .schema import Box, Item, Kind, RankPart, Scope, Shard, dtype_from_name, dtype_name
from .copies import CopyBackend, HostCopyBackend
from .exchange import Exchange
from .slots import StagingPool
from .storage import DataSource, Storage, storage_for


def resolve_checkpoint(path: str, storage: Storage) -> str:
    """An iteration directory, or a save root whose latest published iteration is meant."""
    path = layout.normalize(path)
    if save_root.is_published(storage, path):
        return path
    if layout.iteration_of(path) is None and storage.list(path):
        latest = tracker.find_latest(path, storage)
        if latest.path is not None:
            return latest.path
        raise CheckpointError(f"no published checkpoint under {path!r}")
    if storage.exists(layout.partial_dir(path)) or storage.list(path):
        raise CheckpointError(f"checkpoint {path!r} is not published (an unfinished or failed save): "
                              f"it cannot be loaded")
    raise CheckpointError(f"no checkpoint at {path!r}")


class CheckpointReader:
    """The engine's reader of one published checkpoint: its index, verified reads, loads into any layout.

    A load stops at the first problem. A check (`verify_all`, or `load` with a `Problems` to report to) goes on
    and collects every one; `datastates.audit` adds the structural checks and is what the tools use."""

    def __init__(self, path: str, storage: Storage, pool: StagingPool, backend: CopyBackend,
                 registry: ProviderRegistry):
        """Reads go through `storage` (how: its read mode and threads); those that cannot land in their target
        are staged in `pool`'s slots and copied out by `backend` (the engine's pool, pinned with CUDA, and a copy
        backend of the load's own)."""
        self.storage = storage
        self.path = resolve_checkpoint(path, storage)
        self.pool = pool
        self.backend = backend
        self.registry = registry
        self.index = fmt.read_index(storage, self.path)
        self.world_size = self.index.world_size
        self._parts: dict[int, RankPart] = {}
        self._sources: dict[int, DataSource] = {}
        self._global: dict[str, list[Shard]] | None = None
        self._owned: tuple = ()
        self.stats = LoadStats()  # what this reader read from storage and passed between ranks

    @classmethod
    def open(cls, path: str, threads: int = 4, staging_bytes: int = 256 << 20,
             registry: ProviderRegistry | None = None) -> "CheckpointReader":
        """A reader of its own, for a process that only reads (the tools): the storage `path` names with
        `threads` readers, host staging of `staging_bytes`; `close()` (or leaving a `with` block) frees them."""
        storage, backend = storage_for(path, read_threads=threads), HostCopyBackend()
        pool = StagingPool(staging_bytes, threads)
        try:
            reader = cls(path, storage, pool, backend, registry or default_registry)
        except BaseException:
            storage.close(), backend.close(), pool.close()
            raise
        reader._owned = (storage, backend, pool)
        return reader

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ----- the index and the files -----

    def part(self, rank: int) -> RankPart:
        """A rank's part (`format.rank_part`), read once; its items are parsed only when a load reads them."""
        if rank not in self._parts:
            self._parts[rank] = fmt.rank_part(self.storage, self.index, rank)
        return self._parts[rank]

    def items(self, rank: int) -> dict[str, Item]:
        """A rank's items, parsed and validated (only for the ranks a load actually reads from)."""
        return self.part(rank).items

    def close(self) -> None:
        """Close the data files this reader opened (and the pools of a reader of its own)."""
        for source in self._sources.values():
            source.close()
        self._sources = {}
        owned, self._owned = self._owned, ()
        for resource in owned:
            resource.close()

    def data_path(self, rank: int) -> str:
        return layout.join(self.path, layout.data_file(rank))

    def data_source(self, rank: int, problems: Problems | None = None) -> DataSource:
        """The rank's data file, open (its items validated first); a short one stops the read unless `problems`
        collects."""
        if rank not in self._sources:
            self.items(rank)  # validated before anything is read
            self._open(rank, problems if problems is not None else Problems.stop())
        return self._sources[rank]

    def _open(self, rank: int, problems: Problems) -> int:
        """Open the rank's data file; its size. A file shorter than the index says is a problem: a load stops,
        a check reads what lies within it."""
        data = self.data_path(rank)
        try:
            f = self.storage.open_source(data)
            size = f.size()
        except OSError as e:
            raise CheckpointError(f"cannot open {data!r}: {e.strerror or e}") from None
        expected = self.part(rank).data_bytes
        if size < expected:
            try:
                problems.add(data, fmt.data_size_problem(data, size, expected), CheckpointCorruptError, rank=rank,
                             offset=size)
            except CheckpointError:
                f.close()
                raise
        self._sources[rank] = f
        return size

    def global_index(self) -> dict[str, list[Shard]]:
        """Every written global item by name, from the raw index: O(items) lookups, no parsing; the shards a
        load reads are parsed and validated with their rank's items (`shard_item`)."""
        if self._global is None:
            index: dict[str, list[Shard]] = {}
            for r in range(self.world_size):
                for shard in self.part(r).shards(r):
                    index.setdefault(shard.name, []).append(shard)
            self._global = index
        return self._global

    def shard_item(self, shard: "Shard") -> Item:
        """The validated item behind a shard of the global index."""
        return self.items(shard.rank)[shard.id]

    # ----- load -----

    @torch.no_grad()
    def load(self, rank: int, template: Any = None, problems: Problems | None = None,
             exchange: Exchange | None = None) -> Any:
        """The state `rank` saved, or `template` filled in place from any layout. With `problems`, a damaged
        read is reported there and the load goes on: the damaged part of its target is undefined (an object
        is None). With `exchange` (a template's load, on every rank of its group at once) each saved byte
        that several ranks want is read by one of them and passed to the others."""
        values: dict[str, Any] = {}
        get = values.__getitem__ if problems is None else values.get
        problems = problems if problems is not None else Problems.stop()
        try:
            skeleton, tensors, objects = self._load_plan(rank, template, values, problems, exchange is not None)
        except CheckpointError as e:
            if exchange is None:
                raise
            exchange.agree(self, [], [], e)  # raises on every rank, naming this one
        if exchange is None:
            with Reads(self, problems) as reads:
                for read, dst in tensors:
                    self._execute(read, dst, reads)
                for saved_rank, item, take in objects:
                    self._queue_object(saved_rank, item, reads, take)
        else:
            plan, error = exchange.agree(self, tensors, objects), None
            try:
                with Reads(self, problems) as reads:
                    for read, dst, span in plan.local_tensors:
                        self._execute(read, dst, reads, span)
                    for saved_rank, item, take in plan.local_objects:
                        self._queue_object(saved_rank, item, reads, take)
            except CheckpointError as e:
                error = e
            exchange.move(self, plan, error)
        return unflatten(skeleton, get)

    def _load_plan(self, rank: int, template: Any, values: dict, problems: Problems, shared: bool):
        """(skeleton, tensor reads, object reads) of a load; `values` receives each target (an object once it is
        read). `shared`: every rank reads a global object from the same saved copy (the exchange passes it)."""
        # a rank beyond the saved world (loading into more ranks) can still fill global items
        own = self.items(rank) if template is None or rank < self.world_size else {}
        if template is None:
            skeleton = self._read_object(rank, self._item(own, fmt.SKELETON_ID, rank))
            self._check_skeleton(skeleton, own, rank)
            wanted = [(it, torch.empty(it.shape, dtype=dtype_from_name(it.dtype)) if it.kind == Kind.TENSOR else None)
                      for it in own.values() if it.id != fmt.SKELETON_ID]
        else:
            skeleton, entries = self.registry.flatten(template)
            wanted = [(e.item, _writable(e.source) if e.item.kind == Kind.TENSOR else None) for e in entries]
        tensors: list[tuple[BoxRead, torch.Tensor]] = []
        objects = []
        for target, dst in wanted:
            if target.kind == Kind.OBJECT:
                saved_rank, item = self._saved_object(target, own, rank, shared)
                objects.append((saved_rank, item, self._unpickler(
                    saved_rank, item, problems, functools.partial(values.__setitem__, target.id))))
                continue
            values[target.id] = dst
            if target.scope == Scope.GLOBAL:
                reads = self._plan_box(target.name, Box(tuple(target.global_offset), tuple(dst.shape)),
                                       target.global_shape, dst)
            else:
                reads = plan_whole(rank, self._saved_tensor(target, own, rank))
            tensors.extend((read, dst) for read in reads)
        return skeleton, tensors, objects

    def _check_skeleton(self, skeleton: Any, own: dict[str, Item], rank: int) -> None:
        """Every leaf of the saved structure must be an item of the index. The structure is pickled in the data
        file, not in the index (so `schema` cannot check this): an index whose item ids were edited (and
        re-signed) would otherwise fail in `unflatten` with a bare KeyError, after reading every item."""
        for key in item_ids(skeleton):
            if not isinstance(key, str) or key == fmt.SKELETON_ID or key not in own:
                raise CheckpointCorruptError(
                    f"checkpoint {self.path!r} (rank {rank}) is malformed: its saved state structure "
                    f"({fmt.SKELETON_ID!r}) refers to item {key!r}, which its index does not list")

    def _item(self, items: dict[str, Item], key: str, rank: int) -> Item:
        if rank >= self.world_size:
            raise CheckpointError(f"checkpoint {self.path!r} was saved by {self.world_size} rank(s): rank {rank} "
                                  f"has no rank-local item {key!r} there (only global items reshard)")
        if key not in items:
            raise CheckpointError(f"checkpoint {self.path!r} (rank {rank}) has no item {key!r}")
        return items[key]

    def _saved_object(self, target: Item, own: dict[str, Item], rank: int, shared: bool) -> tuple[int, Item]:
        if target.scope == Scope.LOCAL:
            saved = self._item(own, target.id, rank)
            if saved.kind != Kind.OBJECT:
                raise CheckpointError(f"checkpoint {self.path!r} item {target.id!r} is a {saved.kind}, "
                                      f"the target wants an object")
            return rank, saved
        return self._global_object(target.name, None if shared else rank)

    def _saved_tensor(self, target: Item, own: dict[str, Item], rank: int) -> Item:
        saved = self._item(own, target.id, rank)
        if (saved.kind, saved.dtype, saved.shape) != (target.kind, target.dtype, target.shape):
            raise CheckpointError(
                f"checkpoint {self.path!r} item {target.id!r} is {saved.kind} {saved.dtype} {saved.shape}, "
                f"the target wants {target.kind} {target.dtype} {target.shape}")
        return saved

    @torch.no_grad()
    def read_item(self, rank: int, item: Item) -> Any:
        """One stored item of `rank`, verified: a new CPU tensor, or the unpickled object."""
        if item.kind == Kind.OBJECT:
            return self._read_object(rank, item)
        dst = torch.empty(item.shape, dtype=dtype_from_name(item.dtype))
        with Reads(self) as reads:
            self._read_whole(rank, item, dst, reads)
        return dst

    def verify(self, rank: int) -> None:
        """Read every item `rank` saved and check every checksum (raises on the first damage); nothing is kept."""
        for item in self.items(rank).values():
            self.read_item(rank, item)

    @torch.no_grad()
    def verify_all(self, problems: Problems, ranks=None, progress: Callable[[int], None] | None = None) -> dict:
        """Read every written item of `ranks` (default all) and check every chunk's crc32c, reporting each bad
        chunk, failed read and short file to `problems` and going on; nothing is kept. The structure is
        `datastates.audit`'s: a rank without a valid part and an item that does not validate are skipped here.
        `progress` receives the bytes of each read as it is submitted. Returns {"bytes_read", "chunks"}."""
        stats = {"bytes_read": 0, "chunks": 0}
        with Reads(self, problems) as reads:
            for rank in range(self.world_size) if ranks is None else ranks:
                for item in self._readable_items(rank, problems):
                    for first, last, nbytes in _chunk_groups(item, reads.pool.slot_bytes):
                        buf, slot, fresh = reads.buffer(nbytes)
                        reads.read_chunks(rank, item, first, last, buf, None, slot, fresh)
                        stats["bytes_read"] += nbytes
                        stats["chunks"] += last - first
                        if progress is not None:
                            progress(nbytes)
        return stats

    # ----- by name: what tools read -----

    def tensors(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Every global tensor: name -> (global shape, dtype), from the index alone."""
        return {name: (tuple(shards[0].global_shape), dtype_from_name(shards[0].dtype))
                for name, shards in self.global_index().items() if shards[0].kind == Kind.TENSOR}

    def objects(self) -> list[str]:
        """The names of every global object, sorted."""
        return sorted(name for name, shards in self.global_index().items() if shards[0].kind == Kind.OBJECT)

    @torch.no_grad()
    def tensor(self, name: str, offset: tuple[int, ...] | None = None, shape: tuple[int, ...] | None = None,
               out: torch.Tensor | None = None, problems: Problems | None = None) -> torch.Tensor:
        """The box (`offset`, `shape`) of the global tensor `name`, whole by default, assembled from whichever
        ranks' shards hold it, every chunk's crc32c verified: a new CPU tensor, or `out` filled (a buffer a
        reader of many boxes reuses). Where no shard holds part of a new tensor, that part is zero, not whatever the
        allocator left there, so two reads of one checkpoint never differ. With `problems`, a damaged read is
        reported there and the box's damaged part is undefined."""
        found = self.tensors().get(name)
        if found is None:
            raise CheckpointError(f"checkpoint {self.path!r} has no tensor named {name!r}")
        global_shape, dtype = found
        box = _box_within(name, global_shape, offset, shape)
        dst = out if out is not None else torch.zeros(box.shape, dtype=dtype)
        if tuple(dst.shape) != box.shape or dst.dtype != dtype:
            raise ValueError(f"out is {dst.dtype} {tuple(dst.shape)}, the box of {name!r} is {dtype} {box.shape}")
        with Reads(self, problems) as reads:
            self._read_box(name, box, global_shape, dst, reads)
        return dst

    def object(self, name: str, problems: Problems | None = None) -> Any:
        """The global object `name` (rank 0's copy when it wrote one), verified and unpickled. With `problems`, a
        damaged one is reported there and None is returned."""
        return self._read_object(*self._global_object(name, 0), problems)

    @torch.no_grad()
    def common(self, problems: Problems | None = None) -> Any:
        """The common state: the state rank 0 saved, less its sharded part. Its common values (the objects
        `names.common_name(path)`, which `datastates.megatron.Common` saves) and its rank-local items stay in the
        saved structure; global tensors, other global objects and the containers left empty by dropping them go.
        With `problems`, a damaged value is reported there and is None."""
        own = self.items(0)
        skeleton = self._read_object(0, self._item(own, fmt.SKELETON_ID, 0))
        self._check_skeleton(skeleton, own, 0)
        wanted = [item for item in own.values() if _in_common(item)]
        values: dict[str, Any] = {}
        with Reads(self, problems) as reads:
            for item in wanted:
                if item.kind == Kind.OBJECT:
                    saved_rank, saved = self._saved_object(item, own, 0, False)
                    self._queue_object(saved_rank, saved, reads, self._unpickler(
                        saved_rank, saved, reads.problems, functools.partial(values.__setitem__, item.id)))
                else:
                    values[item.id] = dst = torch.empty(item.shape, dtype=dtype_from_name(item.dtype))
                    self._read_whole(0, item, dst, reads)
        ids, dropped = {item.id for item in wanted}, object()  # dropped: a sharded item, until pruned
        return _pruned(unflatten(skeleton, lambda key: values.get(key) if key in ids else dropped), dropped)

    def _read_box(self, name: str, box: Box, global_shape: tuple, dst: torch.Tensor, reads: Reads) -> None:
        """Fill `dst` with the `box` of the global tensor `name` from every saved shard it overlaps."""
        for read in self._plan_box(name, box, global_shape, dst):
            self._execute(read, dst, reads)

    def _plan_box(self, name: str, box: Box, global_shape: tuple, dst: torch.Tensor) -> list[BoxRead]:
        """The reads that fill `dst` with the `box` of the global tensor `name` (`load_plan.plan_global`)."""
        return plan_global(f"checkpoint {self.path!r}", name, box, tuple(global_shape), dtype_name(dst.dtype),
                           self.global_index().get(name, ()), self.shard_item)

    def _global_object(self, name: str, rank: int | None) -> tuple[int, Item]:
        """The saved copy of the global object `name` to read: `rank`'s own when it wrote one, else (or with no
        rank) the lowest rank's."""
        holders = [sh for sh in self.global_index().get(name, []) if sh.kind == Kind.OBJECT]
        if not holders:
            raise CheckpointError(f"checkpoint {self.path!r} has no object named {name!r}")
        shard = min(holders, key=lambda sh: (sh.rank != rank, sh.rank))
        return shard.rank, self.shard_item(shard)

    # ----- the reads of a load, a check and the by-name API -----

    def _readable_items(self, rank: int, problems: Problems) -> list[Item]:
        """The valid written items of `rank` that lie within its data file, which is opened here."""
        try:
            items, _ = self.part(rank).checked_items()
            size = self._open(rank, problems) if rank not in self._sources else self._sources[rank].size()
        except CheckpointError as e:
            problems.add(self.data_path(rank), str(e), rank=rank)
            return []
        return [it for it in items.values() if it.write and it.nbytes and it.offset + it.stored_bytes <= size]

    def _read_object(self, rank: int, item: Item, problems: Problems | None = None) -> Any:
        out = []
        with Reads(self, problems) as reads:
            self._queue_object(rank, item, reads, self._unpickler(rank, item, reads.problems, out.append))
        return out[0] if out else None  # nothing: damaged, reported to `problems`

    def _unpickler(self, rank: int, item: Item, problems: Problems, then: Callable[[Any], None]):
        """What takes the verified bytes of a pickled object: `then` receives the object."""
        path = self.data_path(rank)

        def unpickle(buffer: torch.Tensor) -> None:
            try:
                value = fmt.loads(buffer.numpy().tobytes(), f"{item.id!r} in {path!r}")
            except CheckpointError as e:
                problems.add(path, str(e), type(e), rank=rank, item=item.id, offset=item.offset)
                return
            then(value)
        return unpickle

    def _queue_object(self, rank: int, item: Item, reads: Reads, take: Callable[[torch.Tensor], None]) -> None:
        """Read a pickled object in the load's batch; `take` (an `_unpickler`) receives its verified bytes."""
        buf, slot, fresh = reads.buffer(item.nbytes)
        reads.read_chunks(rank, item, 0, len(item.chunks()), buf, take, slot, fresh)

    def _read_whole(self, rank: int, saved: Item, dst: torch.Tensor, reads: Reads) -> None:
        """Fill `dst` (of the saved shape) with the whole saved item."""
        for read in plan_whole(rank, saved):
            self._execute(read, dst, reads)

    def _execute(self, read: BoxRead, dst: torch.Tensor, reads: Reads, span: tuple[int, int] | None = None) -> None:
        """Submit one box read of the load plan into `dst` (only its item's chunks `span`, when given).

        A whole saved item bound for a contiguous host view is streamed straight into it (`Reads.reads_into`).
        Otherwise the read goes in pieces through the slots, and each piece's part of the box is copied out. In
        read mode "parallel" even a whole tensor into a contiguous host target goes through the slots: O_DIRECT
        into the same few hot slots, then a memcpy on the copy threads, is faster than O_DIRECT straight into
        the target's own pages (measured: docs/architecture.md, "A load")."""
        if read.whole and span in (None, read.span()):
            view = dst[read.dst]
            if reads.reads_into(read.rank, view):
                reads.read_chunks(read.rank, read.item, 0, len(read.item.crcs), view.reshape(-1).view(torch.uint8))
                return
        for piece in read.pieces(reads.pool.slot_bytes, span):
            buf, slot, fresh = reads.buffer(piece.stop - piece.start)
            reads.read_chunks(read.rank, read.item, piece.first, piece.last, buf,
                              functools.partial(piece.place, dst=dst, copy=reads.place), slot, fresh)


def _chunk_groups(item: Item, max_bytes: int):
    """(first, last, nbytes) of runs of whole checksum chunks of `item`, each at most `max_bytes` (or one chunk)."""
    chunks = item.chunks()
    first = 0
    while first < len(chunks):
        last, start = first + 1, chunks[first][0]
        while last < len(chunks) and chunks[last][0] + chunks[last][1] - start <= max_bytes:
            last += 1
        yield first, last, chunks[last - 1][0] + chunks[last - 1][1] - start
        first = last


def _box_within(name: str, global_shape: tuple, offset, shape) -> Box:
    """The box (`offset`, `shape`) of the tensor `name`, checked to lie within its global shape; by default from
    `offset` (default the origin) to the end of every axis."""
    offset = tuple(offset) if offset is not None else (0,) * len(global_shape)
    shape = tuple(shape) if shape is not None else tuple(g - o for g, o in zip(global_shape, offset))
    if not (len(offset) == len(shape) == len(global_shape)
            and all(0 <= o and 0 <= n and o + n <= g for o, n, g in zip(offset, shape, global_shape))):
        raise ValueError(f"box at offset {offset} of shape {shape} is not within {name!r} of global shape "
                         f"{tuple(global_shape)}")
    return Box(offset, shape)


def _in_common(item: Item) -> bool:
    """Whether rank 0's `item` is part of the common state: a rank-local item or a common value."""
    return item.id != fmt.SKELETON_ID and (item.scope == Scope.LOCAL or (
        item.kind == Kind.OBJECT and common_path(item.name) is not None))


def _pruned(state: Any, dropped: object) -> Any:
    """`state` without the values that are `dropped`, nor the containers of it that held only such values."""
    if not isinstance(state, (dict, list, tuple)):
        return state
    kept = []
    for key, value in state.items() if isinstance(state, dict) else enumerate(state):
        pruned = _pruned(value, dropped)
        if pruned is not dropped and not (isinstance(value, (dict, list, tuple)) and value and not pruned):
            kept.append((key, pruned))
    if isinstance(state, dict):
        out = copy.copy(state)  # of the same mapping type (an OrderedDict, a defaultdict)
        out.clear()
        out.update(kept)
        return out
    values = [v for _, v in kept]
    if isinstance(state, list):
        return values
    return type(state)(*values) if hasattr(state, "_fields") else tuple(values)


def _writable(t: torch.Tensor) -> torch.Tensor:
    """The template tensor itself, unless it cannot be written in place (an expanded view): then a new one."""
    if any(st == 0 and n > 1 for st, n in zip(t.stride(), t.shape)):
        return torch.empty(t.shape, dtype=t.dtype, device=t.device)
    return t
