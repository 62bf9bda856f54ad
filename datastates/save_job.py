"""One save as the caller and the pipeline's stages see it: what it cost (`SaveStats`), its handle (`SaveHandle`),
its state inside the pipeline (`Job`), a write straight from mapped pages (`PageWrite`) and the snapshot of another
save it is written from (`HeldSnapshot`, `save(from_save=)`).
"""
from __future__ import annotations

import dataclasses
import logging
import threading
from concurrent.futures import Future
from typing import Callable

import torch

from .errors import CheckpointError
from .kept import Kept
from .save_plan import Entry, Plan
from .storage import DataSink, PageLending

log = logging.getLogger(__name__)


@dataclasses.dataclass
class SaveStats:
    """What one save cost this rank (seconds from its `save()` call, bytes)."""

    blocking_s: float = 0.0  # the training thread inside the engine: the save() call and its fence waits
    snapshot_s: float | None = None  # until nothing of the save read the live state any more (the fence open)
    durable_s: float | None = None  # until published, durable where the storage syncs
    bytes: int = 0  # this rank's data
    throughput_gbps: float = 0.0  # bytes / durable_s
    peak_staging_bytes: int = 0  # the staging slots the save held at most
    staging_allocated_bytes: int = 0  # the host memory the staging pool holds
    staging_pinned_bytes: int = 0
    wait_ranks_s: float | None = None  # rank 0: from its own report to every rank's
    publish_s: float | None = None  # rank 0: from every rank's report to the tracker naming the checkpoint

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


class SaveHandle:
    """One save in flight. `wait()` raises the save's error, if any, and the engine never raises it again."""

    def __init__(self, path: str, lend: Callable[[threading.Event], None]):
        """`lend(event)` waits for the snapshot's end: the engine's copy backend's, which runs queued copies on
        the waiting thread meanwhile (`CopyBackend.lend`)."""
        self.path = path
        self._lend = lend
        self.error: BaseException | None = None
        self.delivered = False  # the error was raised to the caller (by this handle's or the engine's wait)
        self.stats = SaveStats()
        self._snapshot_done = threading.Event()
        self._done = threading.Event()
        self._lender: tuple | None = None  # (storage, job) of a save whose pages another save may write from
        self.kept: Kept | None = None  # the tensors this save keeps past itself (`CheckpointEngine.save(keep=)`)

    @property
    def snapshot_done(self) -> bool:
        return self._snapshot_done.is_set()

    def wait_for_snapshot(self) -> None:
        """Return once the save reads the live state no more; the waiting thread runs queued copies meanwhile."""
        self._lend(self._snapshot_done)

    def done(self) -> bool:
        return self._done.is_set()

    def join(self, timeout: float | None = None) -> bool:
        """Wait until the save finished, successfully or not (see `.error`); False on timeout."""
        return self._done.wait(timeout)

    def wait(self, timeout: float | None = None) -> SaveStats:
        if not self._done.wait(timeout):
            raise TimeoutError(f"save of {self.path!r} still running after {timeout} s")
        if self.error is not None:
            self.delivered = True
            raise self.error
        return self.stats


class Job:
    """One save on this rank, as the stages see it."""

    def __init__(self, seq: int, handle: SaveHandle, entries: list[Entry], plan: Plan, ordering, t0: float,
                 source: "HeldSnapshot | None" = None):
        self.seq = seq  # the same on every rank: ranks save in the same order
        self.handle = handle
        self.reported = False
        self.final = handle.path
        self.partial: str | None = None
        self.entries, self.plan, self.ordering, self.t0 = entries, plan, ordering, t0
        self.objects: list[tuple[Entry, Future]] = []  # the objects being pickled
        self.source = source  # the save whose pages this one writes its tensors from
        self.data: DataSink | None = None  # this rank's data, as the storage takes it
        self.size = 0
        self.manifest: dict | None = None
        self.encodes = False  # its data goes through the encoding stage (its stored layout is not the plan's)
        # called with each staged slot's buffer and (offset, length, item, chunk index) segments once its copies
        # landed, before it is written and reused (`save(keep=)`: the kept tensors' hand-over)
        self.slot_hooks: list[Callable[[torch.Tensor, list], None]] = []

    def fail(self, error: BaseException) -> None:
        if self.handle.error is None:
            self.handle.error = _describe(error, self.final)

    @property
    def failed(self) -> bool:
        return self.handle.error is not None


class PageWrite:
    """A write straight from mapped pages (this save's sink's, or another save's snapshot), shaped like a staging
    slot for the flusher and the completer: (offset, length, item, chunk index) segments, and the copies into
    it to wait on."""

    __slots__ = ("buffer", "fill", "file_offset", "segments", "job", "waits", "crcs")

    def __init__(self, buffer: torch.Tensor, file_offset: int, segments: list, job: Job):
        self.buffer, self.fill, self.file_offset = buffer, buffer.numel(), file_offset
        self.segments, self.job, self.waits = segments, job, []
        self.crcs = None  # copied into the sink's own pages and checksummed by the copy backend: its checksums


class HeldSnapshot:
    """The snapshot of a save to storage that lends its pages (the memory tier), held (not reused by its
    storage) while another save writes from it."""

    def __init__(self, storage: PageLending, job: Job):
        self.storage, self.job, self.held = storage, job, True
        storage.hold(job.final)

    @classmethod
    def of(cls, handle: SaveHandle | None) -> "HeldSnapshot | None":
        """The snapshot a save writes from: `handle`'s, held until that save finishes; None (the save copies the
        live state itself) when there is none, or `handle`'s save has no pages to lend (not to the memory tier,
        or encoded: its stored bytes are not the planned layout)."""
        if handle is None:
            return None
        if handle._lender is None:
            log.debug("the save of %r lends no pages (not to the memory tier, or encoded): a save from it copies "
                     "the state itself", handle.path)
            return None
        return cls(*handle._lender)

    def release(self) -> None:
        """Let go of the pages (once, whichever of a finished save or a dying engine comes first)."""
        if self.held:
            self.held = False
            self.storage.release(self.job.final)



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
