"""The copier stage of the save pipeline: one save's snapshot. Its tensors are copied into their destination, then
its pickled objects are packed into staging slots after them; once nothing of the save reads the live state any
more, its fence opens. The destination is the data sink's own pages where it has them (the memory tier: the
snapshot lands where it is kept), else staging slots handed to the writers as they fill; a save written from
another save's pages (`from_save=`) copies nothing and hands those pages to the writers.
"""
from __future__ import annotations

import time
from typing import Callable

import numpy as np
import torch

from .copies import CopyBackend, SlotFiller, copy_tensor_bytes
from .errors import CheckpointError
from .save_job import Job, PageWrite
from .save_plan import Entry, align_up
from .schema import Kind
from .slots import StagingPool
from .storage import DataSink


class Copier:
    """The copier of one pipeline. `emit` hands a slot, a page write or a save's marker to the writers;
    `open_sink(job)` opens the save's data (the copier opens it only where the snapshot lands in its pages)."""

    def __init__(self, pool: StagingPool, backend: CopyBackend, lends_pages: bool, emit: Callable,
                 open_sink: Callable[[Job], DataSink]):
        self.pool, self.backend, self.lends_pages, self.emit, self.open_sink = (
            pool, backend, lends_pages, emit, open_sink)

    @torch.no_grad()
    def copy(self, job: Job) -> None:
        """Copy the tensors to their destination, then pack the pickled objects into slots after them. The
        destination is the data sink's own pages where it has them (the memory tier: the snapshot lands where it
        is kept), else staging slots handed to the writers as they fill; a save written from another save's
        pages (`from_save=`) copies nothing and submits those pages."""
        filler = SlotFiller(self.pool, self.backend, job, self.emit)
        self.pool.reset_peak()

        def copy_tensors():
            if job.source is not None:
                self._write_from_pages(job)
            elif job.data is not None:
                self._copy_into_pages(job)
            else:
                for e in self._tensors(job):
                    filler.add(e.item, lambda dst, start, n, src=e.source: copy_tensor_bytes(
                        dst, src, start, n, self.backend, job.ordering), aligned=True)
                return
            filler.position = job.plan.tensor_region
        pickled = self._snapshot(job, copy_tensors)
        try:
            for e, data in pickled:
                e.item.nbytes = len(data)
                filler.add(e.item, lambda dst, start, n, data=data: dst.numpy().__setitem__(
                    slice(None), np.frombuffer(data, np.uint8, n, start)), aligned=False)
        except BaseException as e:  # noqa: BLE001
            job.fail(e)
        filler.flush()
        job.size = filler.position

    def _snapshot(self, job: Job, copy_tensors) -> list[tuple[Entry, bytes]]:
        """Run `copy_tensors()` and wait for the pickles: then nothing of this save reads the live state any
        more and the fence opens. Returns the pickled objects (none if the save failed)."""
        try:
            if self.lends_pages and not job.encodes and job.source is None:  # the snapshot lands in its pages
                self.open_sink(job)
            copy_tensors()
            self.backend.finish()
            pickled = [(e, f.result()) for e, f in job.objects]
        except BaseException as e:  # noqa: BLE001 - any failure fails this save, never the engine
            job.fail(e)
            self.backend.finish()
            for _, f in job.objects:
                f.cancel()
            pickled = []
        job.handle.stats.snapshot_s = time.perf_counter() - job.t0
        self.backend.release(job.handle._snapshot_done)
        return pickled

    def _tensors(self, job: Job):
        return [e for e in job.entries if e.item.kind == Kind.TENSOR and e.item.write]

    def _copy_into_pages(self, job: Job) -> None:
        """Each tensor's chunks are copied straight to its planned offset in the sink's pages (the padding up to
        the next item zeroed), and the item goes to the flusher, which submits it once its copies landed; the copy
        backend checksums it where it can (the bytes are where they are kept: nothing more to write)."""
        pages = job.data.pages
        for e in self._tensors(job):
            item = e.item
            for start, n in item.chunks():
                copy_tensor_bytes(pages[item.offset + start:], e.source, start, n, self.backend, job.ordering)
            pages[item.offset + item.nbytes:item.offset + align_up(item.nbytes)].zero_()
            write = PageWrite(pages[item.offset:item.offset + align_up(item.nbytes)], item.offset,
                              [(start, n, item, index) for index, (start, n) in enumerate(item.chunks())], job)
            self.backend.mark(write)
            self.backend.checksum(write)
            self.emit(write)

    def _write_from_pages(self, job: Job) -> None:
        """Once the snapshot of `job.source` is taken, hand each tensor of this save to the writers straight from
        its bytes there (whole aligned blocks: O_DIRECT takes them as they are)."""
        source = job.source.job
        source.handle._snapshot_done.wait()
        if source.failed:
            raise CheckpointError(f"the memory checkpoint it is written from failed: {source.handle.error}")
        saved = {e.item.id: e.item for e in source.entries}
        pages = source.data.pages
        for e in self._tensors(job):
            item, held = e.item, saved.get(e.item.id)
            if held is None or (held.kind, held.dtype, held.shape) != (item.kind, item.dtype, item.shape):
                raise CheckpointError(f"the memory checkpoint {source.final!r} has no tensor {item.id!r} of "
                                      f"{item.dtype} {item.shape}: it was saved from another state")
            segments = [(start, n, item, index) for index, (start, n) in enumerate(item.chunks())]
            block = pages[held.offset:held.offset + align_up(item.nbytes)]
            self.emit(PageWrite(block, item.offset, segments, job))
