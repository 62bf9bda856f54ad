"""The save pipeline: a chain of stages, one thread each, so that none waits on another's kind of work. The engine
owns one (`SavePipeline`) and hands it each save; what a save cost comes back on its handle (`SaveStats`).

    copier      the save's snapshot (`snapshot.Copier`): tensors into the data sink's own pages where it has them
                (the memory tier) or staging slots, then the pickled objects; a save written from another save's
                pages (`from_save=`) copies nothing
    flusher     waits for a slot's copies to land, shows it to the save's hooks (`Job.slot_hooks`: the kept
                tensors' hand-over), submits it to the save's data sink: the storage's own, or the encoding stage
                around it (`encoding.EncodingSink`, `compress=`), which encodes and writes through it
    completer   collects checksums, returns slots to the pool, closes the sink, writes the rank's manifest and
                reports it
    publisher   rank 0: gathers every rank's report, publishes with the global index, then tells the others;
                other ranks: wait for rank 0's verdict (`coordination`, through the torch.distributed store)

If a stage thread dies, every pending save fails with the cause, the fence opens, and later saves fail at once.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor


from . import format as fmt
from . import paths
from .coordination import Coordinator
from .copies import CopyBackend
from .encoding import Encoder
from .errors import CheckpointError, CheckpointTimeoutError
from .priority import background_nice, lower_priority
from .save_job import HeldSnapshot, Job, PageWrite, SaveHandle, SaveStats
from .save_plan import Entry, Plan
from .save_root import Publisher
from .schema import Kind, Manifest
from .slots import StagingPool
from .snapshot import Copier
from .storage import DataSink, Done, PageLending, Storage

__all__ = ["HeldSnapshot", "SaveHandle", "SavePipeline", "SaveStats"]

log = logging.getLogger(__name__)

STOP = object()


class SavePipeline:
    """The stage threads of one engine and the saves in flight through them. If a stage thread dies, every
    pending save fails with the cause, the fence opens, and later saves fail at once (`check_usable`)."""

    def __init__(self, rank: int, world_size: int, storage: Storage, pool: StagingPool, backend: CopyBackend,
                 store, keep_last: int | None, publish_timeout_s: float, encoder: Encoder | None = None,
                 tracker: bool = True):
        """`store` carries the agreement on each save (`coordination`); the coordinator is made at the first
        save: an engine that only loads needs none. `encoder`: the encoding stage every save's data goes through
        (closed with the pipeline). `tracker`: whether publication points the save root's tracker at each new
        checkpoint."""
        self.rank, self.world_size, self.storage, self.pool, self.backend = rank, world_size, storage, pool, backend
        self.lends_pages = isinstance(storage, PageLending)  # the memory tier: a snapshot may land in its pages
        self.publisher = Publisher(storage, tracker=tracker)  # publication, retention, the tracker
        self.encoder = encoder
        self.keep_last, self.publish_timeout_s = keep_last, publish_timeout_s
        self._store = store
        self.coordinator: Coordinator | None = None
        self._seq = 0
        self._jobs: dict[SaveHandle, Job] = {}  # saves not finished yet, for failing them if a stage dies
        self._jobs_lock = threading.Lock()
        self._broken: CheckpointError | None = None
        self._nice = background_nice()  # the stages after the snapshot, below the caller's priority
        self._pickler = ThreadPoolExecutor(1, thread_name_prefix="ds-pickle")
        # retention, off the save path (the memory tier's unpins its pages: bound to the engine's device)
        self._deleter = ThreadPoolExecutor(1, thread_name_prefix="ds-delete", initializer=self._background_thread)
        self._queues = {name: queue.Queue() for name in ("copy", "flush", "complete", "publish")}
        self.copier = Copier(pool, backend, self.lends_pages, self._queues["flush"].put, self._sink)
        self._threads = [threading.Thread(target=self._guard, args=(name, fn), name=f"ds-{name}", daemon=True)
                         for name, fn in (
            ("copy", self._copier), ("flush", self._flusher), ("complete", self._completer),
            ("publish", self._publisher))]
        for t in self._threads:
            t.start()

    def check_usable(self, path: str) -> None:
        """A save of `path` fails at once when a stage thread died."""
        if self._broken is not None:
            raise CheckpointError(f"cannot save {path!r}: {self._broken}")

    def submit(self, handle: SaveHandle, entries: list[Entry], plan: Plan, t0: float,
               source: HeldSnapshot | None) -> None:
        """Start saving `entries` laid out by `plan` to `handle.path` (its tensors from `source` when given):
        the unpublished directory is made and the objects start pickling here, the rest on the stage threads."""
        if self.coordinator is None:
            self.coordinator = Coordinator(self._store, self.rank, self.world_size)
        self._seq += 1
        job = Job(self._seq, handle, entries, plan, self.backend.begin(), t0, source)
        # a save whose tensors are written from another save's pages keeps their planned layout; an encoded save
        # to the memory tier stages like any other, and lends no pages
        job.encodes = self.encoder is not None and source is None
        if handle.kept is not None:
            job.slot_hooks.append(handle.kept.take)
        try:
            job.partial = self.publisher.prepare(handle.path)
        except OSError as e:
            if source is not None:
                source.release()
            refused = CheckpointError(f"cannot prepare checkpoint {handle.path!r} ({e.filename!r}): {e.strerror}")
            self._refused(job, refused)
            raise refused from e
        handle._lender = (self.storage, job) if self.lends_pages and not job.encodes else None
        job.objects = [(e, self._pickler.submit(fmt.dumps, e.source, e.item.id))
                       for e in entries if e.item.kind == Kind.OBJECT and e.item.write]
        with self._jobs_lock:  # a stage dying meanwhile either sees this job or is seen here
            if self._broken is not None:
                if source is not None:
                    source.release()
                raise CheckpointError(f"cannot save {handle.path!r}: {self._broken}")
            self._jobs[handle] = job
        self._queues["copy"].put(job)

    def _refused(self, job: Job, error: CheckpointError) -> None:
        """A save refused on this rank at its call: its report says so at once (and rank 0's verdict, when it is
        rank 0's), so that no rank waits for this rank's part until the publication timeout."""
        if self.world_size == 1:
            return
        try:
            self.coordinator.report(job.seq, None, str(error))
            if self.rank == 0:
                self.coordinator.announce(job.seq, f"checkpoint {job.final!r} not published: rank 0: {error}")
            self.coordinator.done(job.seq)
        except BaseException as e:  # noqa: BLE001 - the store may be down too: the ranks time out instead
            log.warning("rank %d: cannot tell the ranks that %s was refused: %s", self.rank, job.final, e)

    def close(self) -> None:
        """Stop the stage threads (after the saves queued), then finish retention's deletions."""
        for q in (self._queues.values() if self._broken else [self._queues["copy"]]):
            q.put(STOP)  # a dead stage cannot pass the stop on
        for t in self._threads:
            t.join()
        self._pickler.shutdown()
        if self.encoder is not None:
            self.encoder.close()
        self._deleter.submit(_logged, self.publisher.sweep)
        self._deleter.shutdown()

    def _background_thread(self) -> None:
        self.backend.bind_thread()
        lower_priority(self._nice)

    def _guard(self, name: str, stage) -> None:
        """Run a stage; if it dies (an error outside its handlers), fail everything pending instead of hanging."""
        try:
            self.backend.bind_thread()
            if name != "copy":  # only the snapshot is on training's path (`priority`)
                lower_priority(self._nice)
            stage()
        except BaseException as e:  # noqa: BLE001
            self._die(name, e)

    def _die(self, name: str, error: BaseException) -> None:
        broken = CheckpointError(f"the checkpoint engine's {name} thread died ({type(error).__name__}: {error}); "
                                 f"no save can complete in this engine")
        broken.__cause__ = error
        log.error("rank %d: %s", self.rank, broken)
        with self._jobs_lock:
            self._broken = broken
            jobs, self._jobs = list(self._jobs.values()), {}
        for job in jobs:
            job.fail(broken)
            if not job.reported:  # the other ranks learn it now, not at their timeout
                try:
                    self._report(job)
                except BaseException:  # noqa: BLE001 - the store may be what broke; they will time out
                    pass
            if job.source is not None:
                job.source.release()
            if job.handle.kept is not None:
                job.handle.kept.release()
            self.backend.release(job.handle._snapshot_done)
            job.handle._done.set()
        self.pool.close()  # wakes a copier waiting for a slot that will never come back
        for q in self._queues.values():
            q.put(STOP)

    # ----- copier -----

    def _copier(self) -> None:
        while (job := self._queues["copy"].get()) is not STOP:
            self.copier.copy(job)
            self._queues["flush"].put(job)
        self._queues["flush"].put(STOP)

    def _sink(self, job: Job) -> DataSink:
        """This rank's data of `job`, opened by the first stage that needs it: the copier where the snapshot lands
        in the sink's pages, else the flusher, so that making the file is not on the snapshot's path."""
        if job.data is None:
            data = self.publisher.open_data(job.partial, self.rank, job.plan.tensor_region, lent=not job.encodes)
            job.data = self.encoder.wrap(data, [e.item for e in job.entries]) if job.encodes else data
        return job.data

    # ----- flusher, completer -----

    def _flusher(self) -> None:
        """Submit each slot to its save's data sink, in order; a save's marker (after its last slot) opens its
        data if no slot did (a save with nothing to write still has its, empty)."""
        flush_q, complete_q = self._queues["flush"], self._queues["complete"]
        while (slot := flush_q.get()) is not STOP:
            if isinstance(slot, Job):
                if not slot.failed:
                    try:
                        self._sink(slot)
                    except BaseException as e:  # noqa: BLE001
                        slot.fail(e)
                complete_q.put((slot, None))
            else:
                complete_q.put((slot, self._submit(slot)))
        complete_q.put(STOP)

    def _submit(self, slot) -> Done | None:
        """Once a slot's copies landed, its save's hooks see it (`Job.slot_hooks`), then it is written; what waits
        for its checksums, or None when its save failed."""
        job = slot.job
        if job.failed:
            return None
        try:
            data = self._sink(job)
            self.backend.ready(slot)
            for hook in job.slot_hooks:
                hook(slot.buffer, slot.segments)
            if slot.crcs is None:  # the writer checksums it
                segments = slot.segments if job.encodes else [(s[0], s[1]) for s in slot.segments]
                return data.submit(slot.buffer[:slot.fill], slot.file_offset, segments)
            if isinstance(slot, PageWrite):
                return slot.crcs  # already where the sink keeps it, checksummed as it landed: nothing to write
            written, crcs = data.submit(slot.buffer[:slot.fill], slot.file_offset, []), slot.crcs
            return lambda: (written(), crcs())[1]  # written by the sink, checksummed as it landed
        except BaseException as e:  # noqa: BLE001
            job.fail(e)
            return None

    def _completer(self) -> None:
        complete_q = self._queues["complete"]
        while (entry := complete_q.get()) is not STOP:
            slot, done = entry
            if isinstance(slot, Job):
                self._finish_rank(slot)
                self._queues["publish"].put(slot)
                continue
            try:
                if done is not None:
                    for (_, _, item, index), crc in zip(slot.segments, done()):
                        item.crcs[index] = crc
            except OSError as e:
                slot.job.fail(CheckpointError(f"writing {slot.job.data.path!r} failed: {e.strerror or e}"))
            except CheckpointError as e:  # the encoding stage's: this save fails, not the engine
                slot.job.fail(e)
            finally:
                if not isinstance(slot, PageWrite):
                    self.pool.release(slot)
        self._queues["publish"].put(STOP)

    def _finish_rank(self, job: Job) -> None:
        """All of this rank's data is written: close it (durable where the storage syncs), write the manifest
        (the rank's written proof of its part), and report it."""
        handle = job.handle
        stats = handle.stats
        stats.peak_staging_bytes, stats.staging_allocated_bytes, stats.staging_pinned_bytes = (
            self.pool.peak_bytes, self.pool.allocated_bytes, self.pool.pinned_bytes)
        try:
            if not job.failed:
                stored = job.data.close(job.size)
                if stored is not None:  # the encoding stage's length: its chunks back to back
                    job.size = stored
                job.manifest = fmt.signed_manifest(Manifest.written(self.rank, self.world_size, job.size,
                                                                    job.data.direct, [e.item for e in job.entries]))
                self.publisher.write_manifest(job.partial, self.rank, fmt.encode_json(job.manifest))
        except BaseException as e:  # noqa: BLE001
            job.fail(e)
        if job.failed and job.data is not None:
            job.data.discard()
        handle.stats.bytes = job.size
        self._report(job)

    def _report(self, job: Job) -> None:
        job.reported = True
        self.coordinator.report(job.seq, None if job.failed else job.manifest,
                                str(job.handle.error) if job.failed else None)

    # ----- publisher -----

    def _publisher(self) -> None:
        while (job := self._queues["publish"].get()) is not STOP:
            what = f"checkpoint {job.final!r}"
            try:
                if self.rank == 0:
                    t0 = time.perf_counter()
                    self.coordinator.await_reports(job.seq, what, self.publish_timeout_s)
                    t1 = time.perf_counter()
                    reports = self.coordinator.manifests(job.seq)
                    index = fmt.index_metadata({r: Manifest.parse(doc, f"rank {r}'s report of {what}")
                                                for r, doc in reports.items()},
                                               paths.iteration_of(job.final), self.world_size)
                    retired = self.publisher.publish(job.partial, job.final, fmt.encode_json(index), self.keep_last)
                    self.coordinator.announce(job.seq, None, retired)
                    job.handle.stats.wait_ranks_s, job.handle.stats.publish_s = t1 - t0, time.perf_counter() - t1
                else:
                    retired = self.coordinator.verdict(job.seq, what, self.publish_timeout_s)
                self._deleter.submit(_logged, self.publisher.delete, retired, self.rank, self.world_size)
            except BaseException as e:  # noqa: BLE001
                job.fail(e)
                if self.rank == 0:
                    try:
                        self._abandon(job, timed_out=isinstance(e, CheckpointTimeoutError))
                    except BaseException as e2:  # noqa: BLE001 - e.g. the store is gone: ranks time out instead
                        log.warning("rank 0: cannot tell the ranks that %s failed: %s", what, e2)
            try:
                self.coordinator.done(job.seq)
            except BaseException as e:  # noqa: BLE001 - the verdict is in; cleaning the store is best effort
                log.warning("rank %d: cannot clean the store keys of %s: %s", self.rank, what, e)
            self._finished(job)

    def _abandon(self, job: Job, timed_out: bool) -> None:
        """Rank 0, on a failed save: tell every rank at once, then remove what the save wrote (what cannot be
        removed now, e.g. the storage is down, is a leftover the next start removes)."""
        self.coordinator.announce(job.seq, str(job.handle.error))
        if not timed_out:  # let the ranks still writing finish touching the directory (they will fail anyway)
            self.coordinator.await_all_reports(job.seq, self.publish_timeout_s)
        try:
            self.publisher.abandon(job.partial)
        except Exception as e:  # noqa: BLE001
            log.warning("rank 0: cannot remove what the failed save of %r wrote (the next start will): %s",
                        job.final, e)

    def _finished(self, job: Job) -> None:
        handle = job.handle
        with self._jobs_lock:
            self._jobs.pop(handle, None)
        if job.source is not None:
            job.source.release()
        if handle.kept is not None:
            handle.kept.save_ended()
            if job.failed:  # a failed save has no consumer
                handle.kept.release()
        handle.stats.durable_s = time.perf_counter() - job.t0
        handle.stats.throughput_gbps = job.size / handle.stats.durable_s / 1e9
        handle._done.set()


def _logged(fn, *args) -> None:
    """Run a clean-up step, logging its failure (a leftover is removed at the next start, never fatal)."""
    try:
        fn(*args)
    except Exception as e:  # noqa: BLE001
        log.warning("deleting retired checkpoints: %s", e)
