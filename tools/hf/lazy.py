"""Tensors made only when the engine copies them: the import's bounded host memory.

The engine saves a state whose tensors exist when `save` is called. The import hands it shape-only (meta)
tensors instead, and a copy backend (the engine's `copy_backend` extension point) that, as the engine's copier
reaches each byte range of one, builds the real values of the layer that range covers (reading and merging its
transformers tensors) and copies from those. Layers are built in the order the engine copies them, one at a
time, so host memory holds one layer of one megatron-core tensor and its transformers pieces, beside the
engine's staging budget, whatever the model size.
"""
from __future__ import annotations

from typing import Callable

import torch

from datastates.snapshot import HostCopyBackend

# (layer or None) -> the real values of that layer of a tensor (or the whole tensor), shaped as one layer
Build = Callable[[int | None], torch.Tensor]


class LazyTensors:
    """Named meta tensors and how to build each one's layers."""

    def __init__(self):
        self.tensors: dict[str, torch.Tensor] = {}
        self._builds: dict[int, tuple[Build, bool]] = {}

    def add(self, name: str, meta: torch.Tensor, build: Build, layered: bool) -> None:
        self.tensors[name] = meta
        self._builds[id(meta)] = (build, layered)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def materialised(self, name: str) -> torch.Tensor:
        """The whole tensor in host memory (for writers that take only real tensors)."""
        build, layered = self._builds[id(self.tensors[name])]
        if not layered:
            return build(None)
        return torch.stack([build(i) for i in range(self.tensors[name].shape[0])])

    def lookup(self, root: torch.Tensor) -> tuple[Build, bool]:
        return self._builds[id(root)]


class BuildingCopyBackend(HostCopyBackend):
    """Copies meta tensors' ranges from their layers, built on demand (the last one kept for the next range);
    copies of real tensors as the host backend does."""

    def __init__(self, lazy: LazyTensors, progress=None):
        super().__init__(threads=1)
        self.lazy, self.progress = lazy, progress
        self._built: tuple[int, int | None, torch.Tensor] | None = None

    def check(self, tensor, where):
        if not tensor.is_meta:
            super().check(tensor, where)

    def copy(self, dst, src, ordering):
        if not src.is_meta:
            return super().copy(dst, src, ordering)
        root = src if src._base is None else src._base
        build, layered = self.lazy.lookup(root)
        per = root[0].numel() if layered else root.numel()
        start, n = src.storage_offset(), src.numel()
        out, pos = dst.reshape(-1), 0
        while pos < n:
            layer, within = divmod(start + pos, per)
            take = min(n - pos, per - within)
            values = self._layer(root, build, layer if layered else None).reshape(-1)
            out[pos:pos + take].copy_(values[within:within + take])  # synchronous: the layer may go next
            pos += take

    def _layer(self, root, build: Build, layer: int | None) -> torch.Tensor:
        if self._built is None or self._built[:2] != (id(root), layer):
            self._built = None  # freed before the next is built
            values = build(layer)
            self._built = (id(root), layer, values)
            if self.progress is not None:
                self.progress.update(values.numel() * values.element_size())
        return self._built[2]
