"""The lazy copy: staging a save's items into host slots in the background, off the training thread.

Every backend follows one protocol, the CUDA one:

    begin()        on the training thread, at save(): what the copies must be ordered after
    copy()         issue a copy into a slot (it may land later)
    mark(slot)     record the completion of every copy issued into the slot
    ready(slot)    the writer waits on that completion before it reads the slot
    finish()       wait for every copy issued so far: the snapshot is done, the fence may open
    release(done)  set a snapshot's end; lend(done), the fence's wait, runs queued copies on its caller until then

A load runs the same protocol the other way (open_checkpoint.py): copies out of a slot into the target tensors, mark,
ready before the slot takes the next read, finish before the loaded state is handed back.

`HostCopyBackend` (CPU) copies host tensors on native threads without the GIL; `CudaCopyBackend` adds device
tensors, copied on a side stream of the engine's device, ordered after the compute stream by an event, into
pinned slots. Tests prove the protocol with a backend that completes copies late and out of order.

`built_on_copy` makes a tensor too large to hold saveable: a shape-only tensor whose values a callable gives,
range by range, as the copier reaches them (a converter streams a model through the engine with it).
"""
from __future__ import annotations

import os
import threading
from typing import Callable, Iterator

import torch

from . import _native
from .errors import CheckpointError
from .save_plan import align_up
from .schema import Item
from .slots import Slot, StagingPool


# (first element, count) -> those elements of a tensor's row-major contents, on the host
Values = Callable[[int, int], torch.Tensor]
_VALUES = "_datastates_values"


def built_on_copy(shape, dtype: torch.dtype, values: Values) -> torch.Tensor:
    """A shape-only (meta) tensor that saves like a real one: for each range of it the copier stages, it calls
    `values(first, count)` and copies the result into the slot at once, on the copier's thread, so a save holds at
    most one range's values (a staging slot's worth, or what `values` keeps) beyond its staging. Contiguous
    views of it (slices along the first axis) save alike. It is for saving only: a load into it fails."""
    tensor = torch.empty(shape, dtype=dtype, device="meta")
    setattr(tensor, _VALUES, values)
    return tensor


def _values_of(tensor: torch.Tensor) -> Values | None:
    root = tensor if tensor._base is None else tensor._base
    return getattr(root, _VALUES, None)


def default_copy_threads(beside_training: bool = True) -> int:
    """Host copies run beside training and leave it a core: on a 2-core host a second copy thread took more of the
    training step than it saved of the copy (the 1 GB loop with a checkpoint every step, 1.14x against 1.07x the
    loop without checkpoints). A load has the cores to itself."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(4, cores - 1 if beside_training else cores))


class CopyBackend:
    """The protocol, with completions as callables that block until their copies landed."""

    device: torch.device | None = None  # the accelerator whose tensors it copies (None: host memory only)

    def __init__(self):
        self._issued: list[Callable[[], None]] = []  # completions not yet attached to a slot
        self._unfinished: list[Callable[[], None]] = []  # every completion since the last finish()
        self._lent = threading.Condition()  # wakes a `lend` caller: copies queued, or a snapshot's end

    def begin(self):
        return None

    def bind_thread(self) -> None:
        """Called first on every thread that runs the protocol (the engine's stage threads)."""

    def check(self, tensor: torch.Tensor, where: str) -> None:
        """Refuse, before anything is copied, a tensor this backend cannot copy."""
        if _values_of(tensor) is None:
            self._check_device(tensor, where)
        elif not tensor.is_contiguous():
            raise CheckpointError(f"{where}: a non-contiguous view of a built_on_copy tensor (its ranges are "
                                  f"asked for in row-major order)")

    def _check_device(self, tensor: torch.Tensor, where: str) -> None:
        if tensor.device.type != "cpu":
            raise CheckpointError(f"{where}: tensor on {tensor.device}, but this engine copies host memory only")

    def copy(self, dst: torch.Tensor, src: torch.Tensor, ordering) -> None:
        raise NotImplementedError

    def _completes(self, wait: Callable[[], None]) -> None:
        self._issued.append(wait)

    def mark(self, slot: Slot) -> None:
        slot.waits, self._issued = self._issued, []
        self._unfinished.extend(slot.waits)

    def ready(self, slot: Slot) -> None:
        for wait in slot.waits:
            wait()

    def checksum(self, slot: Slot) -> None:
        """Called right after `mark(slot)`: where the backend's own threads can, `slot.crcs` becomes what gives the
        crc32c of each of its segments once the copies marked have landed; else it stays None (its writer
        checksums the bytes then)."""

    def finish(self) -> None:
        # the completions of the slot being filled stay issued: its mark() still attaches them
        pending, self._unfinished = self._unfinished + self._issued, []
        for wait in pending:
            wait()

    def lend(self, done: threading.Event) -> None:
        """Block until `done` (a snapshot's end, set by `release`), running queued copies on the calling thread
        meanwhile (never checksums: they are the writers' side), sleeping while none is queued. A caller blocked
        on the snapshot (training at an immediate fence) lends its idle core; one that arrives after the snapshot
        returns at once, as before."""
        while not done.is_set():
            self._run_queued()
            with self._lent:
                self._lent.wait_for(lambda: done.is_set() or self._queued())

    def release(self, done: threading.Event) -> None:
        """Set `done` and wake whoever is lent to the copies until it."""
        done.set()
        self._woken()

    def _woken(self) -> None:
        with self._lent:
            self._lent.notify_all()

    def _run_queued(self) -> None:
        """Run the copies queued for this backend's threads on the calling thread (none here)."""

    def _queued(self) -> bool:
        return False

    def close(self) -> None:
        pass


class HostCopyBackend(CopyBackend):
    """Host memory: contiguous copies are memcpy'd on native threads, strided ones by torch in the caller.
    Copies that continue one another in source and destination (a tensor's chunks in one slot, tensors laid
    out back to back in both) go as one. A caller lent to them (`lend`, the fence) runs queued ones too: the
    threads leave training a core, which a blocked training thread gives back."""

    def __init__(self, threads: int | None = None, beside_training: bool = True):
        super().__init__()
        self.pool = _native.CopyPool(threads or default_copy_threads(beside_training))
        self._batch: _native.CopyBatch | None = None
        self._marked: _native.CopyBatch | None = None  # the copies of the last mark(), for checksum()
        self._run: list[int] | None = None  # [dst, src, nbytes] of the contiguous copy being gathered

    def copy(self, dst, src, ordering):
        if src.device.type == dst.device.type == "cpu" and src.is_contiguous() and dst.is_contiguous():
            self._gather(dst.data_ptr(), src.data_ptr(), src.numel() * src.element_size())
        else:
            dst.copy_(src)  # strided views: torch copies them in place, synchronously

    def _gather(self, dst: int, src: int, nbytes: int) -> None:
        run = self._run
        if run is not None and run[0] + run[2] == dst and run[1] + run[2] == src:
            run[2] += nbytes
            return
        self._issue()
        self._run = [dst, src, nbytes]

    def _issue(self) -> None:
        """Queue the gathered copy on the native threads."""
        if self._run is None:
            return
        if self._batch is None:
            self._batch = _native.CopyBatch()
            self._completes(self._batch.wait)
        self.pool.copy(self._batch, *self._run)
        self._run = None
        self._woken()  # a caller lent to the copies takes some

    def _run_queued(self):
        self.pool.run_copies()

    def _queued(self):
        return self.pool.copies_queued()

    def mark(self, slot):
        self._issue()
        self._marked, self._batch = self._batch, None
        super().mark(slot)

    def checksum(self, slot):
        """On the copy threads, after the marked copies: the bytes are read once more by the thread that just
        wrote them (in cache), and training keeps its core."""
        ranges = [(start, n) for start, n, _, _ in slot.segments]
        slot.crcs = self.pool.checksum(self._marked, slot.buffer.data_ptr(), ranges).wait

    def finish(self):
        self._issue()
        super().finish()

    def close(self):
        self.pool.close()


class CudaCopyBackend(HostCopyBackend):
    """Copies to or from the engine's device run on a side stream (between device tensors and pinned slots);
    host ones as above. A caller lent to the copies (`lend`) runs the queued host ones only: the side stream's
    copies and their events are as without it."""

    def __init__(self, device: torch.device, threads: int | None = None, beside_training: bool = True):
        super().__init__(threads, beside_training)
        self.device = device
        self.stream = torch.cuda.Stream(device=device)
        self._event_pending = False
        self._device_run: tuple[torch.Tensor, torch.Tensor] | None = None  # (dst, src) being gathered, as bytes
        self._ordered = None  # the ordering event the side stream waits for already
        self._marked_on_device = False  # whether device copies went into the last mark()

    def bind_thread(self):
        """A thread that touches CUDA without a device set would make a context of its own on device 0."""
        torch.cuda.set_device(self.device)

    def begin(self):
        """Called on the training thread at save() (or load()): everything queued so far on the compute stream
        (the step that produced the state, or last used the tensors a load overwrites) must finish before the
        side stream touches them."""
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def _check_device(self, tensor, where):
        if tensor.device.type == "cuda" and tensor.device != self.device:
            raise CheckpointError(f"{where}: tensor on {tensor.device}, but this engine copies from {self.device} "
                                  f"(one engine per device)")
        if tensor.device.type not in ("cuda", "cpu"):
            raise CheckpointError(f"{where}: tensor on {tensor.device}: only {self.device} and host tensors save")

    def copy(self, dst, src, ordering):
        if not (src.is_cuda or dst.is_cuda):
            super().copy(dst, src, ordering)
            return
        if ordering is not None and ordering is not self._ordered:  # once per save: the stream stays ordered
            self._issue_device()
            self.stream.wait_event(ordering)
            self._ordered = ordering
        if src.is_contiguous() and dst.is_contiguous() and src.dtype == dst.dtype:
            dst, src = _bytes_of(dst), _bytes_of(src)
            run = self._device_run
            if run is not None and _continues(run[0], dst) and _continues(run[1], src):
                self._device_run = (_extend(run[0], dst), _extend(run[1], src))
                return
            self._issue_device()
            self._device_run = (dst, src)
            return
        self._issue_device()
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
        self._event_pending = True

    def _issue_device(self) -> None:
        """Queue the gathered device copy on the side stream: one copy per contiguous run."""
        if self._device_run is None:
            return
        dst, src = self._device_run
        self._device_run = None
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
        self._event_pending = True

    def _record(self) -> bool:
        """One event after the copies issued so far (waiters sleep on it instead of spinning); whether there
        were any."""
        self._issue_device()
        if not self._event_pending:
            return False
        event = torch.cuda.Event(blocking=True)
        event.record(self.stream)
        self._completes(event.synchronize)
        self._event_pending = False
        return True

    def mark(self, slot):
        self._marked_on_device = self._record()
        super().mark(slot)

    def checksum(self, slot):
        """The copy threads cannot wait on the side stream: a destination a device copy went into is checksummed
        by its writer."""
        if not self._marked_on_device:
            super().checksum(slot)

    def finish(self):
        self._record()
        super().finish()


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes, as a flat uint8 view."""
    return t.reshape(-1).view(torch.uint8)


def _continues(run: torch.Tensor, t: torch.Tensor) -> bool:
    """The bytes `t` start where the bytes `run` end, in the same storage (a copy never spans two allocations)."""
    return (t.device == run.device and t.untyped_storage().data_ptr() == run.untyped_storage().data_ptr() and
            t.data_ptr() == run.data_ptr() + run.numel())


def _extend(run: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """The bytes of `run` and then `t`, one view of their storage."""
    return run.as_strided((run.numel() + t.numel(),), (1,))


def make_backend(copy_threads: int | None = None, beside_training: bool = True) -> CopyBackend:
    """The backend of this process's device; `beside_training`: whether its copies run while training does (a
    save's snapshot) or alone (a load), which sizes the host copy threads by default."""
    if torch.cuda.is_available():
        return CudaCopyBackend(torch.device("cuda", torch.cuda.current_device()), copy_threads, beside_training)
    return HostCopyBackend(copy_threads, beside_training)


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
    values = _values_of(src)
    if values is not None:  # synchronously: the values may be freed once this returns
        out.copy_(values(src.storage_offset() + start // esize, nbytes // esize).reshape(-1))
        return
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
        if not self.job.encodes:  # an encoder reads the chunks itself
            self.backend.checksum(slot)
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
