"""The storage contract: bytes only. What the engine asks of any place checkpoints live, and nothing else: the
policy above it (publication order, the tracker, retention, clean-up, format detection) is `save_root`'s, once
for every backend. After PyTorch DCP's StorageWriter and StorageReader: the engine plans, copies and verifies;
the backend owns the bytes.

    open_data(path, nbytes)         a data object written in parts (`DataSink`: buffers submitted at offsets)
    open_source(path)               a data object for ranged reads (`DataSource`), each segment's crc32c
    read_bytes(path)                a small object (index, manifest, tracker); FileNotFoundError when missing
    write_bytes(path, data, replace)  a small object, durable where the storage syncs; `replace`: in one step
    list(path), stat(path)          the names directly under a path; an object's size and version
    remove(path)                    an object, or everything under a path (open uploads included)
    stage(final, marker), commit(partial, final)   where a checkpoint is written unseen; made visible in one step
    retire(path, marker)            a checkpoint out of sight in one step, its bytes left for `remove`
    abort_uploads(root)             writes killed before they completed, cancelled

Every path is a string the backend understands (a file system path, or a URL of its scheme); names inside a
checkpoint and a save root come from `paths`, and the policy above passes the one a backend needs (`marker`: the
object whose presence makes a checkpoint published): a backend knows no file name. `temporary_of(name)` says
which object a killed replacing `write_bytes` left `name` as the temporary of (the clean-up asks; only a file
system has such temporaries). Options are typed per backend (`PosixOptions`, `s3.S3Options`). What
the memory tier needs beyond the contract (pages lent to another save, replicas, free space) is the declared
sub-protocol `PageLending`.
"""
from __future__ import annotations

import abc
import dataclasses
from typing import Callable, Protocol, runtime_checkable

import torch

# what a submitted read or write returns: a call that blocks until it is done and gives the crc32c of each
# segment; it raises OSError when the I/O failed
Done = Callable[[], list[int]]


class DataSink(abc.ABC):
    """One rank's data of one checkpoint, being written. `pages`: memory the snapshot may be copied into in place
    (then submitting a view of it only checksums it), or None: the engine stages buffers and submits them."""

    path: str
    direct = False  # whether the bytes bypass the page cache (recorded in the manifest)
    pages: torch.Tensor | None = None

    @abc.abstractmethod
    def submit(self, buffer: torch.Tensor, offset: int, segments: list[tuple[int, int]]) -> Done:
        """Write `buffer` (a uint8 tensor that lives until the returned call returns) at `offset`; the crc32c of
        each (start, length) segment of it."""

    @abc.abstractmethod
    def close(self, nbytes: int) -> None:
        """Everything is submitted and done: the data is `nbytes` long (at least: the memory tier's reused pages
        may be longer; the index says how much is data), durable where the storage syncs."""

    def discard(self) -> None:
        """The save failed: let go of whatever is open (what was written goes with `Storage.remove`)."""


class DataSource(abc.ABC):
    """A published data object, for ranged reads. `streams`: a read straight into its target is the cheapest
    (sequential reads through a cache); otherwise reads land in staging slots first."""

    path: str
    streams = True

    @abc.abstractmethod
    def size(self) -> int:
        """The object's length in bytes."""

    @abc.abstractmethod
    def submit(self, buffer: torch.Tensor, nbytes: int, offset: int, segments: list[tuple[int, int]]) -> Done:
        """Read `nbytes` at `offset` into `buffer` (living until the returned call returns); the crc32c of each
        (start, length) segment read."""

    def close(self) -> None:
        pass


@dataclasses.dataclass(frozen=True)
class Options:
    """What every backend takes: the threads that write data objects and those that read them. A backend's own
    options extend these (`posix.PosixOptions`, `s3.S3Options`) and hold nothing that means nothing there."""

    writer_threads: int = 4
    read_threads: int = 8

    def __post_init__(self):
        if self.writer_threads < 1 or self.read_threads < 1:
            raise ValueError(f"writer_threads and read_threads must be >= 1, got {self.writer_threads}, "
                             f"{self.read_threads}")


@dataclasses.dataclass(frozen=True)
class Stat:
    """An object's size, and what changes when it is replaced (a reader of it is kept only while it is the same)."""

    size: int
    version: tuple


class Storage(abc.ABC):
    """The contract (see the module docstring). Three facts about a backend steer the policy above it:
    `in_place` (a checkpoint is written under its final name: object stores, which have no rename),
    `spreads_deletes` (deleting files costs time on a file system, so each rank deletes its own share of a
    retired checkpoint; an object store deletes a prefix in one batched request) and `object_store` (a service
    behind a network API, where each byte is transfer time, requests and money: `--ckpt-compress auto` spends a
    codec's CPU there, not on a file system or in memory)."""

    options: Options
    in_place = False
    spreads_deletes = True
    object_store = False

    @abc.abstractmethod
    def open_data(self, path: str, nbytes: int) -> DataSink:
        """A data object at `path`; `nbytes`: the bytes planned, to preallocate (more may come after them)."""

    @abc.abstractmethod
    def open_source(self, path: str) -> DataSource:
        """A published data object, for ranged reads."""

    @abc.abstractmethod
    def read_bytes(self, path: str) -> bytes:
        """A small object whole; FileNotFoundError when it is missing."""

    @abc.abstractmethod
    def write_bytes(self, path: str, data, replace: bool = False) -> None:
        """Create `path` with `data` (bytes-like), durable where the storage syncs (the name itself becomes
        durable with the `commit` of its checkpoint). `replace`: a reader sees the old object or the new, never a
        part, and the name is durable on return."""

    @abc.abstractmethod
    def list(self, path: str) -> list[str]:
        """The names directly under `path`; [] when there is nothing."""

    @abc.abstractmethod
    def stat(self, path: str) -> Stat | None:
        """The object (or directory) at `path`, None when there is none."""

    @abc.abstractmethod
    def remove(self, path: str) -> None:
        """The object at `path`, or everything under it (open uploads included), gone; nothing there is no error."""

    @abc.abstractmethod
    def stage(self, final: str, marker: str) -> str:
        """Where the checkpoint `final` is written before `commit` (made ready here): no reader looks there.
        `marker`: the name, inside a checkpoint, of the object that publishes it (written last), which a store
        writing in place deletes first (an earlier save of `final` is out of sight from then on)."""

    @abc.abstractmethod
    def commit(self, partial: str, final: str, replace: bool = True) -> list[str]:
        """Make what was written under `partial` (its index last) visible as `final` in one step, durably. A
        checkpoint `final` displaced is retired (`retire`) and returned, for the caller to remove; with
        `replace=False` a non-empty `final` raises FileExistsError instead (a store writing in place has
        written `final` already: nothing is checked there)."""

    @abc.abstractmethod
    def retire(self, path: str, marker: str) -> str:
        """Take the checkpoint `path` (published by its object `marker`) out of every reader's sight in one step,
        durable when it returns; returns where its bytes are now, for `remove`."""

    @abc.abstractmethod
    def abort_uploads(self, root: str) -> list[str]:
        """Data objects under `root` whose writing a killed process left open, cancelled; what they were."""

    def temporary_of(self, name: str) -> str | None:
        """The name of the object whose replacing `write_bytes` (killed) left the object `name` beside it as its
        temporary; None when `name` is no such temporary (an object store replaces in one request: it has none)."""
        return None

    def close(self) -> None:
        """Let go of threads, descriptors and maps."""

    def exists(self, path: str) -> bool:
        """Whether anything is at or under `path`."""
        return self.stat(path) is not None or bool(self.list(path))

    def size(self, path: str) -> int:
        """The size of the object at `path` (FileNotFoundError when it is missing)."""
        st = self.stat(path)
        if st is None:
            raise FileNotFoundError(2, "no such object", path)
        return st.size


@runtime_checkable
class PageLending(Protocol):
    """The memory tier's sub-protocol (`shared_memory.SharedMemoryStorage`): a checkpoint's pages lent to a save
    that writes from them, a part sent as a replica from them, and the tier's own bookkeeping."""

    def hold(self, checkpoint: str) -> None:
        """A save writes from the pages of `checkpoint` (its final name): they are not reused until `release`."""

    def release(self, checkpoint: str) -> None: ...

    def open_file(self, path: str, nbytes: int) -> DataSink:
        """A data object written through the writers into a plain file (room for `nbytes` reserved, the file cut
        to what was written at close): no pages mapped, lent or reused."""

    def mapped(self, path: str, nbytes: int) -> torch.Tensor:
        """The first `nbytes` of the data object `path`, mapped (never copied): a part sent as a replica."""

    def move(self, src: str, dst: str) -> None:
        """The object or directory `src` renamed `dst` in one step: the same pages, nothing copied (`dst` must not
        be there)."""

    def link(self, src: str, dst: str) -> None:
        """The data object `src` also named `dst`: the same pages, nothing copied."""

    def make_dirs(self, path: str) -> None: ...

    def remove_empty(self, path: str) -> None:
        """`path` goes if it is a file or an empty directory."""

    def free_bytes(self, path: str) -> int: ...
