"""A published checkpoint open for reading: what the public reader, the engine's loader and the verifier share.

Everything a read needs to know is in one file, the global index in metadata.json (schema 2; schema 1
checkpoints are read through their per-rank manifests). Rank-local items are found by id among the same rank's
items. Global items (shards of a logical tensor) are indexed by name across every rank's items; each target
shard reads exactly the rows of the saved shards it overlaps, widened to whole checksum chunks so every byte
read is verified: the load plan (`load_plan`), computed without I/O and executed here. Only the data files
holding wanted bytes are opened, through the storage (`DataSource`: on a file system one sequential stream, or
several O_DIRECT reads in flight); a whole item streams straight into a contiguous host target, other reads land
in the staging slots and are copied out into the targets while later reads are in flight.

Three jobs read through it, each in its own module: `reader` (the public API: tensors and objects by name, the
common state), `loader` (the engine's load: a template filled from any layout, the read-once exchange) and
`verifier` (every byte checked: the audit, the memory tier's restart).
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import torch

from . import format as fmt
from . import paths, tracker
from .errors import CheckpointCorruptError, CheckpointError
from .load_plan import BoxRead, plan_global, plan_whole
from .load_reads import LoadStats, Reads
from .problems import Problems
from .providers import item_ids
from .schema import Box, Item, Kind, RankPart, Scope, Shard, dtype_name
from .copies import CopyBackend, HostCopyBackend
from .slots import StagingPool
from .storage import DataSource, Storage, storage_for


def resolve_checkpoint(path: str, storage: Storage) -> str:
    """An iteration directory, or a save root whose latest published iteration is meant."""
    path = paths.normalize(path)
    if tracker.is_published(path, storage):
        return path
    if paths.iteration_of(path) is None and storage.list(path):
        latest = tracker.find_latest(path, storage)
        if latest.path is not None:
            return latest.path
        raise CheckpointError(f"no published checkpoint under {path!r}")
    if storage.exists(paths.partial_dir(path)) or storage.list(path):
        raise CheckpointError(f"checkpoint {path!r} is not published (an unfinished or failed save): "
                              f"it cannot be loaded")
    raise CheckpointError(f"no checkpoint at {path!r}")


class OpenCheckpoint:
    """One published checkpoint, open: its index, its ranks' parts and data files, the global index by name, and
    the verified reads of items, boxes and objects (the `ReadSource` of `load_reads.Reads`) that the reader, the
    loader and the verifier execute. What a damaged read does is the caller's `Problems`."""

    def __init__(self, path: str, storage: Storage, pool: StagingPool, backend: CopyBackend):
        """Reads go through `storage` (how: its read mode and threads); those that cannot land in their target
        are staged in `pool`'s slots and copied out by `backend` (the engine's pool, pinned with CUDA, and a copy
        backend of the load's own)."""
        self.storage = storage
        self.path = resolve_checkpoint(path, storage)
        self.pool = pool
        self.backend = backend
        self.index = fmt.read_index(storage, self.path)
        self.world_size = self.index.world_size
        self._parts: dict[int, RankPart] = {}
        self._sources: dict[int, DataSource] = {}
        self._global: dict[str, list[Shard]] | None = None
        self._owned: tuple = ()
        self.stats = LoadStats()  # what was read from storage and passed between ranks

    @classmethod
    def standalone(cls, path: str, threads: int = 4, staging_bytes: int = 256 << 20) -> "OpenCheckpoint":
        """For a process that only reads (the tools, the audit): the storage `path` names with `threads` readers,
        host staging of `staging_bytes`; `close()` (or leaving a `with` block) frees them."""
        storage, backend = storage_for(path, read_threads=threads), HostCopyBackend(beside_training=False)
        pool = StagingPool(staging_bytes, threads)
        try:
            checkpoint = cls(path, storage, pool, backend)
        except BaseException:
            storage.close(), backend.close(), pool.close()
            raise
        checkpoint._owned = (storage, backend, pool)
        return checkpoint

    def __enter__(self) -> "OpenCheckpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Close the data files opened here (and the storage and pools of a standalone one)."""
        for source in self._sources.values():
            source.close()
        self._sources = {}
        owned, self._owned = self._owned, ()
        for resource in owned:
            resource.close()

    # ----- the index and the files -----

    def part(self, rank: int) -> RankPart:
        """A rank's part (`format.rank_part`), read once; its items are parsed only when a read needs them."""
        if rank not in self._parts:
            self._parts[rank] = fmt.rank_part(self.storage, self.index, rank)
        return self._parts[rank]

    def items(self, rank: int) -> dict[str, Item]:
        """A rank's items, parsed and validated (only for the ranks a read actually reads from)."""
        return self.part(rank).items

    def data_path(self, rank: int) -> str:
        return paths.join(self.path, paths.data_file(rank))

    def data_source(self, rank: int, problems: Problems | None = None) -> DataSource:
        """The rank's data file, open (its items validated first); a short one stops the read unless `problems`
        collects."""
        if rank not in self._sources:
            self.items(rank)  # validated before anything is read
            self.open_data(rank, problems if problems is not None else Problems.stop())
        return self._sources[rank]

    def open_data(self, rank: int, problems: Problems) -> int:
        """The size of the rank's data file, opened once. A file shorter than the index says is a problem: a load
        stops, a check reads what lies within it."""
        if rank in self._sources:
            return self._sources[rank].size()
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
        read needs are parsed and validated with their rank's items (`shard_item`). A tensor shard that a lower
        rank wrote too (the same box: replicas, as in a checkpoint merged from self-contained memory-tier parts)
        is listed once."""
        if self._global is None:
            index: dict[str, list[Shard]] = {}
            seen: set = set()
            for r in range(self.world_size):
                for shard in self.part(r).shards(r):
                    key = (shard.name, shard.kind, shard.dtype, shard.box, shard.global_shape)
                    if shard.kind == Kind.OBJECT or key not in seen:
                        seen.add(key)
                        index.setdefault(shard.name, []).append(shard)
            self._global = index
        return self._global

    def shard_item(self, shard: "Shard") -> Item:
        """The validated item behind a shard of the global index."""
        return self.items(shard.rank)[shard.id]

    # ----- the saved items a read asks for -----

    def item(self, items: dict[str, Item], key: str, rank: int) -> Item:
        """The rank-local item `key` among `rank`'s `items`."""
        if rank >= self.world_size:
            raise CheckpointError(f"checkpoint {self.path!r} was saved by {self.world_size} rank(s): rank {rank} "
                                  f"has no rank-local item {key!r} there (only global items reshard)")
        if key not in items:
            raise CheckpointError(f"checkpoint {self.path!r} (rank {rank}) has no item {key!r}")
        return items[key]

    def skeleton(self, rank: int) -> Any:
        """The saved state structure of `rank`, each of its leaves checked to be an item of the index. The
        structure is pickled in the data file, not in the index (so `schema` cannot check this): an index whose
        item ids were edited (and re-signed) would otherwise fail in `unflatten` with a bare KeyError, after
        reading every item."""
        own = self.items(rank)
        skeleton = self.read_object(rank, self.item(own, fmt.SKELETON_ID, rank))
        for key in item_ids(skeleton):
            if not isinstance(key, str) or key == fmt.SKELETON_ID or key not in own:
                raise CheckpointCorruptError(
                    f"checkpoint {self.path!r} (rank {rank}) is malformed: its saved state structure "
                    f"({fmt.SKELETON_ID!r}) refers to item {key!r}, which its index does not list")
        return skeleton

    def saved_object(self, target: Item, own: dict[str, Item], rank: int, shared: bool) -> tuple[int, Item]:
        """(saved rank, item) of the object `target` of `rank` (whose items are `own`); a global one is `rank`'s
        copy unless `shared` (then every rank reads the same: the lowest rank's)."""
        if target.scope == Scope.LOCAL:
            saved = self.item(own, target.id, rank)
            if saved.kind != Kind.OBJECT:
                raise CheckpointError(f"checkpoint {self.path!r} item {target.id!r} is a {saved.kind}, "
                                      f"the target wants an object")
            return rank, saved
        return self.global_object(target.name, None if shared else rank)

    def global_object(self, name: str, rank: int | None) -> tuple[int, Item]:
        """The saved copy of the global object `name` to read: `rank`'s own when it wrote one, else (or with no
        rank) the lowest rank's."""
        holders = [sh for sh in self.global_index().get(name, []) if sh.kind == Kind.OBJECT]
        if not holders:
            raise CheckpointError(f"checkpoint {self.path!r} has no object named {name!r}")
        shard = min(holders, key=lambda sh: (sh.rank != rank, sh.rank))
        return shard.rank, self.shard_item(shard)

    def plan_box(self, name: str, box: Box, global_shape: tuple, dst: torch.Tensor) -> list[BoxRead]:
        """The reads that fill `dst` with the `box` of the global tensor `name` (`load_plan.plan_global`)."""
        return plan_global(f"checkpoint {self.path!r}", name, box, tuple(global_shape), dtype_name(dst.dtype),
                           self.global_index().get(name, ()), self.shard_item)

    # ----- the reads -----

    def read_object(self, rank: int, item: Item, problems: Problems | None = None) -> Any:
        """One pickled object, verified and unpickled; None when damaged and `problems` collects."""
        out = []
        with Reads(self, problems) as reads:
            self.queue_object(rank, item, reads, self.unpickler(rank, item, reads.problems, out.append))
        return out[0] if out else None  # nothing: damaged, reported to `problems`

    def unpickler(self, rank: int, item: Item, problems: Problems, then: Callable[[Any], None]):
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

    def queue_object(self, rank: int, item: Item, reads: Reads, take: Callable[[torch.Tensor], None]) -> None:
        """Read a pickled object in the reads' batch; `take` (an `unpickler`) receives its verified bytes."""
        buf, slot, fresh = reads.buffer(item.nbytes)
        reads.read_chunks(rank, item, 0, len(item.chunks()), buf, take, slot, fresh)

    def read_whole(self, rank: int, saved: Item, dst: torch.Tensor, reads: Reads) -> None:
        """Fill `dst` (of the saved shape) with the whole saved item."""
        for read in plan_whole(rank, saved):
            self.execute(read, dst, reads)

    def execute(self, read: BoxRead, dst: torch.Tensor, reads: Reads, span: tuple[int, int] | None = None) -> None:
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
