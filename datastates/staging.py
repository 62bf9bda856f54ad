"""Bounded host staging: a pool of fixed-size, 4 KiB-aligned slots that never grows past its budget.

Slots are allocated lazily (a small checkpoint never costs the full budget) and reused across saves, pinned
when CUDA is present so device->host copies run asynchronously. When every slot is in flight the copier waits
for a writer to hand one back: back-pressure, not growth.
"""
from __future__ import annotations

import threading

import torch

from .plan import ALIGN

MAX_SLOT_BYTES = 64 << 20
MIN_BUDGET = 4 * ALIGN


def slot_size(budget_bytes: int, writer_threads: int) -> int:
    """Slots small enough that every writer thread and the copier have one in flight, big enough to stream."""
    if budget_bytes < MIN_BUDGET:
        raise ValueError(f"host_buffer_bytes={budget_bytes} is too small: at least {MIN_BUDGET} bytes are needed")
    size = min(MAX_SLOT_BYTES, budget_bytes // (2 * max(1, writer_threads) + 2) - ALIGN)
    return max(ALIGN, size // ALIGN * ALIGN)


class Slot:
    """One staging buffer and what it holds: (offset in slot, length, item, chunk index) segments."""

    __slots__ = ("buffer", "file_offset", "fill", "segments", "job", "event")

    def __init__(self, buffer: torch.Tensor):
        self.buffer = buffer
        self.reset()

    def reset(self):
        self.file_offset = 0
        self.fill = 0
        self.segments = []
        self.job = None
        self.event = None


class StagingPool:
    def __init__(self, budget_bytes: int, writer_threads: int, pinned: bool = False):
        self.slot_bytes = slot_size(budget_bytes, writer_threads)
        # each slot costs one extra ALIGN so it can start on an aligned address (O_DIRECT needs it)
        self.max_slots = budget_bytes // (self.slot_bytes + ALIGN)
        self.budget_bytes = budget_bytes
        self.pinned = pinned
        self._free: list[Slot] = []
        self._allocated = 0
        self._in_use = 0
        self.peak_bytes = 0
        self._cv = threading.Condition()
        self._closed = False

    def _allocate(self) -> Slot:
        raw = torch.empty(self.slot_bytes + ALIGN, dtype=torch.uint8, pin_memory=self.pinned)
        skip = (-raw.data_ptr()) % ALIGN
        return Slot(raw[skip:skip + self.slot_bytes])

    def acquire(self) -> Slot:
        with self._cv:
            while not self._free and self._allocated >= self.max_slots and not self._closed:
                self._cv.wait()
            if self._closed:
                raise RuntimeError("staging pool is closed")
            if self._free:
                slot = self._free.pop()
            else:
                self._allocated += 1
                slot = None
            self._in_use += 1
            self.peak_bytes = max(self.peak_bytes, self._in_use * self.slot_bytes)
        return slot if slot is not None else self._allocate()

    def release(self, slot: Slot) -> None:
        slot.reset()
        with self._cv:
            self._in_use -= 1
            self._free.append(slot)
            self._cv.notify()

    def reset_peak(self) -> None:
        with self._cv:
            self.peak_bytes = self._in_use * self.slot_bytes

    @property
    def allocated_bytes(self) -> int:
        return self._allocated * (self.slot_bytes + ALIGN)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._free.clear()
            self._cv.notify_all()
