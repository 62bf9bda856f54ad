"""The storage contract and its backends: where checkpoints live, bytes only. The contract, both ways, is
`base.Storage`; the policy above it (publication, the tracker, retention, clean-up) is `save_root`'s. Each backend
is one module that implements the contract and nothing else:

- `posix.PosixStorage` (local disks, Lustre, NFS): aligned writes through the native pool, O_DIRECT where the
  file system accepts it, rename-atomic commits in the documented fsync order, stream or parallel reads.
- `shared_memory.SharedMemoryStorage` (the node-local memory tier, a /dev/shm-style directory): the data file is
  mapped, the snapshot copies straight into its pages, nothing is fsynced; it lends pages (`base.PageLending`).
  Pages of a retired checkpoint are kept mapped and reused by the next one: a fresh tmpfs page costs a fault and
  a zeroing on every save, a reused one nothing.
- `s3.S3Storage` (s3://bucket/prefix, and msc://profile/prefix through `msc.py`): object stores, multipart
  uploads from the staging slots, checkpoints written in place and made visible by the index's PUT, ranged GETs
  (docs/object-storage.md).

`storage_for(path, **flags)` is the backend a path names (its URL scheme; a plain path is a file system's), made
with the options of that backend that `flags` give (`options_for`).
"""
from __future__ import annotations

from .. import format as fmt
from .. import paths
from ..errors import CheckpointError
from .base import DataSink, DataSource, Done, Options, PageLending, Stat, Storage
from .posix import DEFAULT_READ_THREADS, READ_MODES, PosixOptions, PosixStorage, check_read_mode
from .shared_memory import SPARES, MappedSink, SharedMemoryStorage

FILE_SYSTEM_ONLY = ("fsync", "direct_io", "read_mode")  # flags that mean nothing to an object store


def options_for(path: str, **flags) -> Options:
    """The options of the backend `path` names, from one set of flags (the trainer's --ckpt-* serve every
    storage): an object store takes its threads and leaves the file system's flags aside."""
    if paths.scheme(path) is None:
        return PosixOptions(**flags)
    from .s3 import S3Options
    return S3Options(**{k: v for k, v in flags.items() if k not in FILE_SYSTEM_ONLY})


def storage_for(path: str, **flags) -> Storage:
    """The backend for checkpoints at `path`, made with its options from `flags` (`options_for`)."""
    scheme = paths.scheme(path)
    if scheme is None:
        return PosixStorage(options_for(path, **flags))
    if scheme == "s3":
        from .s3 import s3_storage  # boto3 only where an s3:// path is used
        return s3_storage(options_for(path, **flags))
    if scheme == "msc":
        from .msc import msc_storage
        return msc_storage(path, options_for(path, **flags))
    raise CheckpointError(f"{path!r}: no storage backend for {scheme}:// paths")


def read_json(path: str, what: str) -> dict:
    """A small JSON object wherever `path` names, an error naming `what` and where when it is missing or bad."""
    return fmt.parse_json(fmt.read_small(storage_for(path), path, what), path, what)


def read_index(directory: str):
    """The checked and parsed index (`schema.Index`) of the checkpoint `directory`, wherever it is."""
    return fmt.read_index(storage_for(directory), directory)


__all__ = ["Storage", "Options", "Stat", "PageLending", "DataSink", "DataSource", "Done", "PosixOptions",
           "PosixStorage", "SharedMemoryStorage", "MappedSink", "SPARES", "DEFAULT_READ_THREADS", "READ_MODES",
           "check_read_mode", "options_for", "storage_for", "read_json", "read_index"]
