"""Save plans: where each item of one rank goes in its data file (the load side's is `load_plan`).

A provider walk turns a nested state into a skeleton plus a list of `Item`s (`schema`). `Plan` assigns each
tensor item an aligned offset in the rank's data file and splits items larger than a staging slot into chunks,
each with its own checksum. The placement depends only on the structure (keys, dtypes, shapes), so it is cached across
saves while the structure holds; the tensors themselves are bound per save.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch

from .schema import Item, Kind

ALIGN = 4096


def align_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


def aligned_empty(nbytes: int) -> torch.Tensor:
    """Bytes starting on an ALIGN boundary: what O_DIRECT reads into and writes from without a bounce copy."""
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8)
    skip = (-raw.data_ptr()) % ALIGN
    return raw[skip:skip + nbytes]


@dataclasses.dataclass
class Entry:
    """An item bound to its live source for one save (tensor, or object to pickle)."""

    item: Item
    source: Any


class Plan:
    """Where each item goes in one rank's data file: tensor items first, each aligned; objects after them.

    Computed once per structure; `apply` stamps it onto the fresh items of each later save."""

    def __init__(self, items: list[Item], chunk_bytes: int):
        self.placements = []
        offset = 0
        for it in items:
            if it.kind == Kind.TENSOR and it.write:
                self.placements.append((offset, chunk_bytes if it.nbytes > chunk_bytes else it.nbytes))
                offset += align_up(it.nbytes)
            else:
                self.placements.append((-1, 0))
        self.tensor_region = offset
        self.apply(items)

    def apply(self, items: list[Item]) -> None:
        for it, (offset, chunk_bytes) in zip(items, self.placements):
            it.offset, it.chunk_bytes = offset, chunk_bytes
            it.crcs = [0] * len(it.chunks())

    @staticmethod
    def signature(items: list[Item]) -> tuple:
        return tuple((it.id, it.kind, it.dtype, it.shape, it.global_offset, it.write) for it in items)
