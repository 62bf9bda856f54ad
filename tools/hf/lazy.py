"""Tensors made only when the engine copies them: the import's bounded host memory.

The engine saves a state whose tensors exist when `save` is called. The import hands it tensors made with the
engine's `built_on_copy` instead: shape-only, and as the engine's copier reaches each range of one, the values of
the unit that range covers (a layer, or one expert of a layer: the tensor's indexed leading axes) are built,
reading and merging its transformers tensors, and kept for the next range. Units are built in the order the engine
copies them, one at a time, so host memory holds one unit of one megatron-core tensor and its transformers
pieces, beside the engine's staging budget, whatever the model size. torch_dist's writer takes the same units as
pieces (`pieces`), one chunk each, built as it writes them.
"""
from __future__ import annotations

import functools
import math
from typing import Callable

import torch

from datastates import built_on_copy

# unit index (() for the whole tensor, (layer,) or (layer, expert)) -> the real values of that unit
Build = Callable[[tuple[int, ...]], torch.Tensor]


def _unravel(flat: int, dims) -> tuple[int, ...]:
    """The index, over leading axes of sizes `dims`, of the `flat`-th unit (row-major)."""
    index = []
    for size in reversed(dims):
        flat, i = divmod(flat, size)
        index.append(i)
    return tuple(reversed(index))


class LazyTensors:
    """Named tensors built on copy, one unit at a time (`lead`: how many leading axes index the units); `progress`
    (a tqdm bar, or None) counts the bytes built."""

    def __init__(self, progress=None):
        self.tensors: dict[str, torch.Tensor] = {}
        self.progress = progress
        self._builds: dict[str, tuple[Build, int]] = {}
        self._built: tuple[str, tuple[int, ...], torch.Tensor] | None = None

    def add(self, name: str, meta: torch.Tensor, build: Build, lead: int) -> None:
        self.tensors[name] = built_on_copy(meta.shape, meta.dtype, functools.partial(self._values, name))
        self._builds[name] = (build, lead)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def pieces(self) -> dict:
        """The tensors as torch_dist's writer takes them: a piece per unit, each built when it is written."""
        from tools.checkpoint.torch_dist_writer import Pieces
        return {name: Pieces(tuple(t.shape), t.dtype, self._builds[name][1], functools.partial(self._unit, name))
                for name, t in self.tensors.items()}

    def _values(self, name: str, first: int, count: int) -> torch.Tensor:
        """Elements [first, first + count) of `name`, from the units they lie in."""
        shape = self.tensors[name].shape
        lead = self._builds[name][1]
        per = math.prod(shape[lead:])
        pieces = []
        while count:
            unit, within = divmod(first, per)
            take = min(count, per - within)
            pieces.append(self._unit(name, _unravel(unit, shape[:lead])).reshape(-1)[within:within + take])
            first, count = first + take, count - take
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)

    def _unit(self, name: str, index: tuple[int, ...]) -> torch.Tensor:
        if self._built is None or self._built[:2] != (name, index):
            self._built = None  # freed before the next is built
            values = self._builds[name][0](index)
            self._built = (name, index, values)
            if self.progress is not None:
                self.progress.update(values.numel() * values.element_size())
        return self._built[2]
