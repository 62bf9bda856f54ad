"""On-disk layout of one checkpoint directory, its manifests, and the safe encoding of Python objects.

    iter_0000010/
        rank_00000.data            items of rank 0, each tensor item 4 KiB aligned, pickled objects after them
        rank_00000.manifest.json   written last by rank 0: schema, items, offsets, dtypes, shapes, checksums
        ...
        metadata.json              the global index, written by rank 0 at publication; its presence makes the
                                   checkpoint loadable

Schema versions: 1 (metadata.json lists each rank's manifest checksum; loading reads every manifest) and 2
(metadata.json also holds every rank's items: a load reads this one file, never W manifests). Version 2 is
written; both are read. A manifest and the metadata each carry a crc32c of their own canonical body, so a
damaged or hand-edited one is refused rather than trusted; what passes is parsed into the typed records of
`schema` (`read_index`, `read_manifest`, `rank_part`). Objects are unpickled by a restricted unpickler: a
checkpoint cannot run code.
"""
from __future__ import annotations

import io
import json
import os
import pickle
import time
from typing import Any

import torch

from . import _native
from .errors import CheckpointCorruptError, CheckpointError
from .schema import FORMAT_NAME, SCHEMA_VERSION, Index, Manifest, RankPart, check_schema

METADATA = "metadata.json"
SKELETON_ID = "__skeleton__"  # the pickled structure of a rank's state, whose leaves are item ids


def data_file(rank: int) -> str:
    return f"rank_{rank:05d}.data"


def manifest_file(rank: int) -> str:
    return f"rank_{rank:05d}.manifest.json"


def data_size_problem(path: str, size: int, expected: int) -> str | None:
    """What is wrong with a data file of `size` bytes where the checkpoint's index records `expected`, if
    anything (loads read a longer one, checks report it)."""
    if size == expected:
        return None
    what = "truncated" if size < expected else "longer than recorded"
    return f"data file {path!r} is {what}: {size} bytes, the checkpoint's index says {expected}"


def _body_crc(body: dict) -> int:
    return _native.crc32c(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file(path: str, data: bytes, fsync: bool) -> None:
    """Create or truncate `path` with `data`, fsynced: plain system calls, no stat of a buffered file object."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)


def encode_json(obj: dict) -> bytes:
    return json.dumps(obj, separators=(",", ":"), sort_keys=True).encode()


def write_manifest(path: str, body: dict, fsync: bool = True) -> dict:
    """Write a rank's manifest into its unpublished checkpoint directory, fsynced (no temporary name: nobody reads
    it before publication; its directory entry is left to the publisher's directory fsync); returns the manifest
    as written, checksum included."""
    body = dict(body, schema_version=SCHEMA_VERSION, format=FORMAT_NAME)
    doc = dict(body, manifest_crc32c=_body_crc(body))
    write_file(path, encode_json(doc), fsync)
    return doc


def index_metadata(manifests: dict[int, dict], iteration: int | None, world_size: int) -> dict:
    """metadata.json: the global index of every rank's items (schema 2), with a checksum of itself."""
    body = {"format": FORMAT_NAME, "schema_version": SCHEMA_VERSION, "iteration": iteration,
            "world_size": world_size, "bytes": sum(m["data_bytes"] for m in manifests.values()),
            "manifests": {str(r): m["manifest_crc32c"] for r, m in manifests.items()},
            "ranks": {str(r): {"data_file": m["data_file"], "data_bytes": m["data_bytes"], "items": m["items"]}
                      for r, m in manifests.items()},
            "created_unix": time.time()}
    return dict(body, metadata_crc32c=_body_crc(body))


def _checked(doc: dict, path: str, what: str, crc_field: str) -> dict:
    """`doc` after the checks every checkpoint file gets: its format, a schema this datastates reads, and its own
    checksum (an index from schema 2 on, every manifest)."""
    check_schema(doc, path)
    if crc_field == "manifest_crc32c" or doc["schema_version"] >= 2 or crc_field in doc:
        body = {k: v for k, v in doc.items() if k != crc_field}  # a checksummed index cannot pass as schema 1
        if doc.get(crc_field) != _body_crc(body):
            raise CheckpointCorruptError(f"{what} {path!r} fails its checksum: it was modified or damaged")
    return doc


def read_index(path: str) -> Index:
    """A checkpoint's metadata.json, checked (schema, checksum) and parsed (`schema.Index`)."""
    return Index.parse(_checked(read_json(path, "checkpoint metadata"), path, "checkpoint metadata",
                                "metadata_crc32c"), path)


def read_manifest(path: str) -> Manifest:
    """A rank's manifest, checked (schema, checksum) and parsed (`schema.Manifest`)."""
    return Manifest.parse(_checked(read_json(path, "manifest"), path, "manifest", "manifest_crc32c"),
                          f"manifest {path!r}")


def rank_part(index: Index, rank: int) -> RankPart:
    """A rank's part of the checkpoint `index` describes: its entry in the index (schema 2), or its manifest,
    which must be the one the index published (schema 1)."""
    if index.schema_version >= 2:
        return index.part(rank)
    index.check_rank(rank)
    path = os.path.join(index.directory, manifest_file(rank))
    manifest = read_manifest(path)
    expected = index.manifest_crcs.get(rank)
    if expected is not None and expected != manifest.crc32c:
        raise CheckpointCorruptError(f"manifest {path!r} is not the one this checkpoint published")
    return manifest


def read_json(path: str, what: str) -> dict:
    try:
        with open(path) as f:
            doc = json.load(f)
        if not isinstance(doc, dict):
            raise CheckpointCorruptError(f"{what} {path!r} is not a JSON object")
        return doc
    except FileNotFoundError:
        raise CheckpointError(f"{what} is missing: {path!r}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointCorruptError(f"{what} {path!r} is not valid JSON: {e}") from None
    except OSError as e:
        raise CheckpointError(f"cannot read {what} {path!r}: {e.strerror}") from None


# ----- objects -----

_SAFE_GLOBALS = {("builtins", name) for name in (
    "dict", "list", "tuple", "set", "frozenset", "int", "float", "complex", "str", "bytes", "bytearray",
    "bool", "slice", "range")} | {
    ("collections", "OrderedDict"), ("collections", "defaultdict"), ("collections", "deque"),
    ("argparse", "Namespace"), ("datetime", "datetime"), ("datetime", "timedelta"), ("datetime", "date"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("copyreg", "_reconstructor"),
    ("numpy", "ndarray"), ("numpy", "dtype"), ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"), ("numpy.core.multiarray", "scalar"),
    ("numpy._core.multiarray", "scalar"), ("datastates.providers", "ItemRef"), ("torch", "Size"),
}
_TORCH_DTYPES = {name for name, value in vars(torch).items() if isinstance(value, torch.dtype)}
_extra_safe: set[tuple[str, str]] = set()


def allow_unpickle(module: str, name: str) -> None:
    """Trust one more global for objects in checkpoints (e.g. an enum of your own config)."""
    _extra_safe.add((module, name))


class _RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if (module, name) in _SAFE_GLOBALS or (module, name) in _extra_safe:
            return super().find_class(module, name)
        if module == "torch" and name in _TORCH_DTYPES:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(
            f"refusing to unpickle {module}.{name}: not on the allow-list (datastates.format.allow_unpickle)")


def dumps(obj: Any, where: str) -> bytes:
    try:
        return pickle.dumps(obj, protocol=4)
    except Exception as e:  # pickle raises many types (TypeError, PicklingError, AttributeError)
        raise CheckpointError(f"cannot save object at {where!r}: it is not picklable ({type(e).__name__}: {e})") from e


def loads(data: bytes, where: str) -> Any:
    try:
        return _RestrictedUnpickler(io.BytesIO(data)).load()
    except pickle.UnpicklingError as e:
        raise CheckpointError(f"cannot load object {where}: {e}") from e
    except Exception as e:
        raise CheckpointCorruptError(f"cannot load object {where}: {type(e).__name__}: {e}") from e
