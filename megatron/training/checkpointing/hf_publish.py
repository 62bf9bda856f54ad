"""--save-hf: each published checkpoint (every --save-hf-interval-th, and the last) also as a transformers model.

Beside the checkpoint: the save keeps the model weights it staged (`CheckpointEngine.save(keep=)`), and once they
are kept (before the checkpoint is durable) every rank writes them on a thread of its own, through the offline
tool's own plan and writer (`tools/hf/export.py`: the same architecture registry, mapping and safetensors
writer), so a model published here is byte for byte what `convert_checkpoint.py --to hf` writes from that
checkpoint with the same shard size. Each rank writes its share of the safetensors files (those whose bytes it
mostly keeps already), built from the pieces the ranks kept, passed over a gloo group of the export's own
(`hf_staged`); rank 0, once every rank reported through
the store and the checkpoint is published, writes the index and publishes (a failed save's files are removed). A
save whose weights do not fit in what is left of the staging budget (exports falling behind) keeps none: its
export is dropped, never waited for, except the run's last checkpoint's, which is then read back from storage.
Under --save-hf (a file system path, s3:// or msc://; every byte goes through the engine's storage contract,
`datastates.Storage`):

    iter_0000100/           config.json, model-0000k-of-0000n.safetensors, model.safetensors.index.json, tokenizer
    latest                  `iter_0000100`: the newest complete model (replaced in one step, after the model)
    iter_0000200.partial/   an export under way, on a file system (renamed to iter_0000200/ when complete)

A model is complete when its index is there, and the index is written last: on a file system the directory is
written under `.partial`, fsynced and renamed (`Storage.stage` / `commit`); an object store has no rename, so
the model is written in place and the index's PUT publishes it. `latest` names only complete models;
--save-hf-keep-last retires the oldest after the new one is named (its index removed first: out of sight in one
step, then the rest). What a killed export leaves (a `.partial` directory, a model without its index, open
multipart uploads) is removed at the next start (`clean_leftovers`). A failed export is reported as a failed save
(the manager applies --ckpt-on-failure). Nothing here is on the training thread but `submit`, which queues.
"""
from __future__ import annotations

import datetime
import logging
import os
import queue
import re
import threading
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

import torch

from datastates import (DELETING, PARTIAL, CheckpointError, Storage, checkpoint_dir, iteration_of, join_path,
                        normalize_path, storage_for, url_scheme)

from .hf_staged import StagedSource, layout
from .state import saveable_args

log = logging.getLogger(__name__)

POINTER = "latest"
# the bytes of the export's writes in flight at once when it writes from the weights kept: their units stay valid
# until the export ends, so their writes need not wait for each other (each O_DIRECT write waits for the device)
IN_FLIGHT_BYTES = 64 << 20
NICE = 10  # the export thread's niceness: it yields the cores to training, the snapshot and the checkpoint's writes
INDEX = "model.safetensors.index.json"
# a model being written on a file system (under the checkpoints' own PARTIAL suffix) or retired (DELETING, with the
# storage's own suffix after it), and the pointer's temporary
LEFTOVER_RE = re.compile(rf"^(iter_\d{{7,}}({re.escape(PARTIAL)}|{re.escape(DELETING)})(\.[\d.]+)?|{POINTER}\.tmp\.\d+)$")


REFUSED = object()  # `HFPublisher.submit(saved=REFUSED)`: the save was refused at its call on this rank


class _SaveFailed(Exception):
    """The save an export was writing from failed: the export is left out unreported (the save is reported)."""


class ExportDropped(CheckpointError):
    """An export left out because the save kept no weights for it (on at least one rank): not a failed save."""


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


def read_pointer(storage: Storage, root: str) -> str | None:
    """The directory name `latest` gives (None when there is none yet)."""
    try:
        return storage.read_bytes(join_path(root, POINTER)).decode().strip() or None
    except FileNotFoundError:
        return None


def write_pointer(storage: Storage, root: str, name: str) -> None:
    """`latest` replaced in one step, after the model it names is durable."""
    storage.write_bytes(join_path(root, POINTER), f"{name}\n".encode(), replace=True)


def is_model(storage: Storage, path: str) -> bool:
    """Whether the model `path` is complete: its index is written last."""
    return storage.stat(join_path(path, INDEX)) is not None


def published_models(storage: Storage, root: str) -> list[int]:
    """The iterations of the complete models under `root`, oldest first."""
    found = [iteration_of(name) for name in storage.list(root)]
    return sorted(it for it in found if it is not None and is_model(storage, checkpoint_dir(root, it)))


def clean_leftovers(storage: Storage, root: str) -> list[str]:
    """Remove what a killed export or retention left: a `.partial` or `.deleting` directory and the pointer's
    temporary on a file system; on an object store a model without its index and the multipart uploads left open.
    Call before any export of this job starts. What was removed."""
    removed = storage.abort_uploads(root)
    for name in sorted(storage.list(root)):
        path = join_path(root, name)
        unfinished = iteration_of(name) is not None and storage.list(path) and not is_model(storage, path)
        if LEFTOVER_RE.match(name) or unfinished:
            storage.remove(path)
            removed.append(path)
    return removed


class HFPublisher:
    """One rank's exporter: `submit` queues a save, a thread exports them one at a time, in order. Every rank
    writes its share of the safetensors files (`StagedSource.owners`) from the units those hold, assembled
    from the weights the ranks kept (rank 0 also config.json and the tokenizer), as soon as they are kept; each
    reports to rank 0 through the torch.distributed store, and rank 0, once the checkpoint is published, writes
    the index and publishes. `finished` / `drain` hand
    back, on rank 0, what ended (the manager reports failures as failed saves, drops as warnings). Collective at
    construction (the export's gloo group)."""

    def __init__(self, args, rank: int = 0, world_size: int = 1, store=None):
        self.root = normalize_path(args.save_hf) if url_scheme(args.save_hf) else os.path.abspath(args.save_hf)
        self.storage = storage_for(self.root)
        self.interval = args.save_hf_interval or args.save_interval
        self.keep_last = args.save_hf_keep_last
        self.tokenizer = args.save_hf_tokenizer
        self.max_shard_bytes = args.save_hf_max_shard_size
        self.timeout_s = args.ckpt_publish_timeout_s
        self.rank, self.world_size = rank, world_size
        self.store = None if store is None else torch.distributed.PrefixStore("save_hf/", store)
        self.args = args
        # the pieces of the weights pass between ranks here, on the export thread, never on the training thread's group
        self.group = None if world_size == 1 else torch.distributed.new_group(
            backend="gloo", timeout=datetime.timedelta(seconds=self.timeout_s))
        self.submitted: int | None = None  # the newest iteration queued
        if rank == 0:  # before any export of this job: a rank exports only a checkpoint published after this
            for path in clean_leftovers(self.storage, self.root):
                log.info("--save-hf: removed the leftovers of an unfinished export: %s", path)
        # what `latest` names, as this job read or wrote it: a verdict needs no answer from a store that may be down
        self.named = read_pointer(self.storage, self.root) if rank == 0 else None
        # on the checkpoints' own storage (as any rank sees it), each export starts once its save has ended (the
        # storage's bandwidth goes to the checkpoint first); on another, at once
        self.behind = any(self._gather(shares_storage(self.root, args.save)))
        if rank == 0:
            log.info("--save-hf: %s %s: each model is exported %s", self.root,
                     "shares the storage of --save" if self.behind else "is on another storage than --save",
                     "once its checkpoint is saved" if self.behind else "while its checkpoint is saved")
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
        from tools.hf.export import MTP, is_model_tensor
        return lambda name: is_model_tensor(name) and not name.startswith(MTP)

    def newest(self) -> str | None:
        """The model `latest` names (what an evaluation job takes now), on rank 0."""
        return join_path(self.root, self.named) if self.named else None

    def submit(self, iteration: int, ckpt_dir: str, kept=None, last: bool = False, saved=None) -> None:
        """Export the checkpoint `ckpt_dir` of `iteration` once those before it are exported, from the weights its
        save `saved` (a `SaveHandle`; None: published already; REFUSED: refused at its call on this rank) `kept`
        (`SaveHandle.kept`, released once exported): its files are written as soon as every rank's kept weights
        are complete, its model published once the save is. The run's `last` is read back from storage when a
        rank kept none, any other is then dropped. A save that fails is not exported (the manager reports the
        failure). Every rank submits at its save calls, in the same order, refused ones included."""
        self.submitted = iteration
        self._queue.put((iteration, ckpt_dir, kept, last, saved))

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
                if job[2] is not None:
                    job[2].release()
                self._queue.task_done()
            except queue.Empty:
                break
        self._queue.put(None)
        self._thread.join()
        self.storage.close()

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
                iteration, ckpt_dir, kept, last, saved = job
                filled = kept is not None and kept.wait_filled()  # before the save is durable: kept, then written
                final, t0 = checkpoint_dir(self.root, iteration), time.perf_counter()
                written = passed = None
                try:
                    written, passed = self._export(ckpt_dir, final, kept, filled, last, saved)
                    error = None
                except _SaveFailed:  # the manager reports the failed save; nothing of its export is left
                    continue
                except Exception as e:  # noqa: BLE001 (any failure is the save's, reported, never raised here)
                    error = e
                finally:
                    if kept is not None:
                        kept.release()
                now = time.perf_counter()
                if self.rank == 0:  # the job's verdict
                    with self._lock:
                        self._done.append(Exported(iteration, final, error, now, now - t0, self.newest(),
                                                   None if written is None else written[1] - written[0], passed))
            finally:
                self._queue.task_done()

    def _export(self, ckpt_dir: str, final: str, kept, filled: bool, last: bool, saved) -> tuple:
        """The export starts once the save has ended (and only if it held) when the model shares the checkpoint's
        storage (`behind`), else at once; its files are written as soon as every rank's kept weights are complete
        (`filled` on this rank); the model is published (index, rename, `latest`) once the checkpoint is. On rank
        0: (when the export started, when every rank's files were written) (None: it wrote none), and the bytes
        the ranks passed each other (None: read back from storage)."""
        if self.behind:  # its work would slow the checkpoint's writes: it comes after them
            self._outcome(saved)
        began = time.perf_counter()
        iteration = iteration_of(final)
        why = None if filled else ("its save was not due for an export" if kept is None else
                                   kept.why or "its save ended before all its weights were kept")
        reports = self._gather((why, layout(kept, self.rank) if why is None else None,
                                is_model(self.storage, final) if self.rank == 0 else None))
        if reports[0][2]:  # published by an earlier run of this job: kept, named again once the checkpoint is
            self._outcome(saved)
            if self.rank == 0:
                log.info("--save-hf: %s is already published (an earlier run of this job): kept", final)
                self._name(final)
            return None, None
        missing = {r: w for r, (w, _, _) in enumerate(reports) if w is not None}
        if missing:  # nothing to write from before the checkpoint is published: its outcome first
            self._outcome(saved)
            said = "; ".join(f"rank {r}: {w}" for r, w in missing.items())
            if not last:
                raise ExportDropped(f"no weights were kept for it ({said})")
            log.info("--save-hf: the run's last checkpoint is exported from storage (%s)", said)
            source = None
        else:
            source = [piece for _, pieces, _ in reports for piece in pieces]
        plan, shards = self._plan(ckpt_dir, kept, source)
        directory, error = None, None
        try:
            if isinstance(plan.source, StagedSource):
                plan.source.start(plan, shards)  # every rank's sends, before anything that may fail on one rank
            directory = self.storage.stage(final)  # a file system's `.partial` directory, or the final prefix
            self._write_share(plan, shards, directory)
        except Exception as e:  # noqa: BLE001 (reported to rank 0, which fails the export with it)
            error = e
        finally:
            plan.close()  # takes what was sent to this rank and not read: no rank waits on a failed one
        received = plan.source.received if isinstance(plan.source, StagedSource) else None
        try:  # rank 0: every rank's share written (else raises), the bytes passed; others: reported
            passed = self._agree(iteration, error, received)
            if self.rank != 0:
                return None, None
            written = (began, time.perf_counter())
            if saved is not None and saved.join() and saved.error is not None:  # rank 0 publishes the checkpoint
                log.info("--save-hf: the checkpoint of iteration %d failed: the model files written beside it are "
                         "removed", iteration)
                raise _SaveFailed()
            from tools.hf.writer import write_index
            write_index(self.storage, directory, shards)  # last: on an object store, what publishes the model
            for retired in self.storage.commit(directory, final):  # a file system's rename into place
                self.storage.remove(retired)
        except BaseException:
            if directory is not None and self.rank == 0:  # a failed export leaves nothing
                self._discard(directory)
            raise
        self._name(final)
        return written, passed

    def _outcome(self, saved) -> None:
        """Wait for the save (None: published already); _SaveFailed on every rank when it failed on any."""
        ok = saved is None or (saved is not REFUSED and saved.join() and saved.error is None)
        if not all(self._gather(ok)):
            raise _SaveFailed()

    def _name(self, final: str) -> None:
        """Rank 0: `latest` names the model, then --save-hf-keep-last retires the oldest."""
        write_pointer(self.storage, self.root, os.path.basename(final))
        self.named = os.path.basename(final)
        self._retire()

    def _discard(self, directory: str) -> None:
        try:
            self.storage.remove(directory)
        except OSError as e:
            log.warning("--save-hf: cannot remove %s now (%s): the next start does", directory, e)

    def _plan(self, ckpt_dir: str, kept, pieces: list | None) -> tuple:
        """The export's plan (tools/hf/export.py's) and its safetensors files: over the weights the ranks kept
        (`pieces`: every rank's `layout`), or None: over the checkpoint read back from storage (the run's last,
        published). Every rank reaches the same outcome (a gather on the export's group): the plan, or an error
        naming the ranks whose planning failed. The staged plan reads no file of the checkpoint."""
        from tools.hf.export import plan_export, plan_source
        plan, shards, error = None, None, None
        try:
            if pieces is None:
                plan = plan_export("datastates", ckpt_dir, tokenizer=self.tokenizer, drop_mtp=True)
            else:
                plan = plan_source(StagedSource(ckpt_dir, kept, pieces, saveable_args(self.args), self.rank,
                                                self.world_size, self.group), tokenizer=self.tokenizer, drop_mtp=True)
            shards = plan.shards(self.max_shard_bytes)
        except Exception as e:  # noqa: BLE001 (every rank learns it below)
            error = e
        failed = {r: e for r, e in enumerate(self._gather(None if error is None else f"{type(error).__name__}: "
                                                          f"{error}")) if e is not None}
        if failed and plan is not None:
            plan.close()
        if error is not None:
            raise error
        if failed:
            raise CheckpointError("--save-hf: planning the export failed on rank(s) " + "; ".join(
                f"{r}: {e}" for r, e in failed.items()))
        return plan, shards

    def _gather(self, report) -> list:
        """Every rank's `report`, on every rank (the export's group)."""
        if self.world_size == 1:
            return [report]
        out = [None] * self.world_size
        torch.distributed.all_gather_object(out, report, group=self.group)
        return out

    def _write_share(self, plan, shards: list, directory: str) -> None:
        """This rank's safetensors files (and rank 0's config.json and tokenizer), through the offline tool's own
        writer: one mapping, the same bytes (rank 0 indexes them once all are written)."""
        from tools.hf.export import write_metadata, write_tensors
        staged = isinstance(plan.source, StagedSource)
        owners = plan.source.owners if staged else [
            k % self.world_size for k in range(len(shards))]  # read back from storage: any rank reads any unit
        mine = {k for k, r in enumerate(owners) if r == self.rank}
        if mine:  # a unit read back from storage is valid only until the next read: its writes are waited for
            write_tensors(plan, self.storage, directory, shards, mine, in_flight_bytes=IN_FLIGHT_BYTES if staged else 0)
        if self.rank == 0:
            write_metadata(plan, self.storage, directory)

    def _agree(self, iteration: int, error: BaseException | None, received: int | None) -> int | None:
        """Every rank reports its share (and the bytes it `received`) to rank 0 through the store; rank 0 waits for
        all of them (at most --ckpt-publish-timeout-s) and raises, naming the ranks, if any failed or did not
        report; else the bytes received by all (None: read back from storage)."""
        if self.world_size == 1:
            if error is not None:
                raise error
            return received
        key = f"{iteration}/r/"
        self.store.set(f"{key}{self.rank}", f"ok {received}" if error is None else f"{type(error).__name__}: {error}")
        if self.rank != 0:
            return None
        keys = [f"{key}{r}" for r in range(self.world_size)]
        try:
            self.store.wait(keys, datetime.timedelta(seconds=self.timeout_s))
        except RuntimeError:  # the store's timeout
            missing = [r for r, k in enumerate(keys) if not self.store.check([k])]
            raise CheckpointError(f"--save-hf: ranks {missing} did not report their share of the export of "
                                  f"iteration {iteration} within {self.timeout_s:g} s") from None
        reports = {r: self.store.get(k).decode() for r, k in enumerate(keys)}
        for k in keys:
            self.store.delete_key(k)
        failed = {r: why for r, why in reports.items() if not why.startswith("ok ")}
        if failed:
            raise CheckpointError(f"--save-hf: the export of iteration {iteration} failed on rank(s) " + "; ".join(
                f"{r}: {why}" for r, why in failed.items()))
        counts = [why[len("ok "):] for why in reports.values()]
        return None if "None" in counts else sum(int(c) for c in counts)

    def _retire(self) -> None:
        """--save-hf-keep-last K: the oldest models beyond the newest K go (never the one `latest` names): each
        index first (the model out of every reader's sight in one step), then the rest."""
        if not self.keep_last:
            return
        for it in published_models(self.storage, self.root)[:-self.keep_last]:
            path = checkpoint_dir(self.root, it)
            if os.path.basename(path) == self.named:
                continue
            self.storage.remove(join_path(path, INDEX))
            self.storage.remove(path)
            log.info("--save-hf-keep-last %d: removed %s", self.keep_last, path)


def shares_storage(a: str, b: str) -> bool:
    """Whether two roots share one storage's bandwidth: a file system (the device of their nearest existing
    directories), or a bucket (an MSC profile) of one kind of object store."""
    if url_scheme(a) or url_scheme(b):
        return url_scheme(a) == url_scheme(b) and urlsplit(a).netloc == urlsplit(b).netloc
    from ..argument_checks import nearest_existing
    return os.stat(nearest_existing(a)).st_dev == os.stat(nearest_existing(b)).st_dev


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
        from tools.hf.export import TOKENIZER_FILES
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
        from ..argument_checks import unwritable
        why = unwritable("--save-hf", args.save_hf)
        if why:
            return why
    from tools.hf import HFError
    from tools.hf.arch import architecture_of
    try:
        architecture_of(args, "--save-hf", drop_mtp=True)
    except HFError as e:
        return str(e)
    return None
