"""Bounded host staging: a pool of fixed-size, page-aligned slots that never grows past its budget.

Slots are allocated lazily (a small checkpoint never costs the full budget) and reused across saves. Each slot
is an anonymous memory mapping, so it starts on a page boundary (O_DIRECT needs it) and costs exactly its size.
With CUDA, each slot is page-locked in place with cudaHostRegister: the pinned bytes are exactly the slot bytes.
(PyTorch's pinned-memory allocator would round every allocation up to a power of two, pinning up to twice the
budget while reporting the budget.) When every slot is in flight the copier waits for a writer to hand one
back: back-pressure, not growth.
"""
from __future__ import annotations

import mmap
import threading

import torch

from .save_plan import ALIGN

MAX_SLOT_BYTES = 64 << 20
MIN_BUDGET = 4 * ALIGN


def slot_size(budget_bytes: int, writer_threads: int) -> int:
    """Slots small enough that every writer thread and the copier have one in flight, big enough to stream."""
    if budget_bytes < MIN_BUDGET:
        raise ValueError(f"host_buffer_bytes={budget_bytes} is too small: at least {MIN_BUDGET} bytes are needed")
    size = min(MAX_SLOT_BYTES, budget_bytes // (2 * max(1, writer_threads) + 2))
    return max(ALIGN, size // ALIGN * ALIGN)


CHUNKS_PER_SLOT = 4


def chunk_size(slot_bytes: int) -> int:
    """The checksum chunk a save cuts tensors into: a quarter of a slot. A chunk never straddles two slots, so a
    slot is handed on when the next chunk no longer fits in what is left of it; a quarter-slot chunk leaves at most
    a quarter of a slot empty. (With slot-sized chunks the benchmark's 8 GB state took 1.32x its size in slots, so
    a budget of 1.1x its size stalled the snapshot on the writers; with quarter-slot chunks it takes 1.08x.)"""
    return max(ALIGN, slot_bytes // CHUNKS_PER_SLOT // ALIGN * ALIGN)


class Slot:
    """One staging buffer and what it holds: (offset in slot, length, item, chunk index) segments, and the
    completions of the copies into it (`waits`) that a writer must wait on before reading it."""

    __slots__ = ("buffer", "memory", "file_offset", "fill", "segments", "job", "waits")

    def __init__(self, memory: mmap.mmap):
        self.memory = memory  # owns the pages; the tensor is a view of them
        self.buffer = torch.frombuffer(memory, dtype=torch.uint8)
        self.reset()

    def reset(self):
        self.file_offset = 0
        self.fill = 0
        self.segments = []
        self.job = None
        self.waits = []


def cuda_host_register(ptr: int, nbytes: int) -> None:
    err = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of {nbytes} bytes of host memory failed (cudaError {int(err)}): "
                           f"lower --ckpt-host-buffer-gb or raise the locked-memory limit (ulimit -l)")


class StagingPool:
    def __init__(self, budget_bytes: int, writer_threads: int, pinned: bool = False):
        self.slot_bytes = slot_size(budget_bytes, writer_threads)
        self.max_slots = budget_bytes // self.slot_bytes
        self.budget_bytes = budget_bytes
        self.pinned = pinned
        self._slots: list[Slot] = []  # every slot allocated, to unpin at close
        self._free: list[Slot] = []
        self._in_use = 0
        self.peak_bytes = 0
        self._cv = threading.Condition()
        self._closed = False

    def _allocate(self) -> Slot:
        slot = Slot(mmap.mmap(-1, self.slot_bytes))
        if self.pinned:
            cuda_host_register(slot.buffer.data_ptr(), self.slot_bytes)
        return slot

    def acquire(self, block: bool = True) -> Slot | None:
        """A free slot; when every slot is in use, wait for one (or, with block=False, return None)."""
        with self._cv:
            while not self._free and len(self._slots) >= self.max_slots and not self._closed:
                if not block:
                    return None
                self._cv.wait()
            if self._closed:
                raise RuntimeError("staging pool is closed")
            self._in_use += 1
            self.peak_bytes = max(self.peak_bytes, self._in_use * self.slot_bytes)
            if self._free:
                return self._free.pop()
            try:
                slot = self._allocate()
            except BaseException:
                self._in_use -= 1
                raise
            self._slots.append(slot)
            return slot

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
        """Host memory the pool holds: exactly its slots, no alignment slack."""
        return len(self._slots) * self.slot_bytes

    @property
    def pinned_bytes(self) -> int:
        """Page-locked memory the pool holds: all of its slots with CUDA, none without."""
        return self.allocated_bytes if self.pinned else 0

    def close(self) -> None:
        with self._cv:
            self._closed = True
            slots, self._slots, self._free = self._slots, [], []
            self._cv.notify_all()
        if self.pinned:
            for slot in slots:
                torch.cuda.cudart().cudaHostUnregister(slot.buffer.data_ptr())
