"""The encodings of a checkpoint's files: its manifests and index (JSON with checksums of their own), and the
safe encoding of Python objects. Bytes in, bytes out: the storage reads and writes them (`storage`), and the
names they go by come from `paths`.

Schema versions: 1 (metadata.json lists each rank's manifest checksum; loading reads every manifest) and 2
(metadata.json also holds every rank's items: a load reads this one file, never W manifests). Version 2 is
written; both are read. A manifest and the metadata each carry a crc32c of their own canonical body, so a
damaged or hand-edited one is refused rather than trusted; what passes is parsed into the typed records of
`schema` (`parse_index`, `parse_manifest`, `rank_part`). Objects are unpickled by a restricted unpickler: a
checkpoint cannot run code.
"""
from __future__ import annotations

import io
import json
import pickle
import time
from typing import Any

import torch

from . import _native
from . import paths
from .errors import CheckpointCorruptError, CheckpointError
from .schema import FORMAT_NAME, SCHEMA_VERSION, Index, Manifest, RankPart, check_schema

SKELETON_ID = "__skeleton__"  # the pickled structure of a rank's state, whose leaves are item ids


def data_size_problem(path: str, size: int, expected: int) -> str | None:
    """What is wrong with a data file of `size` bytes where the checkpoint's index records `expected`, if
    anything (loads read a longer one, checks report it)."""
    if size == expected:
        return None
    what = "truncated" if size < expected else "longer than recorded"
    return f"data file {path!r} is {what}: {size} bytes, the checkpoint's index says {expected}"


def _body_crc(body: dict) -> int:
    return _native.crc32c(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


def encode_json(obj: dict) -> bytes:
    return json.dumps(obj, separators=(",", ":"), sort_keys=True).encode()


def signed_manifest(manifest: Manifest) -> dict:
    """A rank's manifest as written: its record with the schema and a checksum of itself."""
    body = dict(manifest.to_json(), schema_version=SCHEMA_VERSION, format=FORMAT_NAME)
    return dict(body, manifest_crc32c=_body_crc(body))


def index_metadata(manifests: dict[int, Manifest], iteration: int | None, world_size: int) -> dict:
    """metadata.json: the global index of every rank's part (schema 2), with a checksum of itself."""
    return _signed_index(iteration, world_size, {r: m.crc32c for r, m in manifests.items()},
                         {r: RankPart.to_json(m) for r, m in manifests.items()}, time.time())


def merged_index(indexes: dict[int, Index], iteration: int) -> dict:
    """metadata.json of one checkpoint made of single-rank ones (rank -> its index, e.g. the memory tier's parts
    of every rank): each one's part is that rank's, its data file named for the rank (`paths.data_file`)."""
    return _signed_index(iteration, len(indexes), {r: ix.manifest_crcs[0] for r, ix in indexes.items()},
                         {r: dict(ix.part(0).to_json(), data_file=paths.data_file(r)) for r, ix in indexes.items()},
                         min(ix.created_unix or time.time() for ix in indexes.values()))


def _signed_index(iteration: int | None, world_size: int, crcs: dict[int, int], ranks: dict[int, dict],
                  created: float) -> dict:
    body = {"format": FORMAT_NAME, "schema_version": SCHEMA_VERSION, "iteration": iteration,
            "world_size": world_size, "bytes": sum(part["data_bytes"] for part in ranks.values()),
            "manifests": {str(r): crc for r, crc in crcs.items()}, "ranks": {str(r): p for r, p in ranks.items()},
            "created_unix": created}
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


def parse_index(data: bytes, directory: str) -> Index:
    """The metadata.json of the checkpoint `directory`, checked (schema, checksum) and parsed (`schema.Index`)."""
    path = paths.join(directory, paths.METADATA)
    return Index.parse(_checked(parse_json(data, path, "checkpoint metadata"), path, "checkpoint metadata",
                                "metadata_crc32c"), path)


def parse_manifest(data: bytes, path: str) -> Manifest:
    """A rank's manifest, checked (schema, checksum) and parsed (`schema.Manifest`)."""
    return Manifest.parse(_checked(parse_json(data, path, "manifest"), path, "manifest", "manifest_crc32c"),
                          f"manifest {path!r}")


def read_index(storage, directory: str) -> Index:
    """The index of the checkpoint `directory`, read through `storage`."""
    return parse_index(read_small(storage, paths.join(directory, paths.METADATA), "checkpoint metadata"),
                       directory)


def read_manifest(storage, path: str) -> Manifest:
    return parse_manifest(read_small(storage, path, "manifest"), path)


def rank_part(storage, index: Index, rank: int) -> RankPart:
    """A rank's part of the checkpoint `index` describes: its entry in the index (schema 2), or its manifest,
    which must be the one the index published (schema 1)."""
    if index.schema_version >= 2:
        return index.part(rank)
    index.check_rank(rank)
    path = paths.join(index.directory, paths.manifest_file(rank))
    manifest = read_manifest(storage, path)
    expected = index.manifest_crcs.get(rank)
    if expected is not None and expected != manifest.crc32c:
        raise CheckpointCorruptError(f"manifest {path!r} is not the one this checkpoint published")
    return manifest


def read_small(storage, path: str, what: str) -> bytes:
    """A small object (index, manifest) through `storage`, its absence or failure an error naming it."""
    try:
        return storage.read_bytes(path)
    except FileNotFoundError:
        raise CheckpointError(f"{what} is missing: {path!r}") from None
    except OSError as e:
        raise CheckpointError(f"cannot read {what} {path!r}: {e.strerror or e}") from None


def parse_json(data: bytes, path: str, what: str) -> dict:
    try:
        doc = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointCorruptError(f"{what} {path!r} is not valid JSON: {e}") from None
    if not isinstance(doc, dict):
        raise CheckpointCorruptError(f"{what} {path!r} is not a JSON object")
    return doc


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
