"""Bounded host staging: a pool of fixed-size, page-aligned slots that never grows past its budget.

Each slot is an anonymous memory mapping, so it starts on a page boundary (O_DIRECT needs it) and costs exactly
its size. With CUDA, each slot is page-locked in place with cudaHostRegister: the pinned bytes are exactly the
slot bytes. (PyTorch's pinned-memory allocator would round every allocation up to a power of two, pinning up to
twice the budget while reporting the budget.) When every slot is in flight the copier waits for a writer to hand
one back: back-pressure, not growth.

Slots are made as saves first take them, or all of them ahead (`prepare`): page-locking costs about 0.34 s a GB
(an H200), and copies into slots locked as they were taken ran at 2.9 GB/s against 54.7 GB/s into slots locked
before. `prepare` maps, faults in and pins the whole budget on a thread of its own, off the training path; a save
that comes first waits for it, and says so once.
"""
from __future__ import annotations

import logging
import mmap
import threading
import time

import torch

from .save_plan import ALIGN

log = logging.getLogger(__name__)

MAX_SLOT_BYTES = 64 << 20
# faulted in as it is mapped: the first copy into a slot pays no page faults (0.45 s a GiB on a 2-core VM)
_POPULATE = mmap.MAP_SHARED | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
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
    """One staging buffer and what it holds: (offset in slot, length, item, chunk index) segments, the
    completions of the copies into it (`waits`) that a writer must wait on before reading it, and what gives its
    segments' checksums where the copy backend computes them (`crcs`; else the writer does)."""

    __slots__ = ("buffer", "memory", "file_offset", "fill", "segments", "job", "waits", "crcs")

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
        self.crcs = None


def cuda_host_register(ptr: int, nbytes: int) -> None:
    err = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of {nbytes} bytes of host memory failed (cudaError {int(err)}): "
                           f"lower --ckpt-host-buffer-gb or raise the locked-memory limit (ulimit -l)")


class StagingPool:
    def __init__(self, budget_bytes: int, writer_threads: int, pinned: bool = False,
                 device: torch.device | None = None):
        """`pinned`: page-lock every slot, for copies from the CUDA `device` (which the thread that prepares
        binds to: a thread bound to none would make a context of its own on device 0)."""
        self.slot_bytes = slot_size(budget_bytes, writer_threads)
        self.max_slots = budget_bytes // self.slot_bytes
        self.budget_bytes = budget_bytes
        self.pinned, self.device = pinned, device
        self._slots: list[Slot] = []  # every slot made, to unpin at close
        self._free: list[Slot] = []
        self._in_use = 0
        self.peak_bytes = 0
        self._cv = threading.Condition()
        self._closed = False
        self._preparing = False  # `prepare`'s thread is making the slots; saves wait for them, not make them
        self._said_waiting = False
        self.prepared_s: float | None = None  # how long `prepare` took, once it is done

    def prepare(self) -> None:
        """Make every slot of the budget now, on a background thread (`prepared` waits for it)."""
        with self._cv:
            self._preparing = True
        threading.Thread(target=self._prepare, name="ds-staging", daemon=True).start()

    def prepared(self, timeout: float | None = None) -> bool:
        """Wait until no slot is being made ahead; False if `timeout` seconds passed first."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._preparing, timeout)

    def _prepare(self) -> None:
        t0 = time.perf_counter()
        try:
            if self.pinned and self.device is not None:
                torch.cuda.set_device(self.device)
            while True:
                with self._cv:
                    if self._closed or len(self._slots) >= self.max_slots:
                        break
                slot = self._new_slot()  # outside the lock: a save takes the slots made so far meanwhile
                with self._cv:
                    if self._closed:
                        self._unpin([slot])
                        break
                    self._slots.append(slot)
                    self._free.append(slot)
                    self._cv.notify()
        except BaseException as e:  # noqa: BLE001 - saves make the rest as they go, and raise it there
            log.warning("staging: %d of %d bytes made ahead (%s); saves make the rest as they take them",
                        self.allocated_bytes, self.max_slots * self.slot_bytes, e)
        finally:
            self.prepared_s = time.perf_counter() - t0
            with self._cv:
                self._preparing = False
                self._cv.notify_all()
        log.info("staging: %d bytes %s ahead in %.2f s", self.allocated_bytes,
                 "mapped and pinned" if self.pinned else "mapped", self.prepared_s)

    def _new_slot(self) -> Slot:
        slot = Slot(mmap.mmap(-1, self.slot_bytes, flags=_POPULATE))
        if self.pinned:
            cuda_host_register(slot.buffer.data_ptr(), self.slot_bytes)
        return slot

    def acquire(self, block: bool = True) -> Slot | None:
        """A free slot; when every slot is in use, wait for one (or, with block=False, return None)."""
        with self._cv:
            while not self._free and not self._closed and (self._preparing or len(self._slots) >= self.max_slots):
                if not block:
                    return None
                if self._preparing and not self._said_waiting:
                    self._said_waiting = True
                    log.info("staging: a save waits for the slots being %s ahead",
                             "pinned" if self.pinned else "mapped")
                self._cv.wait()
            if self._closed:
                raise RuntimeError("staging pool is closed")
            self._in_use += 1
            self.peak_bytes = max(self.peak_bytes, self._in_use * self.slot_bytes)
            if self._free:
                return self._free.pop()
            try:
                slot = self._new_slot()
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
        self._unpin(slots)

    def _unpin(self, slots: list[Slot]) -> None:
        if self.pinned:
            for slot in slots:
                torch.cuda.cudart().cudaHostUnregister(slot.buffer.data_ptr())
