"""One load's reads: the read pipeline every load, check and tool goes through (`open_checkpoint.OpenCheckpoint`).

Reads are submitted to the native pool as soon as they are known and completed oldest first: verified (each
chunk's crc32c, computed on the pool's threads), then placed, so reading, verification and placement overlap.
What a damaged chunk does is the reads' `Problems` policy: a load stops at the first (the default), a check
records every one and goes on (a damaged piece is not copied out of its slot; the part of a target it was read
straight into is undefined).
"""
from __future__ import annotations

import dataclasses
import functools
import os
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, NamedTuple, Protocol

import torch

from . import _native, codecs
from .errors import CheckpointCorruptError, CheckpointError
from .save_plan import aligned_empty
from .problems import Problems
from .schema import Item
from .copies import CopyBackend
from .slots import Slot, StagingPool
from .storage import DataSource, Done

# A load reads at most this far ahead of its copies out: enough to keep 8 reads of 8 MiB in flight several times
# over, little enough that the same few slots go round while their pages are hot.
READ_AHEAD_BYTES = 256 << 20


DECODE_THREADS = 2  # decoders of compressed reads, shared by every load of the process
_decoder_pool: ThreadPoolExecutor | None = None
_decoder_lock = threading.Lock()


def decoders() -> ThreadPoolExecutor:
    """The process's decoder threads (loads and the read-once exchange share them)."""
    global _decoder_pool
    with _decoder_lock:
        if _decoder_pool is None:
            _decoder_pool = ThreadPoolExecutor(DECODE_THREADS, thread_name_prefix="ds-decode")
        return _decoder_pool


def _forget_decoders() -> None:
    """In a forked child: the parent's pool came along without its threads (work sent to it would wait forever),
    and its lock in whatever state a parent thread left it. The child starts its own on its first decode."""
    global _decoder_pool, _decoder_lock
    _decoder_pool, _decoder_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_decoders)


def _fetch_decoded(done: Done, item: Item, first: int, stored: torch.Tensor, dst: torch.Tensor) -> tuple:
    """On a decoder thread: wait for a compressed read and, where every chunk's crc32c matches the index, decode
    its chunks into `dst`. Returns (crcs, None) or (crcs, (chunk, file offset, stored size, why, error type)) for
    the first chunk that does not decode; the loading thread reports it (`Reads._decoded`)."""
    crcs = done()
    if crcs != item.crcs[first:first + len(crcs)]:
        return crcs, None  # not decoded: the checksum mismatch is the problem
    return crcs, _decode(item, first, first + len(crcs), stored, dst)


def _decode(item: Item, first: int, last: int, stored: torch.Tensor, dst: torch.Tensor) -> tuple | None:
    """Decode the stored chunks [first, last) of a compressed item into `dst`; None, or (chunk, file offset,
    stored size, why, error type) of the first chunk that does not decode."""
    raw, kept = item.chunks(), item.stored_chunks()
    base_raw, base_stored = raw[first][0], kept[first][0]
    out, src = dst.numpy(), stored.numpy()
    for index in range(first, last):
        (r, n), (s, m) = raw[index], kept[index]
        to, data = out[r - base_raw:r - base_raw + n], src[s - base_stored:s - base_stored + m]
        try:
            if m == n:  # stored raw: the codec did not make it smaller
                to[:] = data
            else:
                codecs.codec(item.codec).decode(memoryview(data), to, item.element_size)
        except ValueError as e:
            return index, item.offset + s, m, f"does not decode to its {n} bytes: {e}", CheckpointCorruptError
        except CheckpointError as e:  # the codec's library is missing
            return index, item.offset + s, m, f"cannot be decoded: {e}", CheckpointError
    return None


def decode_passed(item: Item, first: int, last: int, stored: torch.Tensor, dst: torch.Tensor, path: str,
                  sender: int) -> None:
    """The stored chunks [first, last) of a compressed item that rank `sender` read from `path` and passed on
    (`exchange`): each chunk's crc32c checked against the index here, where they are used, then decoded into
    `dst`; the first bad chunk raises, named with the file, the item and the chunk."""
    kept = item.stored_chunks()
    base = kept[first][0]
    for index in range(first, last):
        s, m = kept[index]
        crc = _native.crc32c_ptr(stored.data_ptr() + s - base, m)
        if crc != item.crcs[index]:
            raise CheckpointCorruptError(f"checksum mismatch in {path!r}: item {item.id!r} chunk {index} (file offset "
                                         f"{item.offset + s}, passed by rank {sender}) has crc32c {crc:#010x}, the "
                                         f"index says {item.crcs[index]:#010x}")
    failure = _decode(item, first, last, stored, dst)
    if failure is not None:
        index, offset, m, why, error = failure
        raise error(f"item {item.id!r} chunk {index} in {path!r} (file offset {offset}, {m} bytes stored, codec "
                    f"{item.codec}, passed by rank {sender}) {why}")


def _crcs_of(decoded: Future) -> list[int]:
    return decoded.result()[0]


@dataclasses.dataclass
class LoadStats:
    """What a reader moved since it was opened: bytes and requests read from storage (each verified), and the
    bytes it passed to and received from other ranks (`exchange`) instead of reading them."""

    bytes_read: int = 0
    requests: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0

    def describe(self) -> str:
        text = f"read {self.bytes_read:,} B from storage in {self.requests} requests"
        if self.bytes_sent or self.bytes_received:
            text += f", {self.bytes_received:,} B received from and {self.bytes_sent:,} B passed to other ranks"
        return text


class _Read(NamedTuple):
    done: Done
    rank: int
    item: Item
    first: int  # chunks [first, first + len(crcs)) of the item
    buffer: torch.Tensor
    place: Callable[[torch.Tensor], None] | None  # what to do with the verified bytes
    slot: Slot | None  # the staging slot the bytes landed in, if any
    fresh: int  # bytes of a buffer allocated for this read alone
    decoded: Future | None  # a compressed read: (crcs, failure) of `_fetch_decoded`, which fills `buffer`


class _Held:
    """A buffer of its own (for a chunk larger than a slot) and the completions of the copies out of it: the
    host copy threads read it after its read completed, so it must live until they have landed."""

    __slots__ = ("buffer", "nbytes", "waits")

    def __init__(self, buffer: torch.Tensor, nbytes: int):
        self.buffer, self.nbytes, self.waits = buffer, nbytes, []


class ReadSource(Protocol):
    """What the reads of one load read from: a checkpoint's data files, the memory they are staged in and copied
    out by, and the counts they add to (`open_checkpoint.OpenCheckpoint` is one)."""

    pool: StagingPool
    backend: CopyBackend
    stats: LoadStats

    def data_source(self, rank: int, problems: Problems | None = None) -> DataSource: ...

    def data_path(self, rank: int) -> str: ...


class Reads:
    """One load's reads: submitted to the native pool as soon as known, completed oldest first (verified, then
    placed), so reading, checksum verification (on the pool's threads) and placement all overlap.

    Stream reads of whole items land straight in contiguous host targets. Every other read lands in the engine's
    staging slots (pinned with CUDA), at most READ_AHEAD_BYTES ahead of the copies out of them; a slot goes back
    to the pool once those copies have landed. Staged memory is the pool's budget at most, plus buffers of their
    own for chunks larger than a slot, bounded by the same budget."""

    def __init__(self, reader: "ReadSource", problems: Problems | None = None):
        """`problems`: where a damaged read is reported; by default the load stops at the first."""
        self.reader = reader
        self.problems = problems if problems is not None else Problems.stop()
        self.pool, self.backend = reader.pool, reader.backend
        self.ordering = self.backend.begin()
        self.window = max(self.pool.slot_bytes, min(self.pool.budget_bytes, READ_AHEAD_BYTES))
        self.ahead = 0  # bytes of the pending reads into slots
        self.pending: deque[_Read] = deque()
        self.placed: list[Slot] = []  # slots whose copies out may still be landing
        self.held: list[_Held] = []  # buffers of their own whose copies out may still be landing
        self.fresh = 0  # bytes of the buffers of their own, pending or held

    def read_chunks(self, rank: int, item: Item, first: int, last: int, dst: torch.Tensor, place=None,
                    slot: Slot | None = None, fresh: int = 0, decode: bool = True) -> None:
        """Read chunks [first, last) of a stored item into the uint8 tensor `dst`, to be verified, then handed
        to `place`. `dst` is `slot`'s memory, or `fresh` bytes of its own (see `buffer`). `decode=False`: a
        compressed item's stored bytes land in `dst` as they are (to be passed on, `exchange`)."""
        try:
            chunks = item.chunks()[first:last]
            if item.codec is not None and not decode:
                chunks = item.stored_chunks()[first:last]
            start = chunks[0][0]
            nbytes = chunks[-1][0] + chunks[-1][1] - start
            if nbytes > dst.numel() * dst.element_size():
                raise CheckpointCorruptError(f"item {item.id!r} in {self.reader.data_path(rank)!r}: {nbytes} "
                                             f"bytes do not fit the {dst.numel() * dst.element_size()}-byte "
                                             f"destination")
            stored = decoded = None
            if item.codec is not None and decode:  # the stored bytes land in a buffer of their own, decoded into dst
                chunks = item.stored_chunks()[first:last]
                start = chunks[0][0]
                nbytes = chunks[-1][0] + chunks[-1][1] - start
                stored = aligned_empty(nbytes)
            segments = [(s - start, n) for s, n in chunks]
            source = self.reader.data_source(rank, self.problems)
            done = source.submit(dst if stored is None else stored, nbytes, item.offset + start, segments)
            if stored is not None:
                decoded = decoders().submit(_fetch_decoded, done, item, first, stored, dst)
                done = functools.partial(_crcs_of, decoded)
            self.reader.stats.bytes_read += nbytes
            self.reader.stats.requests += 1
        except BaseException:  # nothing was submitted: the memory goes back now
            self.fresh -= fresh
            if slot is not None:
                self.pool.release(slot)
            raise
        self.pending.append(_Read(done, rank, item, first, dst, place, slot, fresh, decoded))
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
            return aligned_empty(nbytes), None, nbytes
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

    def reads_into(self, rank: int, dst: torch.Tensor) -> bool:
        """Whether bytes of `rank` for `dst` are read straight into it: a stream read copies out of the page
        cache anyway, and into a contiguous host tensor that copy is the only one (a slot would add a second)."""
        return self.reader.data_source(rank, self.problems).streams and dst.device.type == "cpu" and \
            dst.is_contiguous()

    def complete_oldest(self) -> None:
        read = self.pending.popleft()
        if read.slot is not None:
            self.ahead -= read.buffer.numel()
            self.placed.append(read.slot)  # given back after the copies out of it, or after a failure
        if self._verified(read) and read.place is not None:
            read.place(read.buffer)
        if read.slot is not None:
            self.backend.mark(read.slot)
        elif read.fresh:  # the copies out of it may read it after this returns: it lives until they landed
            held = _Held(read.buffer, read.fresh)
            self.backend.mark(held)
            self.held.append(held)

    def _verified(self, read: _Read) -> bool:
        """Whether the read's bytes arrived and match the index; each problem goes to the policy."""
        item = read.item
        try:
            crcs = read.done()
        except OSError as e:
            path = self.reader.data_path(read.rank)
            self.problems.add(path, f"reading item {item.id!r} from {path!r} failed: {e.strerror or e}",
                              offset=item.offset + item.stored_chunks()[read.first][0], rank=read.rank,
                              item=item.id, error=CheckpointCorruptError)
            return False
        good = True
        for index, crc in enumerate(crcs, read.first):
            if crc != item.crcs[index]:
                path, offset = self.reader.data_path(read.rank), item.offset + item.stored_chunks()[index][0]
                self.problems.add(path, f"checksum mismatch in {path!r}: item {item.id!r} chunk {index} (file "
                                        f"offset {offset}) reads crc32c {crc:#010x}, the index says "
                                        f"{item.crcs[index]:#010x}", offset=offset, rank=read.rank,
                                  item=item.id, error=CheckpointCorruptError)
                good = False
        return good and (read.decoded is None or self._decoded(read))

    def _decoded(self, read: _Read) -> bool:
        """Whether every chunk of a compressed read decoded to its raw size (`_fetch_decoded`); a chunk that did
        not is a problem named with its chunk (a crc32c matching forged or mis-sized bytes)."""
        _, failure = read.decoded.result()
        if failure is None:
            return True
        index, offset, m, why, error = failure
        path = self.reader.data_path(read.rank)
        self.problems.add(path, f"item {read.item.id!r} chunk {index} in {path!r} (file offset {offset}, {m} bytes "
                                f"stored, codec {read.item.codec}) {why}",
                          offset=offset, rank=read.rank, item=read.item.id, error=error)
        return False

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

    def __enter__(self) -> "Reads":
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
                read.done()
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
