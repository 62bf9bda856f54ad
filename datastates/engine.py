"""CheckpointEngine: the one stateful object of a checkpointing run.

`save()` runs on the training thread: it flattens the state, binds it to a cached plan, starts pickling the
objects and hands the save to its pipeline (`pipeline`), whose stage threads copy, write and publish it through
the engine's storage (`storage`: a POSIX file system, or the node-local memory tier's shared memory).

`wait_for_snapshot()` is the fence the training loop calls before it mutates saved state; `wait()` waits until
everything is durable and published and `latest` names it. If a stage thread dies, every pending save fails
with the cause, the fence opens, and later saves fail at once: nothing waits forever.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable

import torch

from . import codecs
from . import format as fmt
from . import paths
from .coordination import default_store
from .errors import CheckpointError
from .save_plan import Entry, Plan
from .schema import Item, Kind
from .providers import ProviderRegistry, default_registry
from .exchange import Exchange
from .loader import CheckpointLoader
from .open_checkpoint import OpenCheckpoint, resolve_checkpoint
from .copies import CopyBackend, make_backend
from .kept import KeepBudget, Kept
from .encoding import Encoder
from .pipeline import HeldSnapshot, SaveHandle, SavePipeline, SaveStats
from .slots import StagingPool, chunk_size, slot_size
from .storage import PosixOptions, PosixStorage, Storage

log = logging.getLogger(__name__)


class CheckpointEngine:
    """Lazy asynchronous checkpoints to a parallel file system (or the memory tier), bounded host memory,
    native writers."""

    def __init__(self, host_buffer_bytes: int = 4 << 30, storage: Storage | PosixOptions = PosixOptions(),
                 rank: int | None = None, world_size: int | None = None, keep_last: int | None = None,
                 publish_timeout_s: float = 600.0, registry: ProviderRegistry | None = None,
                 copy_threads: int | None = None, copy_backend: CopyBackend | None = None,
                 store: torch.distributed.Store | None = None, compress: str = "off", encode_threads: int = 2,
                 stage_ahead: bool | None = None, tracker: bool = True):
        """`storage` is where checkpoints are saved and loaded: a backend (`storage.storage_for`), or the options
        of a POSIX file system (`PosixOptions`: fsync, O_DIRECT, threads, read mode) to use one with; its
        `writer_threads` also size the staging slots. `store` (a torch.distributed Store shared by the ranks)
        carries the agreement on each save; by default the default process group's. `copy_backend` replaces the
        device backend (see `copies`). `compress`: "off", "auto" (what pays on this storage,
        `codecs.for_storage`) or a codec's name; tensor chunks are encoded on `encode_threads` threads.
        `stage_ahead`: make the whole staging budget now, in the background (mapped, faulted in and, with CUDA,
        pinned), so that no save allocates or pins on its way; by default with CUDA, where pinning as saves go
        cost the first saves most of their speed. Size `host_buffer_bytes` to what a save holds when it is on.
        `tracker`: whether publication points the save root's tracker at each new checkpoint (the memory tier
        keeps none: its restart lists every rank's parts)."""
        dist = torch.distributed
        initialized = dist.is_available() and dist.is_initialized()
        self.rank = rank if rank is not None else (dist.get_rank() if initialized else 0)
        self.world_size = world_size if world_size is not None else (dist.get_world_size() if initialized else 1)
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {keep_last}")
        self.storage = PosixStorage(storage) if isinstance(storage, PosixOptions) else storage
        try:  # what it refuses, before any thread or staging exists
            slot_size(host_buffer_bytes, self.storage.options.writer_threads)
            self.codec = codecs.for_storage(compress, self.storage)
        except BaseException:
            if isinstance(storage, PosixOptions):
                self.storage.close()
            raise
        self.registry = registry or default_registry
        if store is None and self.world_size > 1 and initialized:
            store = default_store()
        self.backend = copy_backend or make_backend(copy_threads)
        pinned = torch.cuda.is_available()
        self.pool = StagingPool(host_buffer_bytes, self.storage.options.writer_threads, pinned=pinned,
                                device=self.backend.device)
        if pinned if stage_ahead is None else stage_ahead:
            self.pool.prepare()
        encoder = None if self.codec is None else Encoder(self.codec, encode_threads)
        self.keep_budget = KeepBudget(host_buffer_bytes)  # what saves keep past themselves (`save(keep=)`)
        self.pipeline = SavePipeline(self.rank, self.world_size, self.storage, self.pool, self.backend, store,
                                     keep_last, publish_timeout_s, encoder, tracker)
        self._copy_threads = copy_threads
        self._load_backend: CopyBackend | None = None  # a load's copies out of the slots, apart from the saves'
        self._open: tuple[tuple | None, OpenCheckpoint] | None = None  # the last checkpoint read, and its key
        self._plans: dict[tuple, Plan] = {}
        self._pending: list[SaveHandle] = []
        self._closed = False

    # ----- the training-thread API -----

    def save(self, state: Any, path: str, from_save: SaveHandle | None = None,
             keep: Callable[[str], bool] | None = None) -> SaveHandle:
        """Start saving `state` to the checkpoint directory `path`; returns before anything is copied.

        `from_save`: a save of the same state by an engine on storage that lends its pages (the memory tier),
        just started. This save then copies nothing: it writes its tensors from that save's pages once their
        snapshot is done. A save that lends none (another storage, or encoded) is no source: this save then
        copies the state itself.

        `keep`: which global tensors (by name) of this rank's part to keep past the save, copied from where the
        save staged them (`handle.kept`, `kept.Kept`): within the staging budget over every save's kept bytes,
        or none of them (said in `kept.why`); never waited for."""
        if self._closed:
            raise CheckpointError("save() on a closed CheckpointEngine")
        self.pipeline.check_usable(path)
        t0 = time.perf_counter()
        skeleton, entries = self.registry.flatten(state)
        for e in entries:
            if e.item.kind == Kind.TENSOR and e.item.write:
                self.backend.check(e.source, f"saving {path!r}: item {e.item.id!r}")
        entries.append(Entry(Item(id=fmt.SKELETON_ID, kind=Kind.OBJECT), skeleton))
        plan = self._plan_for([e.item for e in entries])
        handle = SaveHandle(paths.normalize(path), self.backend.lend)
        if keep is not None:
            handle.kept = Kept([e.item for e in entries if e.item.kind == Kind.TENSOR and e.item.write and
                                e.item.name is not None and keep(e.item.name)], self.keep_budget)
        try:
            self.pipeline.submit(handle, entries, plan, t0, HeldSnapshot.of(from_save))
        except BaseException:
            if handle.kept is not None:  # refused at the call: nothing to keep
                handle.kept.release()
            raise
        self._pending.append(handle)
        handle.stats.blocking_s += time.perf_counter() - t0
        return handle

    def staging_ready(self, timeout: float | None = None) -> bool:
        """Wait until the staging made ahead (`stage_ahead`) is ready; False if `timeout` seconds passed first.
        Saves need not call it: the first one waits by itself if it must."""
        return self.pool.prepared(timeout)

    @property
    def publish_timeout_s(self) -> float:
        """How long a save waits for every rank's report before it fails naming the missing ranks; it may be
        changed between saves."""
        return self.pipeline.publish_timeout_s

    @publish_timeout_s.setter
    def publish_timeout_s(self, seconds: float) -> None:
        self.pipeline.publish_timeout_s = seconds

    def wait_for_snapshot(self) -> None:
        """The fence: return once no pending save reads the live state any more. Meanwhile the calling thread,
        blocked, runs queued host copies of the snapshot itself (`CopyBackend.lend`): the copy threads leave
        training a core, which training idle at the fence lends back."""
        t0 = time.perf_counter()
        waiting = [h for h in self._pending if not h.snapshot_done]
        for h in waiting:
            h.wait_for_snapshot()
        if waiting:
            waiting[-1].stats.blocking_s += time.perf_counter() - t0

    def wait(self) -> list[SaveStats]:
        """Block until every pending save is durable and published; raise the first failure not yet raised by
        its handle's `wait()` (so `close()`, and leaving a `with` block, never repeat an error already seen)."""
        handles, self._pending = self._pending, []
        for h in handles:
            h.wait_for_snapshot()  # blocked on the snapshot's copies too: lends its core to them
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

    def load(self, path: str, template: Any = None, rank: int | None = None, exchange: Exchange | None = None) -> Any:
        """Load the checkpoint at `path` (an iteration directory or a save root, whose latest is used).

        Without a template the state saved by `rank` is rebuilt. With one, its tensors are filled in place
        (resharded from whatever layout was saved) and the rebuilt template is returned. A save still copying
        the live state is let finish first: a load into the same tensors would change what it saves. With
        `exchange` (every rank of its group loading at once), each saved byte several of them want is read by
        one and passed to the others."""
        self.wait_for_snapshot()
        loader = CheckpointLoader(self.checkpoint(path), self.registry)
        return loader.load(self.rank if rank is None else rank, template, exchange=exchange)

    def checkpoint(self, path: str) -> OpenCheckpoint:
        """The published checkpoint at `path`, open for reading (its index, verified reads) on the engine's
        staging pool.

        The last one is kept while its metadata.json is the same: a resume that loads in several steps reads the
        index once."""
        if self._load_backend is None:
            self._load_backend = make_backend(self._copy_threads, beside_training=False)
        resolved = resolve_checkpoint(path, self.storage)
        version = self.storage.stat(paths.join(resolved, paths.METADATA))
        key = None if version is None else (resolved, version)  # None: gone meanwhile, opening it reports it
        if key is None or self._open is None or self._open[0] != key:
            if self._open is not None:
                self._open[1].close()
            self._open = (key, OpenCheckpoint(resolved, self.storage, self.pool, self._load_backend))
        return self._open[1]

    def close(self) -> None:
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            self.pipeline.close()
            if self._open is not None:
                self._open[1].close()
            self.storage.close()
            self.backend.close()
            if self._load_backend is not None:
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
            cached = Plan(items, chunk_size(self.pool.slot_bytes))
            self._plans = {key: cached}  # one structure at a time; a changed model replaces it
        cached.apply(items)
        return cached

