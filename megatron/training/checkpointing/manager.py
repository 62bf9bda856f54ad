"""CheckpointManager: the trainer's one checkpointing object; its lifecycle reads from its methods.

    manager = CheckpointManager(args, model, optimizer, scheduler, ddp=ddp)
    iteration, consumed = manager.load()          the policy of `loading`; memory tier or storage
    every iteration i:
        manager.wait_for_snapshot()               right before optimizer.step(): pending snapshots are taken
        manager.save(i, consumed)                 to storage, in --ckpt-format's format (or save_local: memory);
                                                  with the tier, storage writes from the tier's pages
        manager.maybe_finalize()                  logs the saves that finished; a failed one stops or warns
    manager.wait()                                every save durable and published; a summary over ranks
    manager.close(); manager.remove_memory_tier()

The step names are the engine's (`datastates.CheckpointEngine`), and so are the pending saves: the manager keeps
no list of its own. What it reports of a save (the iteration, the training thread's stall) is read from the
handle the engine returns when it finishes.
"""
from __future__ import annotations

import enum
import logging
import time

import torch

from datastates import (CheckpointError, LocalTier, SaveHandle, SaveStats, check_fits, default_store, job_id, node_of,
                        read_latest)
from datastates.paths import checkpoint_dir, iteration_of
from datastates.megatron import make_registry, save_sharded

from .loading import LoadPolicy
from .formats import Written, format_class, rank_held_bytes, staging_bytes
from .hf_job import REFUSED, ExportDropped
from .hf_publish import Exported, HFPublisher
from .weights_publish import WeightsPublication, shared
from ..fsdp import localized
from .state import build_state, current_layout

log = logging.getLogger(__name__)

STORAGE, MEMORY = "storage", "memory"  # the levels a checkpoint goes to (the `tier` of a record)


class SaveMode(enum.Enum):
    """How a save meets training. Its value is the `mode` of the records and log lines."""
    SYNC = "sync"  # save() returns once the checkpoint is durable and published (the baseline)
    LAZY_ASYNC = "async"  # save() returns at once; copied during the next forward/backward (--async-ckpt)

    @classmethod
    def of(cls, args) -> SaveMode:
        return cls.LAZY_ASYNC if args.async_ckpt else cls.SYNC

    def __str__(self) -> str:
        return "lazy async" if self is SaveMode.LAZY_ASYNC else "sync"


class CheckpointManager:
    """Owns the CheckpointFormat of --ckpt-format and the memory tier; the training loop decides when to call it."""

    def __init__(self, args, model, optimizer, scheduler, ddp=None):
        model = model if isinstance(model, list) or model is None else [model]  # the model chunks
        self.args, self.model, self.optimizer, self.scheduler = args, model, optimizer, scheduler
        self.ddp = ddp if isinstance(ddp, list) or ddp is None else [ddp]  # megatron-core's DDP around each
        self.mode = SaveMode.of(args)
        self.rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        self.checkpoint_format = format_class(args.ckpt_format)(args, model, optimizer, scheduler)
        self.tier: LocalTier | None = self._memory_tier() if args.non_persistent_save_interval else None
        self.failures: list[tuple[int, BaseException]] = []  # failed saves, under --ckpt-on-failure stop
        self.records: list[dict] = []
        # per level, the newest save not finalized yet: the engine finishes saves in the order they were made,
        # so waiting for it waits for all
        self._newest: dict[str, SaveHandle] = {}
        self._outside_engine_s: dict[SaveHandle, float] = {}  # each save's stall outside the engine
        self._published_before_run: int | None = None  # the tracker's iteration at this run's first save
        self._memory_iteration: int | None = None  # the iteration of the newest memory save
        # --save-hf: the ranks export published checkpoints as transformers models, behind training
        self.hf: HFPublisher | None = self._hf_publisher() if getattr(args, "save_hf", None) else None
        self._save_called: dict[int, float] = {}
        # --publish-weights-dir: policy versions for the inference side, from the saves' kept weights
        self.versions = WeightsPublication(args, self.rank) if getattr(args, "publish_weights_dir", None) else None

    def _memory_tier(self) -> LocalTier:
        """The node-local memory tier (`datastates.memory_tier`), after checking that it fits in memory."""
        args = self.args
        world = torch.distributed.get_world_size()
        factor = args.replication_factor if args.replication else 1
        # newest 2 kept + 1 being written + 1 retired but still written to storage from (at most one storage
        # save is in flight on the tier's pages), per copy, for every rank of the node
        per_copy = rank_held_bytes(args, self.model)
        copies = 4 if args.save and args.save_interval else 3
        job, layout = job_id(args.save), list(current_layout())
        check_fits(args.non_persistent_local_ckpt_dir, copies * per_copy * factor * node_of(self.rank, world)[1],
                   job, self.rank, world, layout)
        return LocalTier(args.non_persistent_local_ckpt_dir, job, self.rank, world, layout, keep=2, replication_factor=factor,
                         replication_jump=args.replication_jump, timeout_s=args.ckpt_publish_timeout_s,
                         host_buffer_bytes=staging_bytes(args, self.model),
                         # its snapshot lands in its own pages: it stages objects, loads and a compressed save's tensors
                         stage_ahead=args.ckpt_compress != "off", writer_threads=args.ckpt_writer_threads,
                         registry=make_registry(self_contained=True), compress=args.ckpt_compress)

    def _engines(self):
        """(level, engine) of each level that saves through an engine, storage first."""
        if self.checkpoint_format.engine is not None:
            yield STORAGE, self.checkpoint_format.engine
        if self.tier is not None:
            yield MEMORY, self.tier.engine

    # ----- load -----

    def load(self) -> tuple[int, int]:
        """Load the latest checkpoint under --load (see `loading`); (iteration, consumed samples)."""
        return LoadPolicy(self.args, self.model, self.optimizer, self.scheduler, self.checkpoint_format,
                          self.tier).load()

    # ----- save -----

    def save(self, iteration: int, consumed: int) -> None:
        """Checkpoint `iteration` to --save; in LAZY_ASYNC mode this returns before anything is copied."""
        if not self.records and not self._newest:  # for the message of a failed save (`_failed`)
            try:
                self._published_before_run = read_latest(self.args.save)
            except CheckpointError:  # storage unreachable now: the save itself fails and says so
                self._published_before_run = None
        t0 = time.perf_counter()
        if self.hf is not None:  # for the export's time from the save call to its model published
            self._save_called[iteration] = t0
            if len(self._save_called) > 64:  # saves never exported (between --save-hf-interval's) are dropped
                del self._save_called[min(self._save_called)]
        state = self._state(iteration, consumed, wrap_common=self.checkpoint_format.wraps_common)
        self.agree_on_failures(iteration)
        memory = self._memory_first(iteration, state)
        # --save-hf: the save keeps the model weights it stages for the export (a due or the run's last checkpoint)
        last = iteration >= self.args.train_iters
        keep = None if self.hf is None else self.hf.keep(iteration, last)
        version = None if self.versions is None else self.versions.keep(iteration)  # the same weights
        try:
            started = self.checkpoint_format.save(state, iteration, from_save=memory, keep=keep or version)
        except CheckpointError as e:  # refused at the call (storage unreachable): as a failure found later
            self._failed(iteration, e)
            if keep is not None:  # the ranks whose save started queued its export: this rank joins in dropping it
                self.hf.submit(iteration, checkpoint_dir(self.args.save, iteration), None, last, saved=REFUSED)
            if version is not None:  # and its version
                self.versions.submit(iteration, checkpoint_dir(self.args.save, iteration), None)
            return
        if isinstance(started, Written):
            dt = time.perf_counter() - t0
            self._record(iteration, SaveStats(blocking_s=dt, snapshot_s=dt, durable_s=dt, bytes=started.nbytes), dt)
            return
        kept = shared(started.kept, 2) if keep and version else [started.kept] * 2  # the export's, the version's
        self._in_flight(iteration, started, t0, keep, last, kept[0])
        if version is not None:
            self.versions.submit(iteration, started.path, kept[1])

    def _memory_first(self, iteration: int, state: dict):
        """With the memory tier, the snapshot lands in its pages and storage writes from them: the memory save's
        handle (None: storage copies on its own, when the tier saved this iteration already, e.g. the last one, as
        a second memory save of it would collide with the first; a tier that encodes lends no pages, and the
        storage save then copies on its own by itself)."""
        if self.tier is None or not self.checkpoint_format.writes_from_pages or self._memory_iteration == iteration:
            return None
        self._one_storage_save_on_pages()
        return self._save_memory(iteration, state, time.perf_counter())  # the state's build is storage's

    def _in_flight(self, iteration: int, started, t0: float, keep, last: bool, kept) -> None:
        """A storage save under way: tracked, its export queued; in SYNC mode waited for, finalized and agreed."""
        log.info(f"saving checkpoint at iteration {iteration:8d} to {self.args.save} in "
                 f"{self.checkpoint_format.name} format ({self.mode})")
        if self.mode is SaveMode.SYNC:
            started.join()  # synchronous baseline: training stalls until durable and published
        self._started(STORAGE, started, t0)
        if keep is not None:  # written by the export thread once the weights are kept, published with the save
            self.hf.submit(iteration, started.path, kept, last, saved=started)
        if self.mode is SaveMode.SYNC:
            self.maybe_finalize()
            self.agree_on_failures(iteration)

    def _one_storage_save_on_pages(self) -> None:
        """At most one storage save holds memory-tier pages: a storage save slower than the save interval keeps
        its part's pages alive after retention retires it, so waiting for it here (a stall only when storage
        falls that far behind, as a full staging budget is without the tier) bounds the tier at 4 copies."""
        previous = self._newest.get(STORAGE)
        if previous is not None and not previous.done():
            log.warning(f"storage is slower than --save-interval: waiting for the save of {previous.path} before "
                        f"the next one (its memory-tier pages stay in use until it finishes)")
            previous.join()

    def save_local(self, iteration: int, consumed: int) -> None:
        """A lazy checkpoint of this rank's part to the node-local memory tier (replicated in the background)."""
        t0 = time.perf_counter()
        version = None if self.versions is None else self.versions.keep(iteration)
        handle = self._save_memory(iteration, self._state(iteration, consumed, wrap_common=True), t0, version)
        if version is not None:  # from the weights this snapshot keeps
            self.versions.submit(iteration, handle.path, handle.kept)

    def _save_memory(self, iteration: int, state: dict, t0: float, keep=None) -> SaveHandle:
        """This rank's part of `state` to the memory tier (replicated in the background); the save's handle
        (`keep`: the tensors it keeps, as `CheckpointEngine.save` takes them)."""
        handle = save_sharded(self.tier.engine, state, self.tier.path(iteration), keep=keep)
        self._memory_iteration = iteration
        self.tier.replicate(iteration, handle)
        self._started(MEMORY, handle, t0)
        return handle

    def _state(self, iteration: int, consumed: int, wrap_common: bool) -> dict:
        self._finish_param_gather()
        state = build_state(self.args, self.model, self.optimizer, self.scheduler, iteration, consumed,
                            wrap_common=wrap_common)
        return localized(state) if self.args.use_torch_fsdp2 else state  # FSDP2: each DTensor's own rows

    def _started(self, level: str, handle: SaveHandle, t0: float) -> None:
        """Note the training thread's time outside the engine (building the state, a synchronous
        wait): with the engine's `blocking_s` (its save call and every fence wait) it is the save's stall."""
        self._outside_engine_s[handle] = time.perf_counter() - t0 - handle.stats.blocking_s
        self._newest[level] = handle

    def _finish_param_gather(self) -> None:
        """--overlap-param-gather: finish the all-gather of the last step's updated params before saving them.

        With the overlap, megatron-core all-gathers the params a step updated in the next forward pass, so right
        after a step other ranks' slices are stale; a lazy snapshot taken in the background would copy them as
        that forward pass overwrites them. Forcing the gather now (as Megatron-LM does around its saves) makes
        the saved bf16 params those of the saved step, and nothing writes them again before the next
        optimizer step, which is where `wait_for_snapshot` is."""
        if self.ddp is not None and self.args.overlap_param_gather:
            for ddp in self.ddp:
                ddp.disable_forward_pre_hook(param_sync=True)
                ddp.enable_forward_pre_hook()

    # ----- the engine's steps -----

    def wait_for_snapshot(self) -> None:
        """Called right before the optimizer step mutates saved state: wait until pending snapshots are taken."""
        for _, engine in self._engines():
            engine.wait_for_snapshot()

    def maybe_finalize(self) -> None:
        """Log the saves that finished (non-blocking); a failed one stops training or warns (--ckpt-on-failure).
        A failed memory checkpoint only warns: storage still holds the run."""
        for level, engine in self._engines():
            for handle in engine.maybe_finalize():
                self._finished(level, handle)
        if self.hf is not None:
            for exported in self.hf.finished():
                self._exported(exported)
        if self.versions is not None:
            self.versions.report()

    def _finished(self, level: str, handle: SaveHandle) -> None:
        iteration = iteration_of(handle.path)
        if self._newest.get(level) is handle:
            del self._newest[level]
        outside = self._outside_engine_s.pop(handle, 0.0)
        if handle.error is None:
            stall = outside + handle.stats.blocking_s
            self._record(iteration, handle.stats, stall, level)
        elif level == MEMORY:
            log.warning("rank %d: memory checkpoint of iteration %d failed: %s", self.rank, iteration, handle.error)
        else:
            self._failed(iteration, handle.error)

    def wait(self) -> None:
        """Wait until every pending save is durable and published; log them and a cross-rank summary."""
        newest = self._newest.get(STORAGE)
        last = iteration_of(newest.path) if newest is not None else -1
        for handle in list(self._newest.values()):
            handle.join()
        self.maybe_finalize()
        self._last_export()
        if self.versions is not None:
            self.versions.report(drain=True)
        self.agree_on_failures(last)
        if self.tier is not None:
            self.tier.drain()
        self._log_summary()

    # ----- --save-hf -----

    def _hf_publisher(self) -> HFPublisher:
        world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        return HFPublisher(self.args, self.rank, world, default_store() if world > 1 else None)

    def _last_export(self) -> None:
        """The run's last published checkpoint is exported whatever --save-hf-interval says (read back from storage
        when it was not known to be the last at its save: a stop by signal, time or --exit-interval); every export
        waited for (at the end of training, where the checkpoints are waited for too)."""
        if self.hf is None:
            return
        published = [r["iteration"] for r in self.records if r["tier"] == STORAGE]
        if published and self.hf.submitted != published[-1]:
            self.hf.submit(published[-1], checkpoint_dir(self.args.save, published[-1]), last=True)
        for exported in self.hf.drain():
            self._exported(exported)

    def _exported(self, exported: Exported) -> None:
        called = self._save_called.pop(exported.iteration, None)
        if exported.error is None:
            durable = [r["durable_ms"] for r in self.records if r["iteration"] == exported.iteration and
                       r["tier"] == STORAGE]
            log.info("published the Hugging Face model of iteration %d: %s | export ms: %.2f | files written ms: %s "
                     "| ms from the save call: %s | checkpoint's time to durable ms: %s | bytes passed between "
                     "ranks: %s", exported.iteration, exported.path, exported.seconds * 1e3,
                     "-" if exported.written is None else f"{exported.written * 1e3:.2f}",
                     f"{(exported.at - called) * 1e3:.2f}" if called is not None else "?",
                     f"{durable[-1]:.2f}" if durable else "?", "-" if exported.passed is None else exported.passed)
        elif isinstance(exported.error, ExportDropped):  # exports fell behind: never a failed save
            log.warning("rank %d: the Hugging Face export of iteration %d was dropped, training goes on: %s; %s",
                        self.rank, exported.iteration, exported.error,
                        f"the newest Hugging Face model is still {exported.newest}" if exported.newest else
                        "there is no Hugging Face model yet")
        elif self.args.ckpt_on_failure == "stop":
            self.failures.append((exported.iteration, exported.error))
        else:
            log.warning("rank %d: the Hugging Face export of iteration %d failed, training goes on "
                        "(--ckpt-on-failure warn); the newest Hugging Face model is still %s: %s", self.rank,
                        exported.iteration, exported.newest, exported.error)

    # ----- failures -----

    def _failed(self, iteration: int, error: BaseException) -> None:
        if self.args.ckpt_on_failure == "stop":
            self.failures.append((iteration, error))  # acted on where every rank agrees: agree_on_failures()
            return
        # saves finish in order: the newest one recorded is the last published before this one
        published = [r["iteration"] for r in self.records if r["tier"] == STORAGE]
        log.warning("rank %d: checkpoint of iteration %d failed, training goes on (--ckpt-on-failure warn); the "
                    "last published checkpoint is still %s: %s", self.rank, iteration,
                    published[-1] if published else self._published_before_run, error)

    def agree_on_failures(self, iteration: int) -> None:
        """--ckpt-on-failure stop: at a point every rank reaches (each save, the end of training) the ranks agree
        whether any of them has seen a save fail; if one has, every rank stops here, at the same iteration.
        (Ranks learn a failure at different moments; stopping where each learns it would split the job.)"""
        if self.args.ckpt_on_failure != "stop" or self.checkpoint_format.engine is None:
            return
        seen = torch.tensor([1.0 if self.failures else 0.0], device=getattr(self.args, "device", "cpu"))
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            torch.distributed.all_reduce(seen, op=torch.distributed.ReduceOp.MAX)
        if seen.item() == 0:
            return
        log.error("rank %d: stopping at iteration %d: a checkpoint failed (--ckpt-on-failure stop)", self.rank,
                  iteration)
        if self.failures:
            raise self.failures[0][1]
        raise CheckpointError(f"a checkpoint failed on another rank (see its log); rank {self.rank} stops with it "
                              f"at iteration {iteration}")

    # ----- records -----

    def _record(self, iteration: int, stats: SaveStats, stall_s: float, level: str = STORAGE) -> None:
        rec = dict(iteration=iteration, tier=level, format=self.checkpoint_format.name, mode=self.mode.value,
                   stall_ms=stall_s * 1e3, blocking_ms=stats.blocking_s * 1e3,
                   snapshot_ms=(stats.snapshot_s or 0.0) * 1e3, durable_ms=(stats.durable_s or 0.0) * 1e3,
                   bytes=stats.bytes)
        rec["throughput_gbps"] = rec["bytes"] / (rec["durable_ms"] / 1e3) / 1e9 if rec["durable_ms"] > 0 else 0.0
        self.records.append(rec)
        log.info(f"{'memory ' if level == MEMORY else ''}checkpoint iteration {iteration:8d} | format: "
                 f"{rec['format']} ({rec['mode']}) | stall ms: {rec['stall_ms']:.2f} | snapshot ms: "
                 f"{rec['snapshot_ms']:.2f} | time to durable ms: {rec['durable_ms']:.2f} | bytes: {rec['bytes']} | "
                 f"throughput GB/s: {rec['throughput_gbps']:.3f}")

    def _log_summary(self) -> None:
        """Rank 0 logs each storage checkpoint over all ranks; a collective, at a point every rank reaches."""
        storage = [r for r in self.records if r["tier"] == STORAGE]
        all_records = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(all_records, storage)
        if self.rank != 0:
            return
        for i, rec in enumerate(storage):
            per_rank = [r[i] for r in all_records if len(r) > i]
            total = sum(r["bytes"] for r in per_rank)
            stall = max(r["stall_ms"] for r in per_rank)
            durable = max(r["durable_ms"] for r in per_rank)
            log.info(f"checkpoint summary iteration {rec['iteration']:8d} | format: {rec['format']} "
                     f"({rec['mode']}) | max stall ms over ranks: {stall:.2f} | max time to durable ms: "
                     f"{durable:.2f} | bytes all ranks: {total} | throughput GB/s: "
                     f"{(total / (durable / 1e3) / 1e9) if durable > 0 else 0.0:.3f}")

    # ----- end -----

    def close(self) -> None:
        """After `wait` every failure has been reported; a save failing here was still in flight when training
        ended in an error, which it must not hide: it is logged."""
        try:
            self.checkpoint_format.close()
        except CheckpointError as e:
            log.error("rank %d: a checkpoint still in flight at exit failed: %s", self.rank, e)
        if self.tier is not None:
            self.tier.close()
        if self.hf is not None:
            self.hf.close()
        if self.versions is not None:
            self.versions.close()

    def remove_memory_tier(self) -> None:
        """After close() on every rank (the caller's barrier): the finished job's memory tier goes."""
        if self.tier is not None:
            self.tier.remove()
            self.tier = None
