"""The storage seam: where one rank's part of a checkpoint lives, and how a checkpoint becomes visible.

The engine drives every backend through one fixed call sequence per checkpoint (after PyTorch DCP's
StorageWriter: the engine plans and copies, the backend owns the bytes):

    prepare(final)                        every rank: the unpublished directory, created
    open_data(partial, rank, nbytes)      every rank: its data file (a `_native.File`, or mapped pages)
    close_data(data, nbytes)              every rank: the data is complete (truncated, durable where it syncs)
    write_manifest(partial, rank, body)   every rank: its written proof of its part
    publish(partial, final, metadata)     rank 0, once every rank reported: visible in one atomic step
    abandon(partial)                      rank 0, on failure: the unfinished directory goes
    delete(retired, rank, world_size)     every rank, off the save path: its share of the retired checkpoints

Backends:

- `PosixStorage` (local disks, Lustre, NFS): aligned writes through the native pool, O_DIRECT where the file
  system accepts it, and publication in the documented fsync order (`posix.publish`).
- `SharedMemoryStorage` (the node-local memory tier, a /dev/shm-style directory): the data file is mapped, the
  snapshot copies straight into its pages, nothing is fsynced. Pages of a retired checkpoint are kept mapped and
  reused by the next one: a fresh tmpfs page costs a fault and a zeroing on every save, a reused one nothing.
"""
from __future__ import annotations

import os
import shutil

from .. import commit
from .. import format as fmt


class Storage:
    """The protocol (see the module docstring). `mapped`: the data file is pages the engine copies into."""

    mapped = False
    fsync = True

    def prepare(self, final: str) -> str:
        partial = commit.partial_dir(final)
        make_dir(partial)
        return partial

    def open_data(self, partial: str, rank: int, nbytes: int):
        raise NotImplementedError

    def close_data(self, data, nbytes: int) -> None:
        raise NotImplementedError

    def write_manifest(self, partial: str, rank: int, body: dict) -> dict:
        # the directory entry is made durable by rank 0's fsync of the directory at publication
        return fmt.write_manifest(os.path.join(partial, fmt.manifest_file(rank)), body, self.fsync)

    def publish(self, partial: str, final: str, metadata: dict, keep_last: int | None) -> list[str]:
        raise NotImplementedError

    def abandon(self, partial: str) -> None:
        shutil.rmtree(partial, ignore_errors=True)

    def delete(self, retired: list[str], rank: int, world_size: int) -> None:
        raise NotImplementedError

    def sweep(self) -> None:
        """At close, off the save path: what retirement left behind goes."""

    def close(self) -> None:
        pass


def make_dir(path: str) -> None:
    """One mkdir where the save root exists (the other ranks' mkdir of the same directory may come first)."""
    try:
        os.mkdir(path)
    except FileExistsError:
        pass
    except FileNotFoundError:
        os.makedirs(path, exist_ok=True)


from .posix import PosixStorage  # noqa: E402 - the backends build on the protocol above
from .shared_memory import SPARES, MappedData, SharedMemoryStorage  # noqa: E402

__all__ = ["Storage", "PosixStorage", "SharedMemoryStorage", "MappedData", "SPARES"]
