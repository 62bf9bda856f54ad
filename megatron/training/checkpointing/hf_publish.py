"""--save-hf: each published checkpoint (every --save-hf-interval-th, and the last) also as a transformers model.

Behind the checkpoint: once it is published, every rank exports it on a thread of its own, through the offline
tool's own plan and writer (`tools/hf/export.py`: the same architecture registry, mapping and safetensors
writer), so a model published here is byte for byte what `convert_checkpoint.py --to hf` writes from that
checkpoint with the same shard size. Rank k writes safetensors files k, k + world, ...; rank 0, once every rank
reported through the store, writes config.json, the tokenizer and the index, and publishes. Under --save-hf:

    iter_0000100/           config.json, model-0000k-of-0000n.safetensors, model.safetensors.index.json, tokenizer
    latest                  `iter_0000100`: the newest complete model (replaced by rename, after the model)
    iter_0000200.partial/   an export under way (renamed to iter_0000200/ when complete)

A model directory appears complete or not at all (written under `.partial`, fsynced, renamed); `latest` names
only complete ones; --save-hf-keep-last retires the oldest (renamed to `.deleting`, then removed) after the new
one is named. What a killed export leaves is removed at the next start (`clean_leftovers`). A failed export is
reported as a failed save (the manager applies --ckpt-on-failure). Nothing here is on the training thread but
`submit`, which queues.
"""
from __future__ import annotations

import datetime
import logging
import os
import queue
import re
import shutil
import threading
import time
from dataclasses import dataclass

import torch

from datastates import (DELETING, PARTIAL, CheckpointError, checkpoint_dir, fsync_dir, iteration_of, partial_dir,
                        url_scheme, write_file)

log = logging.getLogger(__name__)

POINTER = "latest"
NICE = 10  # the export thread's niceness: it yields the cores to training, the snapshot and the checkpoint's writes
INDEX = "model.safetensors.index.json"
# a model being written (by every rank, under the checkpoints' own PARTIAL suffix) or retired (DELETING)
LEFTOVER_RE = re.compile(rf"^iter_\d{{7,}}({re.escape(PARTIAL)}(\.\d+)?|{re.escape(DELETING)})$")


@dataclass(frozen=True)
class Exported:
    """An export that finished: `error` None when `path` was published."""
    iteration: int
    path: str
    error: BaseException | None = None
    at: float = 0.0  # time.perf_counter() when it ended
    seconds: float = 0.0  # how long the export itself took (from its start on the export thread)
    newest: str | None = None  # the model `latest` named when it ended (the one that stays newest on a failure)


def read_pointer(root: str) -> str | None:
    """The directory name `latest` gives (None when there is none yet)."""
    try:
        with open(os.path.join(root, POINTER)) as f:
            return f.read().strip() or None
    except FileNotFoundError:
        return None


def write_pointer(root: str, name: str) -> None:
    """`latest` replaced in one rename, after the model it names is durable."""
    tmp = os.path.join(root, f".{POINTER}.tmp.{os.getpid()}")
    write_file(tmp, f"{name}\n".encode(), True)
    os.replace(tmp, os.path.join(root, POINTER))
    fsync_dir(root)


def published_models(root: str) -> list[int]:
    """The iterations of the complete models under `root`, oldest first."""
    found = []
    for name in os.listdir(root):
        it = iteration_of(name)
        if it is not None and os.path.isfile(os.path.join(root, name, INDEX)):
            found.append(it)
    return sorted(found)


def clean_leftovers(root: str) -> list[str]:
    """Remove what a killed export or retention left (`.partial.<pid>`, `.deleting`, the pointer's temporary);
    call before any export of this job starts. The removed paths."""
    removed = []
    for name in sorted(os.listdir(root)):
        if LEFTOVER_RE.match(name) or name.startswith(f".{POINTER}.tmp."):
            path = os.path.join(root, name)
            if os.path.isdir(path):
                shutil.rmtree(path)
            else:
                os.remove(path)
            removed.append(path)
    return removed


class HFPublisher:
    """One rank's exporter: `submit` queues a published checkpoint, a thread exports them one at a time, in order.
    Every rank writes its share of the safetensors files (shard k on rank k mod world), reading only the units of
    the checkpoint those hold; each reports to rank 0 through the torch.distributed store, and rank 0 writes
    config.json, the tokenizer and the index, then publishes. `finished` / `drain` hand back, on rank 0, what
    ended (the manager reports failures as failed saves)."""

    def __init__(self, args, rank: int = 0, world_size: int = 1, store=None):
        self.root = os.path.abspath(args.save_hf)
        self.interval = args.save_hf_interval or args.save_interval
        self.keep_last = args.save_hf_keep_last
        self.tokenizer = args.save_hf_tokenizer
        self.max_shard_bytes = args.save_hf_max_shard_size
        self.timeout_s = args.ckpt_publish_timeout_s
        self.rank, self.world_size = rank, world_size
        self.store = None if store is None else torch.distributed.PrefixStore("save_hf/", store)
        self.submitted: int | None = None  # the newest iteration queued
        if rank == 0:  # before any export of this job: a rank exports only a checkpoint published after this
            os.makedirs(self.root, exist_ok=True)
            for path in clean_leftovers(self.root):
                log.info("--save-hf: removed the leftovers of an unfinished export: %s", path)
        self._queue: queue.Queue = queue.Queue()
        self._done: list[Exported] = []
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="hf-export", daemon=True)
        self._thread.start()

    def due(self, iteration: int) -> bool:
        return iteration % self.interval == 0

    def newest(self) -> str | None:
        """The model `latest` names (what an evaluation job takes now)."""
        name = read_pointer(self.root)
        return os.path.join(self.root, name) if name else None

    def submit(self, iteration: int, ckpt_dir: str) -> None:
        """Export the published checkpoint `ckpt_dir` of `iteration` once those before it are exported."""
        self.submitted = iteration
        self._queue.put((iteration, ckpt_dir))

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
                self._queue.get_nowait()
                self._queue.task_done()
            except queue.Empty:
                break
        self._queue.put(None)
        self._thread.join()

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
                iteration, ckpt_dir = job
                final, t0 = checkpoint_dir(self.root, iteration), time.perf_counter()
                try:
                    self._export(ckpt_dir, final)
                    error = None
                except Exception as e:  # noqa: BLE001 (any failure is the save's, reported, never raised here)
                    error = e
                now = time.perf_counter()
                if self.rank == 0:  # the job's verdict
                    with self._lock:
                        self._done.append(Exported(iteration, final, error, now, now - t0, self.newest()))
            finally:
                self._queue.task_done()

    def _export(self, ckpt_dir: str, final: str) -> None:
        iteration = iteration_of(final)
        published = os.path.isfile(os.path.join(final, INDEX))  # the same answer on every rank: see _agree
        error = None
        if not published:
            try:
                self._write_share(ckpt_dir, partial_dir(final), publish=self.rank == 0)
            except Exception as e:  # noqa: BLE001 (reported to rank 0, which fails the export with it)
                error = e
        try:
            self._agree(iteration, error)  # rank 0: every rank's share written (else raises); others: reported
        except BaseException:
            shutil.rmtree(partial_dir(final), ignore_errors=True)
            raise
        if self.rank != 0:
            return
        if published:
            log.info("--save-hf: %s is already published (an earlier run of this job): kept", final)
        else:
            try:
                fsync_dir(partial_dir(final))
                os.rename(partial_dir(final), final)
            except OSError:
                shutil.rmtree(partial_dir(final), ignore_errors=True)  # a failed export leaves nothing
                raise
            fsync_dir(self.root)
        write_pointer(self.root, os.path.basename(final))
        self._retire()

    def _write_share(self, ckpt_dir: str, directory: str, publish: bool) -> None:
        """This rank's safetensors files (and rank 0's config.json, tokenizer and index), through the offline tool's
        own plan and writer: one mapping, the same bytes."""
        from tools.hf.export import plan_export, write_metadata, write_tensors
        os.makedirs(directory, exist_ok=True)
        plan = plan_export("datastates", ckpt_dir, tokenizer=self.tokenizer, drop_mtp=True)
        try:
            shards = plan.shards(self.max_shard_bytes)
            mine = {k for k in range(len(shards)) if k % self.world_size == self.rank}
            if mine:
                write_tensors(plan, directory, shards, mine)
            if publish:
                write_metadata(plan, directory, shards)
        finally:
            plan.close()

    def _agree(self, iteration: int, error: BaseException | None) -> None:
        """Every rank reports its share to rank 0 through the store; rank 0 waits for all of them (at most
        --ckpt-publish-timeout-s) and raises, naming the ranks, if any failed or did not report."""
        if self.world_size == 1:
            if error is not None:
                raise error
            return
        key = f"{iteration}/r/"
        self.store.set(f"{key}{self.rank}", "ok" if error is None else f"{type(error).__name__}: {error}")
        if self.rank != 0:
            return
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
        failed = {r: why for r, why in reports.items() if why != "ok"}
        if failed:
            raise CheckpointError(f"--save-hf: the export of iteration {iteration} failed on rank(s) " + "; ".join(
                f"{r}: {why}" for r, why in failed.items()))

    def _retire(self) -> None:
        """--save-hf-keep-last K: the oldest models beyond the newest K go (never the one `latest` names)."""
        if not self.keep_last:
            return
        keep = read_pointer(self.root)
        for it in published_models(self.root)[:-self.keep_last]:
            path = checkpoint_dir(self.root, it)
            if os.path.basename(path) == keep:
                continue
            os.rename(path, path + DELETING)
            shutil.rmtree(path + DELETING)
            log.info("--save-hf-keep-last %d: removed %s", self.keep_last, path)


def check_save_hf(args) -> str | None:
    """Why --save-hf cannot run with these flags (None: it can): the offline tool's own refusals of the model,
    and what this first version does not do, said before any work."""
    if url_scheme(args.save_hf) is not None:
        return (f"--save-hf {args.save_hf}: only a file system path is supported for now (s3:// and msc:// are not); "
                "convert from the checkpoint with tools/convert_checkpoint.py --to hf instead")
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
    from tools.hf import HFError
    from tools.hf.arch import architecture_of
    try:
        architecture_of(args, "--save-hf", drop_mtp=True)
    except HFError as e:
        return str(e)
    return None
