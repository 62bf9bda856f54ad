"""The storage protocol, both ways: what the engine asks of any place checkpoints live (after PyTorch DCP's
StorageWriter and StorageReader: the engine plans, copies and verifies; the backend owns the bytes).

Saving one checkpoint, in this order:

    prepare(final)                         every rank: the unpublished place of `final`, made
    open_data(partial, rank, nbytes)       every rank: its `DataSink` (buffers submitted at offsets)
    write_manifest(partial, rank, doc)     every rank: its written proof of its part
    publish(partial, final, index, keep)   rank 0, once every rank reported: visible in one step, retention
    abandon(partial)                       rank 0, on failure: what the save wrote goes
    delete(retired, rank, world_size)      every rank, off the save path: its share of the retired checkpoints

Reading, and the save root:

    open_source(path)                      a data file for ranged reads (`DataSource`)
    read_bytes(path), version(path)        the small objects: index, manifests, tracker
    list(path), exists(path), size(path)   what a save root or a checkpoint holds
    write_tracker(root, iteration)         the tracker replaced in one step
    clean_leftovers(root)                  what killed saves left, at the start of a run

Every path is a string the backend understands (a file system path, or a URL of its scheme); names inside a
checkpoint and a save root are `format`'s. A missing small object raises FileNotFoundError.
"""
from __future__ import annotations

from typing import Callable

import torch

from .. import layout

# what a submitted read or write returns: a call that blocks until it is done and gives the crc32c of each
# segment; it raises OSError when the I/O failed
Done = Callable[[], list[int]]


class DataSink:
    """One rank's data of one checkpoint, being written. `pages`: memory the snapshot may be copied into in place
    (then submitting a view of it only checksums it), or None: the engine stages buffers and submits them."""

    path: str
    direct = False  # whether the bytes bypass the page cache (recorded in the manifest)
    pages: torch.Tensor | None = None

    def submit(self, buffer: torch.Tensor, offset: int, segments: list[tuple[int, int]]) -> Done:
        """Write `buffer` (a uint8 tensor that lives until the returned call returns) at `offset`; the crc32c of
        each (start, length) segment of it."""
        raise NotImplementedError

    def close(self, nbytes: int) -> None:
        """Everything is submitted and done: the data is exactly `nbytes` long, durable where the storage syncs."""
        raise NotImplementedError

    def discard(self) -> None:
        """The save failed: let go of whatever is open (what was written goes with `abandon`)."""


class DataSource:
    """A published data file, for ranged reads. `streams`: a read straight into its target is the cheapest
    (sequential reads through a cache); otherwise reads land in staging slots first."""

    path: str
    streams = True

    def size(self) -> int:
        raise NotImplementedError

    def submit(self, buffer: torch.Tensor, nbytes: int, offset: int, segments: list[tuple[int, int]]) -> Done:
        """Read `nbytes` at `offset` into `buffer` (living until the returned call returns); the crc32c of each
        (start, length) segment read."""
        raise NotImplementedError

    def close(self) -> None:
        pass


class Storage:
    """The protocol (see the module docstring); the retention rule and the published listing are shared."""

    fsync = True
    lends_pages = False  # whether a save to it can lend its snapshot's pages to another save (`hold`, `release`)

    # ----- saving a checkpoint -----

    def prepare(self, final: str) -> str:
        raise NotImplementedError

    def open_data(self, partial: str, rank: int, nbytes: int) -> DataSink:
        """`nbytes`: the tensor bytes planned, to preallocate (the objects come after them)."""
        raise NotImplementedError

    def write_manifest(self, partial: str, rank: int, doc: bytes) -> None:
        raise NotImplementedError

    def publish(self, partial: str, final: str, index: bytes, keep_last: int | None) -> list[str]:
        """Make `partial` visible as `final` with its index, then keep the newest `keep_last` checkpoints of the
        save root and point the tracker at `final`; returns what was retired, for `delete`."""
        raise NotImplementedError

    def abandon(self, partial: str) -> None:
        raise NotImplementedError

    def delete(self, retired: list[str], rank: int, world_size: int) -> None:
        raise NotImplementedError

    def sweep(self) -> None:
        """At close, off the save path: what retirement left behind goes."""

    def close(self) -> None:
        pass

    # ----- reading -----

    def open_source(self, path: str) -> DataSource:
        raise NotImplementedError

    def read_bytes(self, path: str) -> bytes:
        raise NotImplementedError

    def version(self, path: str) -> tuple | None:
        """What changes when the object at `path` is replaced (None: it is missing), so a reader of it is kept
        only while it is the same."""
        raise NotImplementedError

    # ----- the save root -----

    def list(self, path: str) -> list[str]:
        """The names directly under `path`; [] when there is nothing."""
        raise NotImplementedError

    def exists(self, path: str) -> bool:
        raise NotImplementedError

    def size(self, path: str) -> int:
        """The size of the object at `path` (OSError when it cannot be had)."""
        raise NotImplementedError

    def write_tracker(self, root: str, iteration: int) -> None:
        raise NotImplementedError

    def clean_leftovers(self, root: str) -> list[str]:
        """Remove what saves killed before publication left under `root`; returns what went. On one rank, before
        the first save of a run, while no rank saves."""
        raise NotImplementedError

    def published(self, root: str) -> list[int]:
        """The iterations of `root` with a published checkpoint, oldest first."""
        its = (layout.iteration_of(name) for name in self.list(root))
        return sorted(i for i in its if i is not None and self.is_published(layout.checkpoint_dir(root, i)))

    def is_published(self, path: str) -> bool:
        return self.exists(layout.join(path, layout.METADATA))

    def holds_checkpoint(self, path: str) -> bool:
        """Whether a load may resume from `path`: a published checkpoint (its metadata.json: this engine's format
        and megatron-core's torch_dist), or Megatron's legacy torch format (mp_rank_* directories, written without
        an index before the tracker names them)."""
        return self.is_published(path) or any(name.startswith("mp_rank_") for name in self.list(path))


def retention(published: list[int], keep_last: int, protect: int) -> list[int]:
    """The one retention rule: `protect` was just published; add it to `published` (sorted, kept up to date in
    place) and return the iterations to retire: all but the newest `keep_last`, never `protect`."""
    if protect not in published:
        published.append(protect)
        published.sort()
    keep = set(published[-keep_last:]) | {protect}
    doomed = [i for i in published if i not in keep]
    published[:] = [i for i in published if i in keep]
    return doomed
