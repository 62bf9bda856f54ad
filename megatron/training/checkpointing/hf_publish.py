"""--save-hf: each published checkpoint (every --save-hf-interval-th, and the last) also as a transformers model.

Beside the checkpoint: the save keeps the model weights it staged (`CheckpointEngine.save(keep=)`), and once they
are kept (before the checkpoint is durable) every rank writes them on a thread of its own, so a model published
here is byte for byte what `convert_checkpoint.py --to hf` writes from that checkpoint with the same shard size.
Three parts, each one job:

    hf_publish.py   the queue (this module): `submit` on the training thread, the export thread, `finished` / `drain`
    hf_job.py       the export job of one model: the plan and each rank's share of the files, the ranks' agreement
    hf_models.py    the publication: the models' root, its `latest`, retention, the clean-up of killed exports

A save whose weights do not fit in what is left of the staging budget (exports falling behind) keeps none: its
export is dropped, never waited for, except the run's last checkpoint's, which is then read back from storage.
--save-hf is a file system path, s3:// or msc://; every byte goes through the engine's storage contract
(`datastates.Storage`). A failed export is reported as a failed save (the manager applies --ckpt-on-failure).
Nothing here is on the training thread but `submit`, which queues.
"""
from __future__ import annotations

import datetime
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass

import torch

from datastates import CheckpointError, Coordinator, storage_for
from datastates.paths import normalize as normalize_path, scheme as url_scheme
from datastates.hf import HFError
from datastates.hf.arch import architecture_of
from datastates.hf.export import MTP, TOKENIZER_FILES, is_model_tensor

from ..local_dirs import unwritable
from .hf_job import ExportJob, SaveFailed, Submitted
from .hf_models import ModelRoot

log = logging.getLogger(__name__)

NICE = 10  # the export thread's niceness: it yields the cores to training, the snapshot and the checkpoint's writes


@dataclass(frozen=True)
class Exported:
    """An export that finished: `error` None when `path` was published (`ExportDropped` when it was left out)."""
    iteration: int
    path: str
    error: BaseException | None = None
    at: float = 0.0  # time.perf_counter() when it ended
    seconds: float = 0.0  # how long the export took, from its weights kept (its start) to the model published
    newest: str | None = None  # the model `latest` named when it ended (the one that stays newest on a failure)
    written: float | None = None  # from the start of its writes to every rank's files written (the export's own
    # work; the rest is waiting for its checkpoint); None when it wrote none (published already)
    passed: int | None = None  # bytes of kept weights passed between the ranks (None: read back from storage)


class HFPublisher:
    """One rank's export queue: `submit` queues a save, a thread exports them one at a time, in order
    (`ExportJob`), and `finished` / `drain` hand back, on rank 0, what ended (the manager reports failures as
    failed saves, drops as warnings). Collective at construction (the export's gloo group)."""

    def __init__(self, args, rank: int = 0, world_size: int = 1, store=None, models: ModelRoot | None = None,
                 flag: str = "--save-hf"):
        root = normalize_path(args.save_hf) if url_scheme(args.save_hf) else os.path.abspath(args.save_hf)
        # `models`: another root's policy over the same exports (the published weight versions' leases)
        self.models = models or ModelRoot(storage_for(root), root, args.save_hf_keep_last)
        self.interval = args.save_hf_interval or args.save_interval
        self.rank = rank
        # the pieces of the weights pass between ranks here, on the export thread, never on the training thread's group
        group = None if world_size == 1 else torch.distributed.new_group(
            backend="gloo", timeout=datetime.timedelta(seconds=args.ckpt_publish_timeout_s))
        self.submitted: int | None = None  # the newest iteration queued
        if rank == 0:  # before any export of this job: a rank exports only a checkpoint published after this
            self.models.start()
        self.job = ExportJob(self.models, args, rank, world_size, Coordinator(store, rank, world_size), group)
        behind = self.job.behind
        if rank == 0:
            log.info("%s: %s %s: each model is exported %s", flag, root,
                     "shares the storage of --save" if behind else "is on another storage than --save",
                     "once its checkpoint is saved" if behind else "while its checkpoint is saved")
        self._queue: queue.Queue = queue.Queue()
        self._done: list[Exported] = []
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="hf-export", daemon=True)
        self._thread.start()

    def due(self, iteration: int) -> bool:
        return iteration % self.interval == 0

    def keep(self, iteration: int, last: bool):
        """What the save of `iteration` keeps for its export (`CheckpointEngine.save(keep=)`): the model weights
        when it is due or the run's last, else nothing (None)."""
        if not (self.due(iteration) or last):
            return None
        return lambda name: is_model_tensor(name) and not name.startswith(MTP)

    def newest(self) -> str | None:
        """The model `latest` names (what an evaluation job takes now), on rank 0."""
        return self.models.newest()

    def submit(self, iteration: int, ckpt_dir: str, kept=None, last: bool = False, saved=None) -> None:
        """Export the checkpoint `ckpt_dir` of `iteration` once those before it are exported, from the weights its
        save `saved` (a `SaveHandle`; None: published already; REFUSED: refused at its call on this rank) `kept`
        (`SaveHandle.kept`, released once exported): its files are written as soon as every rank's kept weights
        are complete, its model published once the save is. The run's `last` is read back from storage when a
        rank kept none, any other is then dropped. A save that fails is not exported (the manager reports the
        failure). Every rank submits at its save calls, in the same order, refused ones included."""
        self.submitted = iteration
        self._queue.put(Submitted(iteration, ckpt_dir, kept, last, saved))

    def finished(self) -> list[Exported]:
        """The exports that ended since the last call (non-blocking)."""
        with self._lock:
            done, self._done = self._done, []
        return done

    def drain(self) -> list[Exported]:
        """Wait for every queued export; the exports that ended since the last call."""
        self._queue.join()
        return self.finished()

    def close(self) -> None:
        """Drop what was not started, let the export under way finish (it is never left half-published)."""
        while True:
            try:
                job = self._queue.get_nowait()
                if job.kept is not None:
                    job.kept.release()
                self._queue.task_done()
            except queue.Empty:
                break
        self._queue.put(None)
        self._thread.join()
        self.models.close()

    def _run(self) -> None:
        try:  # below training and the snapshot copies, as the engine's writers (nice +5) are
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICE)
        except (OSError, AttributeError):
            pass
        while True:
            job = self._queue.get()
            try:
                if job is None:
                    return
                self._export(job)
            finally:
                self._queue.task_done()

    def _export(self, job: Submitted) -> None:
        """One export, its kept weights released after it; rank 0 records how it ended (a failed save's export is
        left out: the manager reports the save)."""
        filled = job.kept is not None and job.kept.wait_filled()  # before the save is durable: kept, then written
        t0 = time.perf_counter()
        written = passed = None
        try:
            written, passed = self.job.run(job, filled)
            error = None
        except SaveFailed:  # the manager reports the failed save; nothing of its export is left
            return
        except Exception as e:  # noqa: BLE001 (any failure is the save's, reported, never raised here)
            error = e
        finally:
            if job.kept is not None:
                job.kept.release()
        now = time.perf_counter()
        if self.rank == 0:  # the job's verdict
            with self._lock:
                self._done.append(Exported(job.iteration, self.models.path(job.iteration), error, now, now - t0,
                                           self.newest(), None if written is None else written[1] - written[0],
                                           passed))


def check_save_hf(args) -> str | None:
    """Why --save-hf cannot run with these flags (None: it can): the offline tool's own refusals of the model,
    and a destination that cannot be reached, created or written, said before any work."""
    if not args.save:
        return "--save-hf needs --save (the model is exported from each published checkpoint)"
    if args.ckpt_format != "datastates":
        return f"--save-hf needs --ckpt-format datastates (got {args.ckpt_format})"
    for flag, value in (("--save-hf-interval", args.save_hf_interval), ("--save-hf-keep-last", args.save_hf_keep_last),
                        ("--save-hf-max-shard-size", args.save_hf_max_shard_size)):
        if value is not None and value < 1:
            return f"{flag} must be at least 1, got {value}"
    if args.save_hf_interval and args.save_interval and args.save_hf_interval % args.save_interval:
        return (f"--save-hf-interval {args.save_hf_interval} is not a multiple of --save-interval "
                f"{args.save_interval}: a model is exported from a checkpoint of the same iteration")
    if args.save_hf_tokenizer is not None:
        if not os.path.isdir(args.save_hf_tokenizer) or not any(
                os.path.isfile(os.path.join(args.save_hf_tokenizer, n)) for n in TOKENIZER_FILES):
            return (f"--save-hf-tokenizer {args.save_hf_tokenizer!r} is not a directory holding any of the tokenizer "
                    f"files {', '.join(TOKENIZER_FILES)}")
    if url_scheme(args.save_hf) is not None:
        if args.save_hf.startswith("msc://") and not args.enable_msc:
            return f"--save-hf {args.save_hf!r}: msc:// paths are disabled by --disable-msc"
        try:
            storage_for(args.save_hf).list(args.save_hf)
        except (OSError, CheckpointError, ImportError) as e:
            return f"--save-hf {args.save_hf!r}: {getattr(e, 'strerror', None) or e}"
    else:
        why = unwritable("--save-hf", args.save_hf)
        if why:
            return why
    try:
        architecture_of(args, "--save-hf", drop_mtp=True)
    except HFError as e:
        return str(e)
    return None
