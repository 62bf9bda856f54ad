"""Items and plans: the flat, serializable description of what one rank writes.

A provider walk turns a nested state into a skeleton plus a list of `Item`s. `Plan` assigns each tensor item
an aligned offset in the rank's data file and splits items larger than a staging slot into chunks, each with
its own checksum. The layout depends only on the structure (keys, dtypes, shapes), so it is cached across
saves while the structure holds; the tensors themselves are bound per save.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

import torch

ALIGN = 4096


def align_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


@dataclasses.dataclass
class Item:
    """One leaf of the state: a tensor's bytes or a pickled object.

    `id` is unique within a rank's checkpoint. `scope` says how a load finds it again: "local" items are
    rank-private (restored from the same rank's manifest by id); "global" items are shards of a logical
    tensor (`name`, `global_shape`, `global_offset`) or a named object, and may be restored from any rank.
    `write` is False for a replica some other rank writes (it is restored, not saved, here).
    """

    id: str
    kind: str  # "tensor" | "object"
    scope: str = "local"  # "local" | "global"
    name: Optional[str] = None  # logical name of a global item (shared by its shards)
    dtype: Optional[str] = None
    shape: Optional[tuple] = None
    global_shape: Optional[tuple] = None
    global_offset: Optional[tuple] = None
    write: bool = True
    # layout, filled by Plan / the writer
    offset: int = -1
    nbytes: int = 0
    chunk_bytes: int = 0
    crcs: list = dataclasses.field(default_factory=list)

    def to_json(self) -> dict:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}

    @classmethod
    def from_json(cls, d: dict) -> "Item":
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - fields
        if unknown:
            raise ValueError(f"unknown item fields {sorted(unknown)}")
        d = dict(d)
        for k in ("shape", "global_shape", "global_offset"):
            if d.get(k) is not None:
                d[k] = tuple(d[k])
        return cls(**d)

    def validate(self, data_bytes: int) -> None:
        """Raise ValueError unless this (loaded) item describes itself consistently and lies within the file."""
        def ints(name, value, n=None):
            if not isinstance(value, (list, tuple)) or (n is not None and len(value) != n) or \
                    not all(type(v) is int and v >= 0 for v in value):
                raise ValueError(f"{name} must be a list of non-negative ints, got {value!r}")

        if self.kind not in ("tensor", "object") or self.scope not in ("local", "global"):
            raise ValueError(f"kind {self.kind!r} / scope {self.scope!r}")
        if not isinstance(self.id, str) or (self.scope == "global" and not isinstance(self.name, str)):
            raise ValueError("id and (for global items) name must be strings")
        for name in ("offset", "nbytes", "chunk_bytes"):
            if type(getattr(self, name)) is not int:
                raise ValueError(f"{name} must be an int")
        if self.kind == "tensor":
            ints("shape", self.shape)
            expected = math.prod(self.shape) * torch.empty((), dtype=dtype_from_name(self.dtype)).element_size()
            if self.nbytes != expected:
                raise ValueError(f"nbytes {self.nbytes} does not match {self.dtype} {self.shape}")
            if expected and self.chunk_bytes % (expected // math.prod(self.shape)):
                raise ValueError(f"chunk_bytes {self.chunk_bytes} splits {self.dtype} elements")
            if self.scope == "global":
                ints("global_shape", self.global_shape, len(self.shape))
                ints("global_offset", self.global_offset, len(self.shape))
                if any(o + n > g for o, n, g in zip(self.global_offset, self.shape, self.global_shape)):
                    raise ValueError(f"box {self.global_offset}+{self.shape} exceeds {self.global_shape}")
        if not self.write:
            return
        if self.nbytes < 0 or self.chunk_bytes < 0 or (self.nbytes and not self.chunk_bytes):
            raise ValueError(f"nbytes {self.nbytes} / chunk_bytes {self.chunk_bytes}")
        if self.offset < 0 or self.offset + self.nbytes > data_bytes:
            raise ValueError(f"extent {self.offset}+{self.nbytes} is outside the data file ({data_bytes} bytes)")
        ints("crcs", self.crcs, len(self.chunks()))
        if any(c >= 1 << 32 for c in self.crcs):
            raise ValueError("a crc32c is out of range")

    def chunks(self):
        """(offset_in_item, length) of each checksummed chunk."""
        if self.nbytes == 0:
            return []
        step = self.chunk_bytes or self.nbytes
        return [(s, min(step, self.nbytes - s)) for s in range(0, self.nbytes, step)]


@dataclasses.dataclass
class Entry:
    """An item bound to its live source for one save (tensor, or object to pickle)."""

    item: Item
    source: Any


class Plan:
    """Layout of one rank's data file: tensor items first, each aligned; objects are appended after them.

    Computed once per structure; `apply` stamps it onto the fresh items of each later save."""

    def __init__(self, items: list[Item], chunk_bytes: int):
        self.layout = []
        offset = 0
        for it in items:
            if it.kind == "tensor" and it.write:
                self.layout.append((offset, chunk_bytes if it.nbytes > chunk_bytes else it.nbytes))
                offset += align_up(it.nbytes)
            else:
                self.layout.append((-1, 0))
        self.tensor_region = offset
        self.apply(items)

    def apply(self, items: list[Item]) -> None:
        for it, (offset, chunk_bytes) in zip(items, self.layout):
            it.offset, it.chunk_bytes = offset, chunk_bytes
            it.crcs = [0] * len(it.chunks())

    @staticmethod
    def signature(items: list[Item]) -> tuple:
        return tuple((it.id, it.kind, it.dtype, it.shape, it.global_offset, it.write) for it in items)
