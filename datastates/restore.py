"""Read a published checkpoint back: verify, and reshard into whatever layout the target asks for.

Everything a load needs to know is in one file, the global index in metadata.json (schema 2; schema 1
checkpoints are read through their per-rank manifests). Rank-local items are found by id among the same rank's
items. Global items (shards of a logical tensor) are indexed by name across every rank's items; each target
shard reads exactly the rows of the saved shards it overlaps, widened to whole checksum chunks so every byte
read is verified: the load plan (`load_plan`), computed without I/O and executed here. Only the data files
holding wanted bytes are opened. Each is read through the native pool as
one sequential stream (read mode "stream") or with several O_DIRECT reads in flight ("parallel"); a whole item
streams straight into a contiguous host target, other reads land in the staging slots and are copied out into
the targets while later reads are in flight.
"""
from __future__ import annotations

import functools
import os
from collections import deque
from typing import Any, Callable, NamedTuple

import torch

from . import _native
from . import commit
from . import format as fmt
from .errors import CheckpointCorruptError, CheckpointError
from .load_plan import BoxRead, Piece, plan_global, plan_whole
from .plan import ALIGN
from .providers import ProviderRegistry, unflatten
from .schema import Box, Item, RankPart, Shard, dtype_from_name, dtype_name, volume
from .snapshot import CopyBackend
from .staging import Slot, StagingPool


# How a load reads the data files (see CheckpointReader). "stream" is the default: on this project's test VM
# one buffered stream read a rank's file at 2.1-3.3 GB/s where O_DIRECT from 1, 4 or 8 threads reached
# 1.1-1.9 GB/s (benchmarks/RESULTS.md, the raw reads of each configuration).
READ_MODES = ("stream", "parallel")
# A load reads at most this far ahead of its copies out: enough to keep 8 reads of 8 MiB in flight several times
# over, little enough that the same few slots go round while their pages are hot.
READ_AHEAD_BYTES = 256 << 20


def check_read_mode(read_mode: str) -> None:
    if read_mode not in READ_MODES:
        raise ValueError(f"read_mode must be one of {READ_MODES}, not {read_mode!r}")


def resolve_checkpoint(path: str) -> str:
    """An iteration directory, or a save root whose latest published iteration is meant."""
    path = os.path.normpath(path)
    if commit.is_published(path):
        return path
    if os.path.isdir(path) and commit.iteration_of(path) is None:
        latest = commit.find_latest(path)
        if latest.path is not None:
            return latest.path
        raise CheckpointError(f"no published checkpoint under {path!r}")
    if os.path.isdir(commit.partial_dir(path)) or (os.path.isdir(path) and not commit.is_published(path)):
        raise CheckpointError(f"checkpoint {path!r} is not published (an unfinished or failed save): "
                              f"it cannot be loaded")
    raise CheckpointError(f"no checkpoint at {path!r}")


def _aligned_empty(nbytes: int) -> torch.Tensor:
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8)
    skip = (-raw.data_ptr()) % ALIGN
    return raw[skip:skip + nbytes]


class _Read(NamedTuple):
    ticket: int
    rank: int
    item: Item
    first: int  # chunks [first, first + len(crcs)) of the item
    buffer: torch.Tensor
    place: Callable[[torch.Tensor], None] | None  # what to do with the verified bytes
    slot: Slot | None  # the staging slot the bytes landed in, if any
    fresh: int  # bytes of a buffer allocated for this read alone


class _Held:
    """A buffer of its own (for a chunk larger than a slot) and the completions of the copies out of it: the
    host copy threads read it after its read completed, so it must live until they have landed."""

    __slots__ = ("buffer", "nbytes", "waits")

    def __init__(self, buffer: torch.Tensor, nbytes: int):
        self.buffer, self.nbytes, self.waits = buffer, nbytes, []


class _Reads:
    """One load's reads: submitted to the native pool as soon as known, completed oldest first (verified, then
    placed), so reading, checksum verification (on the pool's threads) and placement all overlap.

    Stream reads of whole items land straight in contiguous host targets. Every other read lands in the engine's
    staging slots (pinned with CUDA), at most READ_AHEAD_BYTES ahead of the copies out of them; a slot goes back
    to the pool once those copies have landed. Staged memory is the pool's budget at most, plus buffers of their
    own for chunks larger than a slot, bounded by the same budget."""

    def __init__(self, reader: "CheckpointReader"):
        self.reader = reader
        self.pool, self.backend = reader.pool, reader.backend
        self.ordering = self.backend.begin()
        self.window = max(self.pool.slot_bytes, min(self.pool.budget_bytes, READ_AHEAD_BYTES))
        self.ahead = 0  # bytes of the pending reads into slots
        self.pending: deque[_Read] = deque()
        self.placed: list[Slot] = []  # slots whose copies out may still be landing
        self.held: list[_Held] = []  # buffers of their own whose copies out may still be landing
        self.fresh = 0  # bytes of the buffers of their own, pending or held

    def read_chunks(self, rank: int, item: Item, first: int, last: int, dst: torch.Tensor, place=None,
                    slot: Slot | None = None, fresh: int = 0) -> None:
        """Read chunks [first, last) of a stored item into the uint8 tensor `dst`, to be verified, then handed
        to `place`. `dst` is `slot`'s memory, or `fresh` bytes of its own (see `buffer`)."""
        try:
            chunks = item.chunks()[first:last]
            start = chunks[0][0]
            nbytes = chunks[-1][0] + chunks[-1][1] - start
            if nbytes > dst.numel() * dst.element_size():
                raise CheckpointCorruptError(f"item {item.id!r} in {self.reader.data_path(rank)!r}: {nbytes} "
                                             f"bytes do not fit the {dst.numel() * dst.element_size()}-byte "
                                             f"destination")
            segments = [(s - start, n) for s, n in chunks]
            f = self.reader.data_file(rank)
            ticket = self.reader.io.submit_read(f, dst.data_ptr(), nbytes, item.offset + start, segments)
        except BaseException:  # nothing was submitted: the memory goes back now
            self.fresh -= fresh
            if slot is not None:
                self.pool.release(slot)
            raise
        self.pending.append(_Read(ticket, rank, item, first, dst, place, slot, fresh))
        if slot is not None:
            self.ahead += dst.numel()

    def buffer(self, nbytes: int) -> tuple[torch.Tensor, Slot | None, int]:
        """Memory for a staged read of `nbytes`: a slot when one is big enough, else a buffer of its own."""
        if nbytes > self.pool.slot_bytes:
            while self.fresh + nbytes > self.pool.budget_bytes and (self.pending or self.held):
                if self.held:
                    self.release_held()
                else:
                    self.complete_oldest()
            self.fresh += nbytes
            return _aligned_empty(nbytes), None, nbytes
        if self.ahead + nbytes > self.window:  # never with nothing pending: a slot fits in the window
            while self.pending and self.ahead + nbytes > self.window:
                self.complete_oldest()
            self.release_placed()  # the slots just read go round again while their pages are hot
        while (slot := self.pool.acquire(block=False)) is None:
            if self.placed:
                self.release_placed()
            elif any(r.slot is not None for r in self.pending):
                self.complete_oldest()
            else:  # every slot is held by saves in flight: their writers hand them back
                slot = self.pool.acquire()
                break
        return slot.buffer[:nbytes], slot, 0

    def place(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.backend.copy(dst, src, self.ordering)

    def reads_into(self, dst: torch.Tensor) -> bool:
        """Whether bytes for `dst` are read straight into it: a stream read copies out of the page cache
        anyway, and into a contiguous host tensor that copy is the only one (a slot would add a second)."""
        return self.reader.read_mode == "stream" and dst.device.type == "cpu" and dst.is_contiguous()

    def complete_oldest(self) -> None:
        read = self.pending.popleft()
        if read.slot is not None:
            self.ahead -= read.buffer.numel()
            self.placed.append(read.slot)  # given back after the copies out of it, or after a failure
        try:
            crcs = self.reader.io.wait(read.ticket)
        except OSError as e:
            raise CheckpointCorruptError(f"reading item {read.item.id!r} from {self.reader.data_path(read.rank)!r} "
                                         f"failed: {e.strerror or e}") from None
        for index, crc in enumerate(crcs, read.first):
            if crc != read.item.crcs[index]:
                raise CheckpointCorruptError(
                    f"checksum mismatch in {self.reader.data_path(read.rank)!r}: item {read.item.id!r} chunk "
                    f"{index} (file offset {read.item.offset + read.item.chunks()[index][0]}) reads crc32c "
                    f"{crc:#010x}, the index says {read.item.crcs[index]:#010x}")
        if read.place is not None:
            read.place(read.buffer)
        if read.slot is not None:
            self.backend.mark(read.slot)
        elif read.fresh:  # the copies out of it may read it after this returns: it lives until they landed
            held = _Held(read.buffer, read.fresh)
            self.backend.mark(held)
            self.held.append(held)

    def release_held(self) -> None:
        held, self.held = self.held, []
        for buffer in held:
            self.backend.ready(buffer)
            self.fresh -= buffer.nbytes

    def release_placed(self) -> None:
        placed, self.placed = self.placed, []
        for slot in placed:
            self.backend.ready(slot)
            self.pool.release(slot)

    def __enter__(self) -> "_Reads":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finish()
        else:
            self.abort()

    def finish(self) -> None:
        """Complete every read and every copy out of the slots; on failure, wait out the rest, then raise."""
        try:
            while self.pending:
                self.complete_oldest()
            self.backend.finish()
        except BaseException:
            self.abort()
            raise
        self.release_placed()
        self.held = []

    def abort(self) -> None:
        """Wait for whatever is still in flight (its memory must outlive it) and give every slot back."""
        pending, self.pending = self.pending, deque()
        for read in pending:
            try:
                self.reader.io.wait(read.ticket)
            except OSError:
                pass
            if read.slot is not None:
                self.placed.append(read.slot)
        try:
            self.backend.finish()
        except BaseException:  # noqa: BLE001 - the failure being raised is the one to report
            pass
        for slot in self.placed:
            self.pool.release(slot)
        self.placed, self.held = [], []


class CheckpointReader:
    def __init__(self, path: str, io: _native.IOPool, pool: StagingPool, backend: CopyBackend,
                 registry: ProviderRegistry, read_mode: str = "stream", direct_io: str = "auto"):
        """Reads go through `io`; those that cannot land in their target are staged in `pool`'s slots and copied
        out by `backend` (the engine's pool, pinned with CUDA, and a copy backend of the load's own).

        `read_mode` "stream" reads each data file as one sequential stream through the page cache: the kernel's
        readahead keeps the device busy, and the pages read are dropped behind. "parallel" keeps as many reads
        of a file in flight as `io` has threads, with O_DIRECT as `direct_io` ("auto", "on", "off") says."""
        check_read_mode(read_mode)
        self.path = resolve_checkpoint(path)
        self.io = io
        self.pool = pool
        self.backend = backend
        self.registry = registry
        self.read_mode, self.direct_io = read_mode, direct_io
        self.index = fmt.read_index(os.path.join(self.path, fmt.METADATA))
        self.world_size = self.index.world_size
        self._parts: dict[int, RankPart] = {}
        self._files: dict[int, _native.File] = {}
        self._global: dict[str, list[Shard]] | None = None

    # ----- the index and the files -----

    def part(self, rank: int) -> RankPart:
        """A rank's part (`format.rank_part`), read once; its items are parsed only when a load reads them."""
        if rank not in self._parts:
            self._parts[rank] = fmt.rank_part(self.index, rank)
        return self._parts[rank]

    def items(self, rank: int) -> dict[str, Item]:
        """A rank's items, parsed and validated (only for the ranks a load actually reads from)."""
        return self.part(rank).items

    def close(self) -> None:
        """Close the data files this reader opened."""
        for f in self._files.values():
            f.close()
        self._files = {}

    def data_path(self, rank: int) -> str:
        return os.path.join(self.path, fmt.data_file(rank))

    def data_file(self, rank: int) -> _native.File:
        if rank not in self._files:
            self.items(rank)  # validated before anything is read
            data = self.data_path(rank)
            try:
                f = (_native.File(data, "r", "off", stream=True) if self.read_mode == "stream"
                     else _native.File(data, "r", self.direct_io))
                size = f.size()
            except OSError as e:
                raise CheckpointError(f"cannot open {data!r}: {e.strerror or e}") from None
            expected = self.part(rank).data_bytes
            if size < expected:
                f.close()
                raise CheckpointCorruptError(f"data file {data!r} is truncated: {size} bytes, the checkpoint's "
                                             f"index says {expected}")
            self._files[rank] = f
        return self._files[rank]

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
    def load(self, rank: int, template: Any = None) -> Any:
        # a rank beyond the saved world (loading into more ranks) can still fill global items
        own = self.items(rank) if template is None or rank < self.world_size else {}
        if template is None:
            skeleton = self._read_object(rank, self._item(own, fmt.SKELETON_ID, rank))
            wanted = [(it, torch.empty(it.shape, dtype=dtype_from_name(it.dtype)) if it.kind == "tensor" else None)
                      for it in own.values() if it.id != fmt.SKELETON_ID]
        else:
            skeleton, entries = self.registry.flatten(template)
            wanted = [(e.item, _writable(e.source) if e.item.kind == "tensor" else None) for e in entries]
        values: dict[str, Any] = {}
        with _Reads(self) as reads:
            for target, dst in wanted:
                if target.kind == "object":
                    self._queue_object(*self._saved_object(target, own, rank), reads,
                                       lambda value, key=target.id: values.__setitem__(key, value))
                    continue
                values[target.id] = dst
                if target.scope == "global":
                    self._read_global(target, dst, reads)
                else:
                    self._read_whole(rank, self._saved_tensor(target, own, rank), dst, reads)
        return unflatten(skeleton, values.__getitem__)

    def _item(self, items: dict[str, Item], key: str, rank: int) -> Item:
        if rank >= self.world_size:
            raise CheckpointError(f"checkpoint {self.path!r} was saved by {self.world_size} rank(s): rank {rank} "
                                  f"has no rank-local item {key!r} there (only global items reshard)")
        if key not in items:
            raise CheckpointError(f"checkpoint {self.path!r} (rank {rank}) has no item {key!r}")
        return items[key]

    def _saved_object(self, target: Item, own: dict[str, Item], rank: int) -> tuple[int, Item]:
        if target.scope == "local":
            saved = self._item(own, target.id, rank)
            if saved.kind != "object":
                raise CheckpointError(f"checkpoint {self.path!r} item {target.id!r} is a {saved.kind}, "
                                      f"the target wants an object")
            return rank, saved
        holders = [sh for sh in self.global_index().get(target.name, []) if sh.kind == "object"]
        if not holders:
            raise CheckpointError(f"checkpoint {self.path!r} has no object named {target.name!r}")
        shard = min(holders, key=lambda sh: sh.rank != rank)  # this rank's own copy when it wrote one
        return shard.rank, self.shard_item(shard)

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
        if item.kind == "object":
            return self._read_object(rank, item)
        dst = torch.empty(item.shape, dtype=dtype_from_name(item.dtype))
        with _Reads(self) as reads:
            self._read_whole(rank, item, dst, reads)
        return dst

    def verify(self, rank: int) -> None:
        """Read every item `rank` saved and check every checksum (raises on the first damage); nothing is kept."""
        for item in self.items(rank).values():
            self.read_item(rank, item)

    def _read_object(self, rank: int, item: Item) -> Any:
        out = []
        with _Reads(self) as reads:
            self._queue_object(rank, item, reads, out.append)
        return out[0]

    def _queue_object(self, rank: int, item: Item, reads: _Reads, then: Callable[[Any], None]) -> None:
        """Read a pickled object in the load's batch; `then` receives it once its bytes are verified."""
        where = f"{item.id!r} in {self.data_path(rank)!r}"
        buf, slot, fresh = reads.buffer(item.nbytes)
        reads.read_chunks(rank, item, 0, len(item.chunks()), buf,
                          lambda b: then(fmt.loads(b.numpy().tobytes(), where)), slot, fresh)

    def _read_global(self, target: Item, dst: torch.Tensor, reads: _Reads) -> None:
        """Fill the target shard `dst` (box target.global_offset + dst.shape) from every saved shard it overlaps."""
        box = Box(tuple(target.global_offset), tuple(dst.shape))
        plan = plan_global(f"checkpoint {self.path!r}", target.name, box, tuple(target.global_shape),
                           dtype_name(dst.dtype), self.global_index().get(target.name, ()), self.shard_item)
        for read in plan:
            self._execute(read, dst, reads)

    def _read_whole(self, rank: int, saved: Item, dst: torch.Tensor, reads: _Reads) -> None:
        """Fill `dst` (of the saved shape) with the whole saved item."""
        for read in plan_whole(rank, saved):
            self._execute(read, dst, reads)

    def _execute(self, read: BoxRead, dst: torch.Tensor, reads: _Reads) -> None:
        """Submit one box read of the load plan into `dst`.

        A whole saved item bound for a contiguous host view is streamed straight into it (`_Reads.reads_into`).
        Otherwise the read goes in pieces through the slots, and each piece's part of the box is copied out. In
        read mode "parallel" even a whole tensor into a contiguous host target goes through the slots: O_DIRECT
        into the same few hot slots, then a memcpy on the copy threads, loaded 1 GB in 0.68 s against 1.01 s for
        O_DIRECT straight into the target's own pages (medians of 8 interleaved loads, page cache evicted)."""
        if read.whole:
            view = dst[read.dst]
            if reads.reads_into(view):
                reads.read_chunks(read.rank, read.item, 0, len(read.item.crcs), view.reshape(-1).view(torch.uint8))
                return
        for piece in read.pieces(reads.pool.slot_bytes):
            buf, slot, fresh = reads.buffer(piece.stop - piece.start)
            reads.read_chunks(read.rank, read.item, piece.first, piece.last, buf,
                              functools.partial(_place, reads, piece, dst), slot, fresh)


def _place(reads: _Reads, piece: Piece, dst: torch.Tensor, buf: torch.Tensor) -> None:
    """Copy a verified piece's elements out into the target."""
    src = buf[:piece.stop - piece.start].view(dst.dtype)
    for copy in piece.copies:
        run = src[copy.start:copy.start + volume(copy.run)].view(copy.run)
        reads.place(dst[copy.dst], run[copy.src])


def _writable(t: torch.Tensor) -> torch.Tensor:
    """The template tensor itself, unless it cannot be written in place (an expanded view): then a new one."""
    if any(st == 0 and n > 1 for st, n in zip(t.stride(), t.shape)):
        return torch.empty(t.shape, dtype=t.dtype, device=t.device)
    return t
