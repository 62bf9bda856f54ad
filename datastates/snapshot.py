"""The lazy copy: staging a save's items into host slots in the background, off the training thread.

The same code serves CPU and CUDA; only the device backend differs. On CUDA the copies are issued on a side
stream that first waits on an event recorded on the compute stream at save() time, into pinned slots, and
each slot carries an event the writer waits on before reading it. On CPU the copy thread copies directly.
"""
from __future__ import annotations

from typing import Callable, Iterator

import torch

from .plan import Item, align_up
from .staging import Slot, StagingPool


class CopyBackend:
    """CPU: copies are synchronous in the copy thread; nothing to order or wait for."""

    def begin_save(self):
        return None

    def copy(self, dst: torch.Tensor, src: torch.Tensor, ordering) -> None:
        dst.copy_(src)

    def mark(self, slot: Slot) -> None:
        pass

    def ready(self, slot: Slot) -> None:
        pass

    def finish(self) -> None:
        pass


class CudaCopyBackend(CopyBackend):
    """Device->pinned-host copies on a side stream ordered after the compute stream by an event."""

    def __init__(self):
        self.stream = torch.cuda.Stream()
        self._pending = False

    def begin_save(self):
        """Called on the training thread at save(): everything queued so far on the compute stream (the step
        that produced the state) must finish before the side stream reads the state."""
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream())
        return event

    def copy(self, dst, src, ordering):
        if not src.is_cuda:
            dst.copy_(src)
            return
        with torch.cuda.stream(self.stream):
            if ordering is not None:
                self.stream.wait_event(ordering)
            dst.copy_(src, non_blocking=True)
        self._pending = True

    def mark(self, slot):
        if self._pending:
            slot.event = torch.cuda.Event()
            slot.event.record(self.stream)

    def ready(self, slot):
        if slot.event is not None:
            slot.event.synchronize()

    def finish(self):
        if self._pending:
            self.stream.synchronize()
            self._pending = False


def make_backend() -> CopyBackend:
    return CudaCopyBackend() if torch.cuda.is_available() else CopyBackend()


def _flat_views(t: torch.Tensor, lo: int, hi: int) -> Iterator[torch.Tensor]:
    """Views of `t` covering its logical (row-major) elements [lo, hi), in order, without copying.

    Non-contiguous tensors are split along their leading dimension: whole rows become one strided view,
    partial rows at the ends recurse into the row."""
    if hi <= lo:
        return
    if t.is_contiguous():
        yield t.reshape(-1)[lo:hi]
        return
    inner = t.numel() // t.shape[0]
    r0, off0 = divmod(lo, inner)
    r1, off1 = divmod(hi, inner)
    if r0 == r1:
        yield from _flat_views(t[r0], off0, off1)
        return
    if off0:
        yield from _flat_views(t[r0], off0, inner)
        r0 += 1
    if r1 > r0:
        yield t[r0:r1]
    if off1:
        yield from _flat_views(t[r1], 0, off1)


def copy_tensor_bytes(dst: torch.Tensor, src: torch.Tensor, start: int, nbytes: int,
                      backend: CopyBackend, ordering) -> None:
    """Copy bytes [start, start+nbytes) of `src`'s logical contents into the uint8 tensor `dst`."""
    esize = src.element_size()
    out = dst[:nbytes].view(src.dtype)
    pos = 0
    for view in _flat_views(src, start // esize, (start + nbytes) // esize):
        n = view.numel()
        backend.copy(out[pos:pos + n].view(view.shape), view, ordering)
        pos += n


class SlotFiller:
    """Packs item chunks into slots in file order and hands each full slot to `emit`.

    Tensor items arrive with the aligned offsets their Plan gave them; object items are packed tightly after
    them and get their offsets here. A chunk never straddles two slots; a new slot starts 4 KiB aligned."""

    def __init__(self, pool: StagingPool, backend: CopyBackend, job, emit: Callable[[Slot], None]):
        self.pool, self.backend, self.job, self.emit = pool, backend, job, emit
        self.slot: Slot | None = None
        self.position = 0  # next free byte in the file

    def _open_slot(self, file_offset: int) -> Slot:
        slot = self.pool.acquire()
        slot.file_offset = file_offset
        slot.job = self.job
        self.slot = slot
        return slot

    def flush(self) -> None:
        slot, self.slot = self.slot, None
        if slot is None:
            return
        padded = align_up(slot.fill)
        if padded > slot.fill:
            slot.buffer[slot.fill:padded].zero_()
            slot.fill = padded
        self.backend.mark(slot)
        self.position = slot.file_offset + slot.fill
        self.emit(slot)

    def add(self, item: Item, write_chunk: Callable[[torch.Tensor, int, int], None], aligned: bool) -> None:
        """Place every chunk of `item`; `write_chunk(dst, start, n)` copies item bytes [start, start+n) to dst."""
        slot_bytes = self.pool.slot_bytes
        if not aligned:
            if self.slot is not None and self.slot.fill + item.nbytes > slot_bytes:
                self.flush()  # a large object starts a fresh slot so its chunks line up with slots
            item.chunk_bytes = min(item.nbytes, slot_bytes)
            item.offset = (self.slot.file_offset + self.slot.fill) if self.slot else align_up(self.position)
            item.crcs = [0] * len(item.chunks())
        for index, (start, n) in enumerate(item.chunks()):
            if self.slot is not None and self.slot.fill + n > slot_bytes:
                self.flush()
            slot = self.slot or self._open_slot(align_up(self.position) if not aligned else item.offset + start)
            assert slot.file_offset + slot.fill == item.offset + start, "plan and staging disagree on layout"
            write_chunk(slot.buffer[slot.fill:slot.fill + n], start, n)
            slot.segments.append((slot.fill, n, item, index))
            end = slot.fill + n
            slot.fill = align_up(end) if aligned else end
            if slot.fill > end:
                slot.buffer[end:slot.fill].zero_()  # deterministic padding, not stale bytes
