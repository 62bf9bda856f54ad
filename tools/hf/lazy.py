"""Tensors made only when the engine copies them: the import's bounded host memory.

The engine saves a state whose tensors exist when `save` is called. The import hands it shape-only (meta)
tensors instead, and a copy backend (the engine's `copy_backend` extension point) that, as the engine's copier
reaches each byte range of one, builds the real values of the unit that range covers (a layer, or one expert of
a layer: the tensor's indexed leading axes), reading and merging its transformers tensors, and copies from those.
Units are built in the order the engine copies them, one at a time, so host memory holds one unit of one
megatron-core tensor and its transformers pieces, beside the engine's staging budget, whatever the model size.
"""
from __future__ import annotations

import itertools
import math
from typing import Callable

import torch

from datastates.snapshot import HostCopyBackend

# unit index (() for the whole tensor, (layer,) or (layer, expert)) -> the real values of that unit
Build = Callable[[tuple[int, ...]], torch.Tensor]


class LazyTensors:
    """Named meta tensors and how to build each one's units (`lead`: how many leading axes index them)."""

    def __init__(self):
        self.tensors: dict[str, torch.Tensor] = {}
        self._builds: dict[int, tuple[Build, int]] = {}

    def add(self, name: str, meta: torch.Tensor, build: Build, lead: int) -> None:
        self.tensors[name] = meta
        self._builds[id(meta)] = (build, lead)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def materialised(self, name: str) -> torch.Tensor:
        """The whole tensor in host memory (for writers that take only real tensors)."""
        meta = self.tensors[name]
        build, lead = self._builds[id(meta)]
        units = itertools.product(*(range(n) for n in meta.shape[:lead]))
        return torch.stack([build(tuple(i)) for i in units]).reshape(meta.shape)

    def lookup(self, root: torch.Tensor) -> tuple[Build, int]:
        return self._builds[id(root)]


def _unravel(flat: int, dims) -> tuple[int, ...]:
    """The index, over leading axes of sizes `dims`, of the `flat`-th unit (row-major)."""
    index = []
    for size in reversed(dims):
        flat, i = divmod(flat, size)
        index.append(i)
    return tuple(reversed(index))


class BuildingCopyBackend(HostCopyBackend):
    """Copies meta tensors' ranges from their layers, built on demand (the last one kept for the next range);
    copies of real tensors as the host backend does."""

    def __init__(self, lazy: LazyTensors, progress=None):
        super().__init__(threads=1)
        self.lazy, self.progress = lazy, progress
        self._built: tuple[int, tuple[int, ...], torch.Tensor] | None = None

    def check(self, tensor, where):
        if not tensor.is_meta:
            super().check(tensor, where)

    def copy(self, dst, src, ordering):
        if not src.is_meta:
            return super().copy(dst, src, ordering)
        root = src if src._base is None else src._base
        build, lead = self.lazy.lookup(root)
        per = math.prod(root.shape[lead:])
        start, n = src.storage_offset(), src.numel()
        out, pos = dst.reshape(-1), 0
        while pos < n:
            unit, within = divmod(start + pos, per)
            take = min(n - pos, per - within)
            values = self._unit(root, build, _unravel(unit, root.shape[:lead])).reshape(-1)
            out[pos:pos + take].copy_(values[within:within + take])  # synchronous: the unit may go next
            pos += take

    def _unit(self, root, build: Build, index: tuple[int, ...]) -> torch.Tensor:
        if self._built is None or self._built[:2] != (id(root), index):
            self._built = None  # freed before the next is built
            values = build(index)
            self._built = (id(root), index, values)
            if self.progress is not None:
                self.progress.update(values.numel() * values.element_size())
        return self._built[2]
