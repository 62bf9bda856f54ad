"""CheckpointEngine: the one stateful object of a checkpointing run.

Lifecycle of a save, each stage on its own thread so that none waits on another's kind of work:

    save()      training thread: flatten the state, bind it to a cached plan, start pickling objects; returns
    copier      copies tensors into staging slots (CPU thread or CUDA side stream), then places pickled objects
    flusher     waits for a slot's copy to land, hands it to the native writer pool (pwrite + crc32c)
    completer   collects checksums, returns slots to the pool, fsyncs, writes the rank's manifest and reports it
    publisher   rank 0: gathers every rank's report, publishes with the global index, then tells the others;
                other ranks: wait for rank 0's verdict (`coordination`, through the torch.distributed store)

`wait_for_snapshot()` is the fence the training loop calls before it mutates saved state; `wait()` waits until
everything is durable and published and `latest` names it. If a stage thread dies, every pending save fails
with the cause, the fence opens, and later saves fail at once: nothing waits forever.
"""
from __future__ import annotations

import logging
import os
import queue
import shutil
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from . import _native
from . import commit
from . import format as fmt
from .coordination import Coordinator, default_store
from .errors import CheckpointError, CheckpointTimeoutError
from .plan import Entry, Plan
from .schema import Item
from .providers import ProviderRegistry, default_registry
from .restore import CheckpointReader, check_read_mode, resolve_checkpoint
from .snapshot import CopyBackend, SlotFiller, copy_tensor_bytes, make_backend
from .staging import StagingPool

log = logging.getLogger(__name__)

# Writers run at a lower priority than training and the snapshot copies: a flush may take a little longer,
# the copies the fence waits for and the next step do not.
WRITER_NICE = 5

# A load's native read threads: in read_mode "parallel", the 8 MiB reads in flight per rank (a read waits on the
# device's latency, not the CPU: 2 and 4 ranks sharing this machine's virtual disk loaded 1 GB 1.45-1.6x slower
# with 4 than with 8, and 12 gained nothing; Lustre's clients keep 8 RPCs in flight per OST by default); in
# "stream", how many data files are read at once.
DEFAULT_READ_THREADS = 8

_STOP = object()


class SaveHandle:
    """One save in flight. `wait()` raises the save's error, if any, and the engine never raises it again."""

    def __init__(self, path: str):
        self.path = path
        self.error: BaseException | None = None
        self.delivered = False  # the error was raised to the caller (by this handle's or the engine's wait)
        self.stats: dict[str, Any] = {"blocking_s": 0.0}
        self._snapshot_done = threading.Event()
        self._done = threading.Event()

    @property
    def snapshot_done(self) -> bool:
        return self._snapshot_done.is_set()

    def done(self) -> bool:
        return self._done.is_set()

    def join(self, timeout: float | None = None) -> bool:
        """Wait until the save finished, successfully or not (see `.error`); False on timeout."""
        return self._done.wait(timeout)

    def wait(self, timeout: float | None = None) -> dict:
        if not self._done.wait(timeout):
            raise TimeoutError(f"save of {self.path!r} still running after {timeout} s")
        if self.error is not None:
            self.delivered = True
            raise self.error
        return self.stats


class _Job:
    def __init__(self, seq: int, handle: SaveHandle, entries: list[Entry], plan: Plan,
                 objects: list[tuple[Entry, Future]], ordering, t0: float):
        self.seq = seq  # the same on every rank: ranks save in the same order
        self.handle = handle
        self.reported = False
        self.final = handle.path
        self.partial = commit.partial_dir(handle.path)
        self.entries, self.plan, self.objects, self.ordering, self.t0 = entries, plan, objects, ordering, t0
        self.file: _native.File | None = None
        self.size = 0
        self.manifest: dict | None = None

    def fail(self, error: BaseException) -> None:
        if self.handle.error is None:
            self.handle.error = _describe(error, self.final)

    @property
    def failed(self) -> bool:
        return self.handle.error is not None


class CheckpointEngine:
    """Lazy asynchronous checkpoints to a parallel file system, bounded host memory, native writers."""

    def __init__(self, host_buffer_bytes: int = 4 << 30, writer_threads: int = 4, direct_io="auto",
                 fsync: bool = True, rank: int | None = None, world_size: int | None = None,
                 keep_last: int | None = None, publish_timeout_s: float = 600.0,
                 registry: ProviderRegistry | None = None, copy_threads: int | None = None,
                 copy_backend: CopyBackend | None = None, store: torch.distributed.Store | None = None,
                 read_mode: str = "stream", read_threads: int = DEFAULT_READ_THREADS):
        """`store` (a torch.distributed Store shared by the ranks) carries the agreement on each save; by
        default the default process group's. `copy_backend` replaces the device backend (see `snapshot`).
        Loads read as `read_mode` says (see `CheckpointReader`) on `read_threads` native threads."""
        dist = torch.distributed
        initialized = dist.is_available() and dist.is_initialized()
        self.rank = rank if rank is not None else (dist.get_rank() if initialized else 0)
        self.world_size = world_size if world_size is not None else (dist.get_world_size() if initialized else 1)
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {keep_last}")
        check_read_mode(read_mode)  # here, before anything is allocated: the reader is made at the first load
        if read_threads < 1:
            raise ValueError(f"read_threads must be >= 1, got {read_threads}")
        self.direct_io = {True: "on", False: "off", "auto": "auto", "on": "on", "off": "off"}[direct_io]
        self.fsync = fsync
        self.keep_last = keep_last
        self.publish_timeout_s = publish_timeout_s
        self.registry = registry or default_registry
        if store is None and self.world_size > 1 and initialized:
            store = default_store()
        self._store = store
        self.coordinator: Coordinator | None = None  # made at the first save: an engine that only loads needs none
        self.backend = copy_backend or make_backend(copy_threads)
        self.pool = StagingPool(host_buffer_bytes, writer_threads, pinned=torch.cuda.is_available())
        self.io = _native.IOPool(writer_threads, WRITER_NICE)
        self.read_mode, self._read_threads = read_mode, read_threads
        self._read_io: _native.IOPool | None = None  # loads run at normal priority: a restart waits on them
        self._copy_threads = copy_threads
        self._load_backend: CopyBackend | None = None  # a load's copies out of the slots, apart from the saves'
        self._reader: tuple[tuple | None, CheckpointReader] | None = None
        self._plans: dict[tuple, Plan] = {}
        self._seq = 0
        self._published: dict[str, list[int]] = {}  # rank 0, with retention: published iterations per save root
        self._root_fds: dict[str, int] = {}  # rank 0: a descriptor of each save root, for its fsyncs
        self._emptying: list[list] = []  # rank 0: retired directories the ranks are emptying, [path, looks]
        self._jobs: dict[SaveHandle, _Job] = {}  # saves not finished yet, for failing them if a stage dies
        self._jobs_lock = threading.Lock()
        self._broken: CheckpointError | None = None
        self._pickler = ThreadPoolExecutor(1, thread_name_prefix="ds-pickle")
        self._deleter = ThreadPoolExecutor(1, thread_name_prefix="ds-delete")  # retention, off the save path
        self._pending: list[SaveHandle] = []
        self._queues = {name: queue.Queue() for name in ("copy", "flush", "complete", "publish")}
        self._threads = [threading.Thread(target=self._guard, args=(name, fn), name=f"ds-{name}", daemon=True)
                         for name, fn in (
            ("copy", self._copier), ("flush", self._flusher), ("complete", self._completer),
            ("publish", self._publisher))]
        for t in self._threads:
            t.start()
        self._closed = False

    # ----- the training-thread API -----

    def save(self, state: Any, path: str) -> SaveHandle:
        """Start saving `state` to the checkpoint directory `path`; returns before anything is copied."""
        if self._closed:
            raise CheckpointError("save() on a closed CheckpointEngine")
        if self._broken is not None:
            raise CheckpointError(f"cannot save {path!r}: {self._broken}")
        t0 = time.perf_counter()
        if self.coordinator is None:
            self.coordinator = Coordinator(self._store, self.rank, self.world_size)
        skeleton, entries = self.registry.flatten(state)
        for e in entries:
            if e.item.kind == "tensor" and e.item.write:
                self.backend.check(e.source, f"saving {path!r}: item {e.item.id!r}")
        entries.append(Entry(Item(id=fmt.SKELETON_ID, kind="object"), skeleton))
        plan = self._plan_for([e.item for e in entries])
        handle = SaveHandle(os.path.normpath(path))
        self._seq += 1
        job = _Job(self._seq, handle, entries, plan, [], self.backend.begin(), t0)
        try:
            _make_dir(job.partial)
        except OSError as e:
            raise CheckpointError(f"cannot create checkpoint directory {job.partial!r}: {e.strerror}") from e
        job.objects = [(e, self._pickler.submit(fmt.dumps, e.source, e.item.id))
                       for e in entries if e.item.kind == "object" and e.item.write]
        with self._jobs_lock:  # a stage dying meanwhile either sees this job or is seen here
            if self._broken is not None:
                raise CheckpointError(f"cannot save {path!r}: {self._broken}")
            self._jobs[handle] = job
        self._pending.append(handle)
        self._queues["copy"].put(job)
        handle.stats["blocking_s"] += time.perf_counter() - t0
        return handle

    def wait_for_snapshot(self) -> None:
        """The fence: return once no pending save reads the live state any more."""
        t0 = time.perf_counter()
        waiting = [h for h in self._pending if not h.snapshot_done]
        for h in waiting:
            h._snapshot_done.wait()
        if waiting:
            waiting[-1].stats["blocking_s"] += time.perf_counter() - t0

    def wait(self) -> list[dict]:
        """Block until every pending save is durable and published; raise the first failure not yet raised by
        its handle's `wait()` (so `close()`, and leaving a `with` block, never repeat an error already seen)."""
        handles, self._pending = self._pending, []
        for h in handles:
            h._done.wait()
        for h in handles:
            if h.error is not None and not h.delivered:
                h.delivered = True
                raise h.error
        return [h.stats for h in handles]

    def maybe_finalize(self) -> list[SaveHandle]:
        """Non-blocking: the saves that finished since the last call (failed ones carry `.error`)."""
        finished, pending = [], []
        for h in self._pending:  # one look per handle: one finishing meanwhile lands in exactly one list
            (finished if h.done() else pending).append(h)
        self._pending = pending
        return finished

    def load(self, path: str, template: Any = None, rank: int | None = None) -> Any:
        """Load the checkpoint at `path` (an iteration directory or a save root, whose latest is used).

        Without a template the state saved by `rank` is rebuilt. With one, its tensors are filled in place
        (resharded from whatever layout was saved) and the rebuilt template is returned. A save still copying
        the live state is let finish first: a load into the same tensors would change what it saves."""
        self.wait_for_snapshot()
        return self.reader(path).load(self.rank if rank is None else rank, template)

    def reader(self, path: str) -> CheckpointReader:
        """A reader of the published checkpoint at `path` (its index, verified reads), on the engine's read pool.

        The last one is kept while its metadata.json is the same file: a resume that loads in several steps
        reads the index once."""
        if self._read_io is None:
            self._read_io = _native.IOPool(self._read_threads)
            self._load_backend = make_backend(self._copy_threads)
        resolved = resolve_checkpoint(path)
        try:
            st = os.stat(os.path.join(resolved, fmt.METADATA))
            key = (resolved, st.st_ino, st.st_mtime_ns, st.st_size)
        except OSError:
            key = None  # gone meanwhile: the reader reports it
        if key is None or self._reader is None or self._reader[0] != key:
            if self._reader is not None:
                self._reader[1].close()
            self._reader = (key, CheckpointReader(resolved, self._read_io, self.pool, self._load_backend,
                                                  self.registry, self.read_mode, self.direct_io))
        return self._reader[1]

    def close(self) -> None:
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            for q in (self._queues.values() if self._broken else [self._queues["copy"]]):
                q.put(_STOP)  # a dead stage cannot pass the stop on
            for t in self._threads:
                t.join()
            self._pickler.shutdown()
            self._deleter.submit(_logged, self._sweep)
            self._deleter.shutdown()
            for fd in self._root_fds.values():
                os.close(fd)
            self.backend.close()
            self.io.close()
            if self._reader is not None:
                self._reader[1].close()
            if self._read_io is not None:
                self._read_io.close()
                self._load_backend.close()
            self.pool.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if exc[0] is None:
            self.close()
        else:
            try:
                self.close()
            except CheckpointError:
                pass  # the body's exception is the one to see

    # ----- plan -----

    def _plan_for(self, items: list[Item]) -> Plan:
        """Lay out the items; the layout of an unchanged structure is reused."""
        key = Plan.signature(items)
        cached = self._plans.get(key)
        if cached is None:
            cached = Plan(items, self.pool.slot_bytes)
            self._plans = {key: cached}  # one structure at a time; a changed model replaces it
        cached.apply(items)
        return cached

    # ----- background stages -----

    def _guard(self, name: str, stage) -> None:
        """Run a stage; if it dies (an error outside its handlers), fail everything pending instead of hanging."""
        try:
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
            job.handle._snapshot_done.set()
            job.handle._done.set()
        self.pool.close()  # wakes a copier waiting for a slot that will never come back
        for q in self._queues.values():
            q.put(_STOP)

    @torch.no_grad()
    def _copier(self) -> None:
        while (job := self._queues["copy"].get()) is not _STOP:
            self._stage(job)
        self._queues["flush"].put(_STOP)

    def _stage(self, job: _Job) -> None:
        handle = job.handle
        self.pool.reset_peak()
        filler = SlotFiller(self.pool, self.backend, job, self._queues["flush"].put)
        try:
            job.file = _native.File(os.path.join(job.partial, fmt.data_file(self.rank)), "w", self.direct_io,
                                    job.plan.tensor_region)
            for e in job.entries:
                if e.item.kind == "tensor" and e.item.write:
                    src = e.source
                    filler.add(e.item, lambda dst, start, n, src=src: copy_tensor_bytes(
                        dst, src, start, n, self.backend, job.ordering), aligned=True)
            self.backend.finish()
            pickled = [(e, f.result()) for e, f in job.objects]
        except BaseException as e:  # noqa: BLE001 - any failure fails this save, never the engine
            job.fail(e)
            self.backend.finish()
            for _, f in job.objects:
                f.cancel()
            pickled = []
        handle.stats["snapshot_s"] = time.perf_counter() - job.t0
        handle._snapshot_done.set()
        try:
            for e, data in pickled:
                e.item.nbytes = len(data)
                filler.add(e.item, lambda dst, start, n, data=data: dst.numpy().__setitem__(
                    slice(None), np.frombuffer(data, np.uint8, n, start)), aligned=False)
        except BaseException as e:  # noqa: BLE001
            job.fail(e)
        filler.flush()
        job.size = filler.position
        self._queues["flush"].put(job)

    def _flusher(self) -> None:
        flush_q, complete_q = self._queues["flush"], self._queues["complete"]
        while (slot := flush_q.get()) is not _STOP:
            ticket = None
            if not isinstance(slot, _Job) and not slot.job.failed:
                try:
                    self.backend.ready(slot)
                    ticket = self.io.submit_write(slot.job.file, slot.buffer.data_ptr(), slot.fill,
                                                  slot.file_offset, [(s[0], s[1]) for s in slot.segments])
                except BaseException as e:  # noqa: BLE001
                    slot.job.fail(e)
            complete_q.put((slot, ticket))
        complete_q.put(_STOP)

    def _completer(self) -> None:
        complete_q = self._queues["complete"]
        while (entry := complete_q.get()) is not _STOP:
            slot, ticket = entry
            if isinstance(slot, _Job):
                self._finish_rank(slot)
                self._queues["publish"].put(slot)
                continue
            try:
                if ticket is not None:
                    for (_, _, item, index), crc in zip(slot.segments, self.io.wait(ticket)):
                        item.crcs[index] = crc
            except OSError as e:
                slot.job.fail(CheckpointError(f"writing {slot.job.file.path!r} failed: {e.strerror or e}"))
            finally:
                self.pool.release(slot)
        self._queues["publish"].put(_STOP)

    def _finish_rank(self, job: _Job) -> None:
        """All slots of this rank are written: fsync the data, write the manifest (the rank's written proof of its
        part), and report it."""
        handle = job.handle
        handle.stats.update(peak_staging_bytes=self.pool.peak_bytes, staging_allocated_bytes=self.pool.allocated_bytes,
                            staging_pinned_bytes=self.pool.pinned_bytes)
        try:
            if not job.failed:
                job.file.truncate(job.size)
                if self.fsync:
                    job.file.fsync()
                job.file.close()
                items = [e.item.to_json() for e in job.entries]
                body = {"rank": self.rank, "world_size": self.world_size, "data_file": fmt.data_file(self.rank),
                        "data_bytes": job.size, "direct_io": job.file.direct, "items": items}
                # the directory entry is made durable by rank 0's fsync of the directory at publication
                job.manifest = fmt.write_manifest(os.path.join(job.partial, fmt.manifest_file(self.rank)), body,
                                                  self.fsync)
        except BaseException as e:  # noqa: BLE001
            job.fail(e)
        if job.file is not None:
            job.file.close()
        handle.stats["bytes"] = job.size
        self._report(job)

    def _report(self, job: _Job) -> None:
        job.reported = True
        self.coordinator.report(job.seq, None if job.failed else job.manifest,
                                str(job.handle.error) if job.failed else None)

    def _publisher(self) -> None:
        while (job := self._queues["publish"].get()) is not _STOP:
            what = f"checkpoint {job.final!r}"
            try:
                if self.rank == 0:
                    t0 = time.perf_counter()
                    self.coordinator.await_reports(job.seq, what, self.publish_timeout_s)
                    t1 = time.perf_counter()
                    retired = self._publish(job, self.coordinator.manifests(job.seq))
                    self.coordinator.announce(job.seq, None, retired)
                    job.handle.stats.update(wait_ranks_s=t1 - t0, publish_s=time.perf_counter() - t1)
                else:
                    retired = self.coordinator.verdict(job.seq, what, self.publish_timeout_s)
                self._deleter.submit(_logged, self._delete, retired)
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

    def _abandon(self, job: _Job, timed_out: bool) -> None:
        """Rank 0, on a failed save: tell every rank at once, then remove the unfinished directory."""
        self.coordinator.announce(job.seq, str(job.handle.error))
        if not timed_out:  # let the ranks still writing finish touching the directory (they will fail anyway)
            self.coordinator.await_all_reports(job.seq, self.publish_timeout_s)
        shutil.rmtree(job.partial, ignore_errors=True)

    def _finished(self, job: _Job) -> None:
        handle = job.handle
        with self._jobs_lock:
            self._jobs.pop(handle, None)
        handle.stats["durable_s"] = time.perf_counter() - job.t0
        handle.stats["throughput_gbps"] = job.size / handle.stats["durable_s"] / 1e9
        handle._done.set()

    def _publish(self, job: _Job, manifests: dict[int, dict]) -> list[str]:
        """Rank 0: write the global index, rename the directory into place, retire old ones, point `latest` at
        it; returns the retired directories."""
        iteration = commit.iteration_of(job.final)
        metadata = fmt.index_metadata(manifests, iteration, self.world_size)
        root = os.path.dirname(job.final) or "."
        published = None
        if self.keep_last is not None and iteration is not None:
            if root not in self._published:  # scanned once per save root, then kept up to date by retention
                self._published[root] = commit.published_iterations(root)
            published = self._published[root]
        if self.fsync and root not in self._root_fds:
            self._root_fds[root] = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
        return commit.publish(job.partial, job.final, metadata, self.fsync, self.keep_last, published,
                              self._root_fds.get(root))

    def _delete(self, retired: list[str]) -> None:
        """Deleter thread, off the save path: every rank deletes its share of the retired checkpoints
        (`commit.deletes`); rank 0 then removes the emptied directories, looking again at each publication, and
        after a few looks (a rank died, or the checkpoint came from a larger world) removes what is left itself."""
        for path in retired:
            for name in commit.deletes(self.rank, self.world_size):
                try:
                    os.unlink(os.path.join(path, name))
                except FileNotFoundError:
                    pass
        if self.rank != 0:
            return
        still = []
        for entry in self._emptying:
            try:
                os.rmdir(entry[0])
            except FileNotFoundError:
                pass
            except OSError:
                entry[1] += 1
                if entry[1] < 3:
                    still.append(entry)
                else:
                    shutil.rmtree(entry[0], ignore_errors=True)
        self._emptying = still + [[path, 0] for path in retired]

    def _sweep(self) -> None:
        """Deleter thread, at close: rank 0 removes the retired directories still there."""
        for path, _ in self._emptying:
            shutil.rmtree(path, ignore_errors=True)
        self._emptying = []

def _logged(fn, *args) -> None:
    """Run a clean-up step, logging its failure (a leftover is removed at the next start, never fatal)."""
    try:
        fn(*args)
    except Exception as e:  # noqa: BLE001
        log.warning("deleting retired checkpoints: %s", e)


def _make_dir(path: str) -> None:
    """One mkdir where the save root exists (the other ranks' mkdir of the same directory may come first)."""
    try:
        os.mkdir(path)
    except FileExistsError:
        pass
    except FileNotFoundError:
        os.makedirs(path, exist_ok=True)


def _describe(error: BaseException, path: str) -> CheckpointError:
    """A CheckpointError whose message names the checkpoint being saved."""
    if isinstance(error, CheckpointError) and path in str(error):
        return error
    if isinstance(error, CheckpointError):
        wrapped = type(error)(f"saving {path!r} failed: {error}")
    elif isinstance(error, OSError):
        where = f" {error.filename!r}" if error.filename else ""
        wrapped = CheckpointError(f"saving {path!r} failed:{where} {error.strerror or error}")
    else:
        wrapped = CheckpointError(f"saving {path!r} failed: {type(error).__name__}: {error}")
    wrapped.__cause__ = error
    return wrapped
