"""The typed records of the on-disk format: an item, a shard's box, a rank's part and the global index.

Everything a checkpoint says about itself is parsed from JSON and validated here, and only here: a checksummed
file can still have been forged, and nothing it says may make a read overrun its destination. Parsing is lazy
where the cost would grow with the world size: the index is checked as a whole once, a rank's items only when a
load reads from that rank (`RankPart.items`). No I/O happens here (`format` reads the files).
"""
from __future__ import annotations

import dataclasses
import enum
import functools
import math
from typing import Iterator, NamedTuple, Optional

import torch

from . import paths
from .codecs import CODECS
from .errors import CheckpointCorruptError, CheckpointError

SCHEMA_VERSION = 2
FORMAT_NAME = "datastates"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def volume(shape) -> int:
    return math.prod(shape)


class Box(NamedTuple):
    """A block of a tensor: the element at `offset` and the `shape` from there (global coordinates for a shard of
    a logical tensor, the tensor's own for a rank-local one)."""

    offset: tuple
    shape: tuple

    def volume(self) -> int:
        return volume(self.shape)

    def overlap(self, other: "Box") -> Optional["Box"]:
        """The box both cover, or None (also for boxes of different ranks)."""
        if len(self.offset) != len(other.offset):
            return None
        off, shape = [], []
        for ao, an, bo, bn in zip(self.offset, self.shape, other.offset, other.shape):
            lo, hi = max(ao, bo), min(ao + an, bo + bn)
            if hi <= lo:
                return None
            off.append(lo)
            shape.append(hi - lo)
        return Box(tuple(off), tuple(shape))

    def index(self, origin: tuple) -> tuple:
        """This box as slices of a tensor whose first element is at `origin`."""
        return tuple(slice(o - base, o - base + n) for o, base, n in zip(self.offset, origin, self.shape))


class Kind(enum.StrEnum):
    """What an item's bytes are."""
    TENSOR = "tensor"
    OBJECT = "object"  # pickled


class Scope(enum.StrEnum):
    """How a load finds an item again."""
    LOCAL = "local"  # rank-private: restored from the same rank's part, by id
    GLOBAL = "global"  # a shard of a logical tensor, or a named object: restored from any rank, by name


def _member(enum_type: type[enum.StrEnum], value) -> enum.StrEnum:
    if value not in set(enum_type):
        raise ValueError(f"{enum_type.__name__.lower()} {value!r} is not one of {', '.join(enum_type)}")
    return enum_type(value)


def _ints(name, value, n=None) -> None:
    if not isinstance(value, (list, tuple)) or (n is not None and len(value) != n) or \
            not all(type(v) is int and v >= 0 for v in value):
        raise ValueError(f"{name} must be a list of non-negative ints, got {value!r}")


@dataclasses.dataclass
class Item:
    """One leaf of the state: a tensor's bytes or a pickled object.

    `id` is unique within a rank's checkpoint. `scope` says how a load finds it again (`Scope`); a global item
    is a shard of a logical tensor (`name`, `global_shape`, `global_offset`) or a named object.
    `write` is False for a replica some other rank writes (it is restored, not saved, here).
    """

    id: str
    kind: Kind
    scope: Scope = Scope.LOCAL
    name: Optional[str] = None  # logical name of a global item (shared by its shards)
    dtype: Optional[str] = None
    shape: Optional[tuple] = None
    global_shape: Optional[tuple] = None
    global_offset: Optional[tuple] = None
    write: bool = True
    # layout, filled by the plan / the writer
    offset: int = -1
    nbytes: int = 0
    chunk_bytes: int = 0
    crcs: list = dataclasses.field(default_factory=list)
    # compressed items only (absent otherwise): the codec's name and each chunk's stored size; the stored chunks
    # lie back to back from `offset`, a chunk stored as long as its raw bytes is stored raw, and `crcs` are of
    # the stored bytes
    codec: Optional[str] = None
    stored: Optional[list] = None

    def to_json(self) -> dict:
        """Its fields but the unset ones; field by field, not `dataclasses.asdict`: the completer writes a manifest
        of every item at each save while training runs, and asdict's recursive deep copy took 100+ us an item
        holding the GIL."""
        out = {}
        for name in _ITEM_FIELDS:
            v = getattr(self, name)
            if v is not None:
                out[name] = str(v) if isinstance(v, enum.Enum) else list(v) if isinstance(v, list) else v
        return out

    @classmethod
    def from_json(cls, d: dict) -> "Item":
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - fields
        if unknown:
            raise ValueError(f"unknown item fields {sorted(unknown)}")
        d = dict(d)
        d["kind"], d["scope"] = _member(Kind, d["kind"]), _member(Scope, d.get("scope", Scope.LOCAL))
        for k in ("shape", "global_shape", "global_offset"):
            if d.get(k) is not None:
                d[k] = tuple(d[k])
        return cls(**d)

    @property
    def box(self) -> Box:
        """Where a tensor item's elements sit: its box in the logical tensor, or its own shape for a local one."""
        offset = self.global_offset if self.scope == Scope.GLOBAL else (0,) * len(self.shape)
        return Box(tuple(offset), tuple(self.shape))

    @property
    def element_size(self) -> int:
        return dtype_from_name(self.dtype).itemsize

    def validate(self, data_bytes: int) -> None:
        """Raise ValueError unless this (loaded) item describes itself consistently and lies within the file."""
        if not isinstance(self.id, str) or (self.scope == Scope.GLOBAL and not isinstance(self.name, str)):
            raise ValueError("id and (for global items) name must be strings")
        for name in ("offset", "nbytes", "chunk_bytes"):
            if type(getattr(self, name)) is not int:
                raise ValueError(f"{name} must be an int")
        if type(self.write) is not bool:
            raise ValueError(f"write must be a bool, got {self.write!r}")
        if self.kind == Kind.TENSOR:
            _ints("shape", self.shape)
            expected = volume(self.shape) * self.element_size
            if self.nbytes != expected:
                raise ValueError(f"nbytes {self.nbytes} does not match {self.dtype} {self.shape}")
            if expected and self.chunk_bytes % self.element_size:
                raise ValueError(f"chunk_bytes {self.chunk_bytes} splits {self.dtype} elements")
            if self.scope == Scope.GLOBAL:
                _ints("global_shape", self.global_shape, len(self.shape))
                _ints("global_offset", self.global_offset, len(self.shape))
                if any(o + n > g for o, n, g in zip(self.global_offset, self.shape, self.global_shape)):
                    raise ValueError(f"box {self.global_offset}+{self.shape} exceeds {self.global_shape}")
        if not self.write:
            return
        if self.nbytes < 0 or self.chunk_bytes < 0 or (self.nbytes and not self.chunk_bytes):
            raise ValueError(f"nbytes {self.nbytes} / chunk_bytes {self.chunk_bytes}")
        if self.codec is not None:
            if self.codec not in CODECS or self.kind != Kind.TENSOR:
                raise ValueError(f"unknown compression codec {self.codec!r} (this datastates knows "
                                 f"{', '.join(sorted(CODECS))})" if self.kind == Kind.TENSOR else
                                 f"codec {self.codec!r} on a {self.kind} item")
            _ints("stored", self.stored, len(self.chunks()))
            if any(not 0 < s <= n for s, (_, n) in zip(self.stored, self.chunks())):
                raise ValueError(f"stored sizes {self.stored} do not fit chunks of {self.chunk_bytes} bytes")
        elif self.stored is not None:
            raise ValueError("stored sizes without a codec")
        if self.offset < 0 or self.offset + self.stored_bytes > data_bytes:
            raise ValueError(f"extent {self.offset}+{self.stored_bytes} is outside the data file ({data_bytes} bytes)")
        _ints("crcs", self.crcs, len(self.chunks()))
        if any(c >= 1 << 32 for c in self.crcs):
            raise ValueError("a crc32c is out of range")

    def chunks(self):
        """(offset_in_item, length) of each checksummed chunk."""
        if self.nbytes == 0:
            return []
        step = self.chunk_bytes or self.nbytes
        return [(s, min(step, self.nbytes - s)) for s in range(0, self.nbytes, step)]

    def stored_chunks(self):
        """(offset_in_item's stored bytes, length) of each chunk as stored: the raw chunks unless compressed."""
        if self.codec is None:
            return self.chunks()
        out, pos = [], 0
        for n in self.stored:
            out.append((pos, n))
            pos += n
        return out

    @property
    def stored_bytes(self) -> int:
        """What the item takes in its data file."""
        return self.nbytes if self.codec is None else sum(self.stored)



_ITEM_FIELDS = tuple(f.name for f in dataclasses.fields(Item))


class Shard(NamedTuple):
    """One written global item as the index lists it, before validation (its rank's items validate it)."""

    rank: int
    id: str
    name: str
    kind: str
    dtype: str | None
    box: Box
    global_shape: tuple


_MALFORMED = (KeyError, TypeError, ValueError, OverflowError, AttributeError)


@dataclasses.dataclass(frozen=True, eq=False)
class RankPart:
    """A rank's part of a checkpoint: its data file and items, as its entry in the index (schema 2) or its
    manifest records them. `where` names the record in messages."""

    where: str
    data_file: str
    data_bytes: int
    raw_items: list  # as stored; parsed and validated by `items`, only for the ranks a load reads from

    @classmethod
    def parse(cls, doc, where: str, **extra) -> "RankPart":
        if not isinstance(doc, dict):
            raise CheckpointCorruptError(f"{where} is missing or not a JSON object")
        try:
            data_bytes, items, data_file = doc["data_bytes"], doc["items"], doc["data_file"]
            if type(data_bytes) is not int or data_bytes < 0:
                raise ValueError(f"data_bytes {data_bytes!r}")
            if not isinstance(items, list) or not isinstance(data_file, str):
                raise TypeError("items must be a list and data_file a string")
        except _MALFORMED as e:
            raise CheckpointCorruptError(f"{where} is malformed: {type(e).__name__}: {e}") from None
        return cls(where, data_file, data_bytes, items, **extra)

    @functools.cached_property
    def items(self) -> dict[str, Item]:
        """Every item by id, each checked against itself and the data file's size; the first problem raises."""
        items, problems = self.checked_items(stop=True)
        if problems:
            raise CheckpointCorruptError(f"{self.where} is malformed: {problems[0]}")
        return items

    def checked_items(self, stop: bool = False) -> tuple[dict[str, Item], list[str]]:
        """The valid items by id and every problem of the others (only the first with `stop`), for tools that
        report them all."""
        problems: list[str] = []
        items: dict[str, Item] = {}
        for d in self.raw_items:
            try:
                it = Item.from_json(d)
                it.validate(self.data_bytes)
                if it.id in items:
                    raise ValueError(f"duplicate item id {it.id!r}")
                items[it.id] = it
            except _MALFORMED as e:
                name = d.get("id") if isinstance(d, dict) else None
                problems.append(f"{'item ' + repr(name) + ': ' if isinstance(name, str) else ''}"
                                f"{type(e).__name__}: {e}")
                if stop:
                    break
        return items, problems

    def shards(self, rank: int) -> Iterator[Shard]:
        """The written global items, read from the raw records: O(items), no validation."""
        try:
            for d in self.raw_items:
                if d.get("scope") == "global" and d.get("write", True):
                    if not isinstance(d["name"], str):
                        raise TypeError(f"item {d['id']!r}: name {d['name']!r} is not a string")
                    yield Shard(rank, d["id"], d["name"], d["kind"], d.get("dtype"),
                                Box(tuple(d.get("global_offset") or ()), tuple(d.get("shape") or ())),
                                tuple(d.get("global_shape") or ()))
        except _MALFORMED as e:
            raise CheckpointCorruptError(f"{self.where} is malformed: {type(e).__name__}: {e}") from None

    def to_json(self) -> dict:
        """The part as the index holds it."""
        return {"data_file": self.data_file, "data_bytes": self.data_bytes, "items": self.raw_items}

    def same_record(self, other: "RankPart") -> bool:
        return (self.data_file, self.data_bytes, self.raw_items) == (other.data_file, other.data_bytes,
                                                                     other.raw_items)


@dataclasses.dataclass(frozen=True, eq=False)
class Manifest(RankPart):
    """A rank's manifest: its part, which rank of which world wrote it, and the checksum binding it to the index."""

    rank: int = -1
    world_size: int = 0
    direct_io: bool = False
    crc32c: int = 0

    @classmethod
    def parse(cls, doc, where: str, **extra) -> "Manifest":
        rank, world_size, direct_io = doc.get("rank"), doc.get("world_size"), doc.get("direct_io", False)
        if type(rank) is not int or type(world_size) is not int or not isinstance(direct_io, bool):
            raise CheckpointCorruptError(f"{where} is malformed: rank {rank!r}, world_size {world_size!r}, "
                                         f"direct_io {direct_io!r}")
        return super().parse(doc, where, rank=rank, world_size=world_size, direct_io=direct_io,
                             crc32c=doc.get("manifest_crc32c"))

    @classmethod
    def written(cls, rank: int, world_size: int, data_bytes: int, direct_io: bool, items: list[Item]) -> "Manifest":
        """The manifest of what `rank` just wrote (its checksum is `format.signed_manifest`'s)."""
        return cls(f"manifest of rank {rank}", paths.data_file(rank), data_bytes, [it.to_json() for it in items],
                   rank=rank, world_size=world_size, direct_io=direct_io)

    def to_json(self) -> dict:
        return dict(super().to_json(), rank=self.rank, world_size=self.world_size, direct_io=self.direct_io)


def check_schema(doc: dict, path: str) -> None:
    version = doc.get("schema_version")
    if doc.get("format") != FORMAT_NAME:
        raise CheckpointError(f"{path!r} is not a {FORMAT_NAME} checkpoint file (format={doc.get('format')!r})")
    if not isinstance(version, int) or isinstance(version, bool) or not 1 <= version <= SCHEMA_VERSION:
        raise CheckpointError(f"{path!r} has schema version {version!r}; this datastates reads versions "
                              f"1 to {SCHEMA_VERSION}: a newer one needs an upgrade of datastates to load it")


@dataclasses.dataclass(frozen=True, eq=False)
class Index:
    """metadata.json: what was saved, by how many ranks, and (schema 2) every rank's part."""

    path: str
    schema_version: int
    world_size: int
    iteration: int | None
    bytes: int
    created_unix: float | None
    manifest_crcs: dict  # rank -> the crc32c of the manifest published for it
    raw_ranks: dict | None  # schema 2: "rank" -> its part, parsed by `part`

    @classmethod
    def parse(cls, doc: dict, path: str) -> "Index":
        """Top-level fields only (schema and checksum are `format.parse_index`'s): per-rank parts are lazy."""
        where = f"checkpoint metadata {path!r}"
        world_size, iteration, nbytes = doc.get("world_size"), doc.get("iteration"), doc.get("bytes")
        created, crcs, ranks = doc.get("created_unix"), doc.get("manifests"), doc.get("ranks")
        if type(world_size) is not int or world_size < 1:
            raise CheckpointCorruptError(f"{where} has no valid world_size")
        if not (iteration is None or type(iteration) is int) or type(nbytes) is not int or nbytes < 0 or \
                not (created is None or type(created) in (int, float)):
            raise CheckpointCorruptError(f"{where} is malformed: iteration {iteration!r}, bytes {nbytes!r}, "
                                         f"created_unix {created!r}")
        if not isinstance(crcs, dict) or not all(type(v) is int for v in crcs.values()):
            raise CheckpointCorruptError(f"{where} is malformed: 'manifests' is not a mapping of rank to crc32c")
        if doc["schema_version"] >= 2 and not isinstance(ranks, dict):
            raise CheckpointCorruptError(f"{where} is malformed: 'ranks' is not a mapping of rank to its items")
        return cls(path, doc["schema_version"], world_size, iteration, nbytes, created,
                   {int(r): v for r, v in crcs.items() if r.isdigit()}, ranks if doc["schema_version"] >= 2 else None)

    def check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise CheckpointError(f"checkpoint {self.directory!r} was saved by {self.world_size} rank(s); "
                                  f"it has no rank {rank}")

    @property
    def directory(self) -> str:
        return paths.parent(self.path)

    def part(self, rank: int) -> RankPart:
        """A rank's part as the index holds it (schema 2; a schema-1 index holds only its manifest's crc32c)."""
        self.check_rank(rank)
        return RankPart.parse(self.raw_ranks.get(str(rank)), f"checkpoint index {self.path!r} (rank {rank})")
