"""The storage seam: where checkpoints live. The protocol, both ways, is `base`; each backend is one module:

- `posix.PosixStorage` (local disks, Lustre, NFS): aligned writes through the native pool, O_DIRECT where the
  file system accepts it, publication in the documented fsync order, stream or parallel reads.
- `shared_memory.SharedMemoryStorage` (the node-local memory tier, a /dev/shm-style directory): the data file is
  mapped, the snapshot copies straight into its pages, nothing is fsynced. Pages of a retired checkpoint are kept
  mapped and reused by the next one: a fresh tmpfs page costs a fault and a zeroing on every save, a reused one
  nothing.
- `s3.S3Storage` (s3://bucket/prefix, and msc://profile/prefix through `msc.py`): object stores, multipart
  uploads from the staging slots, publication by the index's PUT, ranged GETs (docs/object-storage.md).

`storage_for(path)` is the backend a path names (its URL scheme; a plain path is a file system's).
"""
from __future__ import annotations

from .. import format as fmt
from .. import layout
from ..errors import CheckpointError
from .base import DataSink, DataSource, Done, Storage
from .posix import DEFAULT_READ_THREADS, READ_MODES, PosixStorage, check_read_mode
from .shared_memory import SPARES, MappedSink, SharedMemoryStorage


def storage_for(path: str, **options) -> Storage:
    """The backend for checkpoints at `path`, made with `options` (its constructor's keywords)."""
    scheme = layout.scheme(path)
    if scheme is None:
        return PosixStorage(**options)
    if scheme == "s3":
        from .s3 import s3_storage  # boto3 only where an s3:// path is used
        return s3_storage(**options)
    if scheme == "msc":
        from .msc import msc_storage
        return msc_storage(path, **options)
    raise CheckpointError(f"{path!r}: no storage backend for {scheme}:// paths")


def read_json(path: str, what: str) -> dict:
    """A small JSON object wherever `path` names, an error naming `what` and where when it is missing or bad."""
    return fmt.parse_json(fmt.read_small(storage_for(path), path, what), path, what)


def read_index(directory: str):
    """The checked and parsed index (`schema.Index`) of the checkpoint `directory`, wherever it is."""
    return fmt.read_index(storage_for(directory), directory)


__all__ = ["Storage", "DataSink", "DataSource", "Done", "PosixStorage", "SharedMemoryStorage", "MappedSink", "SPARES",
           "DEFAULT_READ_THREADS", "READ_MODES", "check_read_mode", "storage_for", "read_json", "read_index"]
