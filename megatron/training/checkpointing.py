"""save_checkpoint / load_checkpoint: what a Megatron checkpoint holds, and which saver writes it.

The state is megatron-core's: the model's and the optimizer's `sharded_state_dict()` (ShardedTensors with
global offsets for every TP/PP shard), each rank's RNG states as a ShardedObject on the (pp, tp, dp) grid, and
the common state (args, iteration, LR scheduler, consumed samples, optimizer hyper-parameters).

Formats (`--ckpt-format`):
- ``datastates`` (default): `datastates.CheckpointEngine`. With `--async-ckpt` the save returns at once and the
  training loop calls `fence()` right before the next optimizer step; without it the save waits until the
  checkpoint is durable and published (the synchronous baseline of the same engine).
- ``torch_dist``: megatron-core's `dist_checkpointing.save/load` (synchronous).
- ``torch``: Megatron's legacy per-(tp, pp) `torch.save` of model_optim_rng.pt, written by DP rank 0.

A checkpoint is published (`latest_checkpointed_iteration.txt` rewritten atomically) only once every rank has
finished writing it; the datastates engine does this off the training thread, the baselines after a barrier.
"""
from __future__ import annotations

import json
import logging
import os
import random
import time

import numpy as np
import torch

from megatron.core import parallel_state as ps
from megatron.core.dist_checkpointing.mapping import ShardedObject

from datastates import CheckpointEngine, CheckpointError
from datastates.engine import DEFAULT_READ_THREADS
from datastates import commit
from datastates import format as ds_format
from datastates.local_tier import LocalTier, check_fits, job_id, node_of
from datastates.megatron import COMMON_PREFIX, Common, ReplicaOwnership, load_sharded, make_registry, save_sharded

from .optimizer_state import load_optimizer_state, optimizer_sharded_state_dict

CHECKPOINT_VERSION = 3.0

log = logging.getLogger(__name__)


def print_rank_0(msg: str) -> None:
    """Megatron's name for an INFO line of rank 0 (`datastates.logs` shows rank 0's INFO by default)."""
    log.info(msg)


def print_rank_last(msg: str) -> None:
    """An INFO line of the last rank (where the loss is known with PP), shown whatever rank it is."""
    if not torch.distributed.is_initialized() or \
            torch.distributed.get_rank() == torch.distributed.get_world_size() - 1:
        log.info(msg, extra={"any_rank": True})


# ----- pieces of the state -----

_PRIMITIVES = (str, int, float, bool, type(None))


def _saveable_args(args):
    """The args namespace with only plain values (what a restricted unpickler accepts)."""
    import argparse
    out = argparse.Namespace()
    for k, v in vars(args).items():
        if isinstance(v, _PRIMITIVES) or (isinstance(v, (list, tuple)) and all(isinstance(x, _PRIMITIVES) for x in v)):
            setattr(out, k, v)
    return out


def _tensor_bytes(t: torch.Tensor) -> bytes:
    return t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()


def get_rng_state() -> dict:
    """This rank's RNG states as plain values (torch states as bytes)."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
    tracker = {k: _tensor_bytes(v) for k, v in get_cuda_rng_tracker().get_states().items()
               if isinstance(v, torch.Tensor)}
    return {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
            "torch_rng_state": _tensor_bytes(torch.get_rng_state()),
            "cuda_rng_state": _tensor_bytes(torch.cuda.get_rng_state()) if torch.cuda.is_available() else None,
            "rng_tracker_states": tracker}


def set_rng_state(state: dict) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    def to_t(b):
        return torch.frombuffer(bytearray(b), dtype=torch.uint8).clone()

    random.setstate(state["random_rng_state"])
    np.random.set_state(state["np_rng_state"])
    torch.set_rng_state(to_t(state["torch_rng_state"]))
    if torch.cuda.is_available() and state.get("cuda_rng_state") is not None:
        torch.cuda.set_rng_state(to_t(state["cuda_rng_state"]))
    if state.get("rng_tracker_states"):
        get_cuda_rng_tracker().set_states({k: to_t(v) for k, v in state["rng_tracker_states"].items()})


def rng_sharded_object(state=None) -> ShardedObject:
    """Every rank's RNG state, addressed by its (pp, tp, dp) coordinates."""
    shape = (ps.get_pipeline_model_parallel_world_size(), ps.get_tensor_model_parallel_world_size(),
             ps.get_data_parallel_world_size())
    offset = (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank(),
              ps.get_data_parallel_rank())
    return ShardedObject("rng_state", [state if state is not None else get_rng_state()], shape, offset,
                         replica_id=0)


def sharded_metadata(args) -> dict:
    """What megatron-core's `sharded_state_dict` methods are told (Megatron-LM's keys); saved in the checkpoint
    as `content_metadata`, because a load must build its template in the layout the checkpoint was saved in."""
    return {"distrib_optim_sharding_type":
            "fully_reshardable" if args.dist_ckpt_optim_fully_reshardable else "dp_reshardable",
            "singleton_local_shards": False, "chained_optim_avoid_prefix": True}


def build_state(args, model, optimizer, scheduler, iteration: int, consumed: int, *, fmt: str,
                is_loading: bool = False, metadata: dict | None = None) -> dict:
    """The sharded state dict of one checkpoint (same structure for save and as the load template).

    `metadata`: the layout to build (a load passes the checkpoint's own); default this run's flags."""
    common = (lambda v: Common(v)) if fmt == "datastates" else (lambda v: v)
    metadata = dict(metadata or sharded_metadata(args))
    model_sd = model.sharded_state_dict(metadata=dict(metadata))  # megatron-core adds process groups to it
    state = {
        "args": common(_saveable_args(args)),
        "checkpoint_version": common(CHECKPOINT_VERSION),
        "iteration": common(iteration),
        "train_state": common({"consumed_train_samples": consumed, "iteration": iteration}),
        "content_metadata": common(metadata),
        "model": model_sd,
    }
    if not args.no_save_optim and optimizer is not None:
        state["optimizer"] = optimizer_sharded_state_dict(optimizer, model_sd, dict(metadata), is_loading=is_loading,
                                                          common=fmt == "datastates")
        state["opt_param_scheduler"] = common(scheduler.state_dict())
    if not args.no_save_rng:
        state["rng_state"] = rng_sharded_object()
    return state


def _state_nbytes(state) -> int:
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    tensors = [x.data if isinstance(x, ShardedTensor) else x for x in nested_values(state)]
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


# ----- format detection -----

def detect_format(ckpt_dir: str) -> str:
    meta = os.path.join(ckpt_dir, ds_format.METADATA)
    if os.path.isfile(meta) and os.path.isfile(os.path.join(ckpt_dir, ds_format.data_file(0))):
        return "datastates"  # told apart without reading the index (the engine reads it once, later)
    if os.path.isfile(meta):
        try:
            with open(meta) as f:
                doc = json.load(f)
        except (OSError, ValueError):
            doc = {}
        if "sharded_backend" in doc:
            return "torch_dist"
    if os.path.isdir(ckpt_dir) and any(n.startswith("mp_rank_") for n in os.listdir(ckpt_dir)):
        return "torch"
    raise CheckpointError(f"{ckpt_dir!r} is not a checkpoint this trainer can load (no datastates or torch_dist "
                          "metadata.json, no mp_rank_* directories)")


def _legacy_file(ckpt_dir: str) -> str:
    tp, pp = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
    name = f"mp_rank_{tp:02d}" if ps.get_pipeline_model_parallel_world_size() == 1 else f"mp_rank_{tp:02d}_{pp:03d}"
    return os.path.join(ckpt_dir, name, "model_optim_rng.pt")


# ----- the checkpointer -----

class Checkpointer:
    """Owns the engine and the bookkeeping of in-flight saves; the training loop decides when to call it."""

    def __init__(self, args, model, optimizer, scheduler, ddp=None):
        self.args, self.model, self.optimizer, self.scheduler = args, model, optimizer, scheduler
        self.ddp = ddp  # megatron-core's DistributedDataParallel around `model`, when there is one
        self.rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        self.engine = None
        # replicas are balanced inside the DP group: one small exchange per structure, flat in the world size
        self.ownership = ReplicaOwnership(group=ps.get_data_parallel_group(with_context_parallel=True)
                                          if torch.distributed.is_initialized() else None)
        self.pending: list[tuple[int, object, float]] = []  # (iteration, handle, stall_s)
        self.failures: list[tuple[int, BaseException]] = []  # failed saves, under --ckpt-on-failure stop
        self.records: list[dict] = []
        fmt = args.ckpt_format
        if fmt == "datastates" and (args.save or args.load):
            self.engine = CheckpointEngine(
                host_buffer_bytes=int(args.ckpt_host_buffer_gb * (1 << 30)),
                writer_threads=args.ckpt_writer_threads,
                read_mode=args.ckpt_read_mode, read_threads=args.ckpt_read_threads or DEFAULT_READ_THREADS,
                direct_io=args.ckpt_direct_io, fsync=args.ckpt_fsync,
                keep_last=args.ckpt_keep_last, publish_timeout_s=args.ckpt_publish_timeout_s,
                registry=make_registry(self.ownership))
            if args.save:
                self._clean_leftovers(args.save)
        self.tier: LocalTier | None = None
        self.local_pending: list[tuple[int, object, float]] = []
        if args.non_persistent_save_interval:
            self.tier = self._memory_tier()

    def _memory_tier(self) -> LocalTier:
        """The node-local memory tier (`datastates.local_tier`), after checking that it fits in memory."""
        args = self.args
        world = torch.distributed.get_world_size()
        factor = args.replication_factor if args.replication else 1
        # newest 2 kept + 1 being written, per copy, for every rank of the node: params, two fp32 Adam moments
        # and, with 16-bit params, fp32 main params (an upper bound: the distributed optimizer shards them)
        params = list(self.model.parameters())
        per_copy = sum(p.numel() * p.element_size() for p in params)
        if not args.no_save_optim:
            per_copy += sum(p.numel() for p in params) * 4 * (3 if (args.bf16 or args.fp16) else 2)
        check_fits(args.non_persistent_local_ckpt_dir, 3 * per_copy * factor * node_of(self.rank, world)[1])
        return LocalTier(args.non_persistent_local_ckpt_dir, job_id(args.save), self.rank, world,
                         list(_current_layout()), keep=2, replication_factor=factor,
                         replication_jump=args.replication_jump, timeout_s=args.ckpt_publish_timeout_s,
                         host_buffer_bytes=int(args.ckpt_host_buffer_gb * (1 << 30)),
                         writer_threads=args.ckpt_writer_threads, registry=make_registry(self_contained=True))

    def _clean_leftovers(self, save_dir: str) -> None:
        """Remove what saves killed before publication left behind; one rank, while no one saves."""
        if self.rank == 0:
            for path in commit.clean_stale(save_dir):
                log.info("removed the leftovers of an unfinished checkpoint: %s", path)
        if torch.distributed.is_initialized():
            torch.distributed.barrier()

    # -- save --

    def save(self, iteration: int, consumed: int) -> None:
        args = self.args
        fmt = args.ckpt_format
        ckpt_dir = commit.checkpoint_dir(args.save, iteration)
        t0 = time.perf_counter()
        self._finish_param_gather()
        state = build_state(args, self.model, self.optimizer, self.scheduler, iteration, consumed, fmt=fmt)
        if fmt == "datastates":
            self.agree_on_failures(iteration)
            handle = save_sharded(self.engine, state, ckpt_dir, ownership=self.ownership)
            print_rank_0(f"saving checkpoint at iteration {iteration:8d} to {args.save} in datastates format "
                         f"({'lazy async' if args.async_ckpt else 'sync'})")
            if not args.async_ckpt:
                handle.join()  # synchronous baseline: training stalls until durable and published
            self.pending.append((iteration, handle, time.perf_counter() - t0))
            if not args.async_ckpt:
                self.poll()
                self.agree_on_failures(iteration)
            return
        nbytes = _state_nbytes(state)
        if fmt == "torch_dist":
            from megatron.core import dist_checkpointing
            if self.rank == 0:
                os.makedirs(ckpt_dir, exist_ok=True)
            torch.distributed.barrier()
            dist_checkpointing.save(state, ckpt_dir)
        else:
            legacy = self._legacy_state(state)
            if legacy is not None:
                path = _legacy_file(ckpt_dir)
                os.makedirs(os.path.dirname(path), exist_ok=True)
                torch.save(legacy, path)
                if args.ckpt_fsync:
                    with open(path, "rb") as f:
                        os.fsync(f.fileno())
            else:
                nbytes = 0
        torch.distributed.barrier()
        if self.rank == 0:
            commit.write_latest(args.save, iteration, fsync=args.ckpt_fsync)
        dt = time.perf_counter() - t0
        self._record(iteration, dict(blocking_s=dt, snapshot_s=dt, durable_s=dt, bytes=nbytes), dt)

    def _finish_param_gather(self) -> None:
        """--overlap-param-gather: finish the all-gather of the last step's updated params before saving them.

        With the overlap, megatron-core all-gathers the params a step updated in the next forward pass, so right
        after a step other ranks' slices are stale; a lazy snapshot taken in the background would copy them as
        that forward pass overwrites them. Forcing the gather now (as Megatron-LM does around its saves) makes
        the saved bf16 params those of the saved step, and nothing writes them again before the next
        optimizer step, which is where the fence is."""
        if self.ddp is not None and self.args.overlap_param_gather:
            self.ddp.disable_forward_pre_hook(param_sync=True)
            self.ddp.enable_forward_pre_hook()

    def save_local(self, iteration: int, consumed: int) -> None:
        """A lazy checkpoint of this rank's part to the node-local memory tier (replicated in the background)."""
        t0 = time.perf_counter()
        self._finish_param_gather()
        state = build_state(self.args, self.model, self.optimizer, self.scheduler, iteration, consumed,
                            fmt="datastates")
        handle = save_sharded(self.tier.engine, state, self.tier.path(iteration))
        self.tier.replicate(iteration, handle)
        self.local_pending.append((iteration, handle, time.perf_counter() - t0))

    def _legacy_state(self, sharded):
        """Megatron's legacy checkpoint of this (tp, pp) rank, RNG of every DP rank gathered; None off DP rank 0."""
        rngs = [None] * ps.get_data_parallel_world_size()
        torch.distributed.all_gather_object(rngs, get_rng_state(), group=ps.get_data_parallel_group())
        if ps.get_data_parallel_rank() != 0:
            return None
        state = {k: sharded[k] for k in ("args", "checkpoint_version", "iteration", "train_state")}
        state["model"] = self.model.state_dict()
        if "optimizer" in sharded:
            state["optimizer"] = self.optimizer.state_dict()
            state["opt_param_scheduler"] = self.scheduler.state_dict()
        state["rng_state"] = rngs
        return state

    def fence(self) -> None:
        """Called right before the optimizer step mutates saved state: wait until pending snapshots are taken."""
        self.pending = _fence(self.engine, self.pending)
        self.local_pending = _fence(self.tier.engine if self.tier else None, self.local_pending)

    def poll(self) -> None:
        """Log the saves that finished (non-blocking); a failed one stops training or warns (--ckpt-on-failure).
        A failed memory checkpoint only warns: storage still holds the run."""
        if self.engine is not None and self.pending:
            self.engine.maybe_finalize()
            still = []
            for it, h, stall in self.pending:
                if not h.done():
                    still.append((it, h, stall))
                elif h.error is not None:
                    self._failed(it, h.error)
                else:
                    self._record(it, h.stats, stall)
            self.pending = still
        if self.tier is not None and self.local_pending:
            self.tier.engine.maybe_finalize()
            still = []
            for it, h, stall in self.local_pending:
                if not h.done():
                    still.append((it, h, stall))
                elif h.error is not None:
                    log.warning("rank %d: memory checkpoint of iteration %d failed: %s", self.rank, it, h.error)
                else:
                    self._record(it, h.stats, stall, tier="memory")
            self.local_pending = still

    def _failed(self, iteration: int, error: BaseException) -> None:
        if self.args.ckpt_on_failure == "stop":
            self.failures.append((iteration, error))  # acted on where every rank agrees: agree_on_failures()
            return
        log.warning("rank %d: checkpoint of iteration %d failed, training goes on (--ckpt-on-failure warn); the "
                    "last published checkpoint is still %s: %s", self.rank, iteration,
                    commit.read_latest(self.args.save), error)

    def agree_on_failures(self, iteration: int) -> None:
        """--ckpt-on-failure stop: at a point every rank reaches (each save, the end of training) the ranks agree
        whether any of them has seen a save fail; if one has, every rank stops here, at the same iteration.
        (Ranks learn a failure at different moments; stopping where each learns it would split the job.)"""
        if self.args.ckpt_on_failure != "stop" or self.engine is None:
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

    def _record(self, iteration: int, stats: dict, stall_s: float, tier: str = "storage") -> None:
        rec = dict(iteration=iteration, tier=tier, format=self.args.ckpt_format,
                   mode="async" if self.args.async_ckpt else "sync", stall_ms=stall_s * 1e3,
                   blocking_ms=stats.get("blocking_s", stall_s) * 1e3,
                   snapshot_ms=stats.get("snapshot_s", 0.0) * 1e3, durable_ms=stats.get("durable_s", 0.0) * 1e3,
                   bytes=int(stats.get("bytes", 0)))
        rec["throughput_gbps"] = rec["bytes"] / (rec["durable_ms"] / 1e3) / 1e9 if rec["durable_ms"] > 0 else 0.0
        self.records.append(rec)
        log.info(f"{'memory ' if tier == 'memory' else ''}checkpoint iteration {iteration:8d} | format: {rec['format']} ({rec['mode']}) | "
                 f"blocking ms: {rec['stall_ms']:.2f} | snapshot ms: {rec['snapshot_ms']:.2f} | "
                 f"time to durable ms: {rec['durable_ms']:.2f} | bytes: {rec['bytes']} | "
                 f"throughput GB/s: {rec['throughput_gbps']:.3f}")

    def finalize(self) -> None:
        """Wait until every pending save is durable and published; log them and a cross-rank summary."""
        if self.engine is not None:
            last = max((it for it, _, _ in self.pending), default=-1)
            for _, h, _ in self.pending:
                h.join()
            for _, h, _ in self.local_pending:
                h.join()
            self.poll()
            self.agree_on_failures(last)
        if self.tier is not None:
            self.tier.drain()
        # A safe point for a collective: every rank reaches the end of training.
        storage = [r for r in self.records if r["tier"] == "storage"]
        all_records = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(all_records, storage)
        if self.rank == 0 and storage:
            for i, rec in enumerate(storage):
                per_rank = [r[i] for r in all_records if len(r) > i]
                total = sum(r["bytes"] for r in per_rank)
                stall = max(r["stall_ms"] for r in per_rank)
                durable = max(r["durable_ms"] for r in per_rank)
                log.info(f"checkpoint summary iteration {rec['iteration']:8d} | format: {rec['format']} "
                         f"({rec['mode']}) | max blocking ms over ranks: {stall:.2f} | max time to durable ms: "
                         f"{durable:.2f} | bytes all ranks: {total} | throughput GB/s: "
                         f"{(total / (durable / 1e3) / 1e9) if durable > 0 else 0.0:.3f}")

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None
        if self.tier is not None:
            self.tier.close()

    def remove_memory_tier(self) -> None:
        """After close() on every rank (the caller's barrier): the finished job's memory tier goes."""
        if self.tier is not None:
            self.tier.remove()
            self.tier = None

    # -- load --

    def load(self):
        """Load the latest checkpoint under --load into the model (and optimizer, scheduler, RNG).

        Returns (iteration, consumed_samples); (0, 0) when there is nothing to load."""
        args = self.args
        if args.load is None:
            return 0, 0
        latest = commit.find_latest(args.load)
        iteration, ckpt_dir = latest.iteration, latest.path
        if self.tier is not None:  # the newest checkpoint every rank can load from memory, if newer than storage's
            local = self.tier.choose(iteration if isinstance(iteration, int) else None)
            if local is not None:
                return self._load_sharded(local, "datastates", self.tier.engine, "the memory tier")
        if iteration is None:
            if args.exit_on_missing_checkpoint:
                raise CheckpointError(f"--load {args.load!r}: no checkpoint found")
            log.warning("could not find a checkpoint at %s; training from scratch", args.load)
            return 0, 0
        fmt = detect_format(ckpt_dir)
        if fmt == "torch":
            return self._load_legacy(ckpt_dir, not (args.no_load_optim or args.finetune),
                                     not (args.no_load_rng or args.finetune))
        engine = None
        if fmt == "datastates":
            engine = self.engine or CheckpointEngine(registry=make_registry(self.ownership))
        try:
            return self._load_sharded(ckpt_dir, fmt, engine, args.load)
        finally:
            if engine is not None and engine is not self.engine:
                engine.close()

    def _load_sharded(self, ckpt_dir: str, fmt: str, engine, source: str):
        """Load a datastates (through `engine`) or torch_dist checkpoint directory; (iteration, consumed)."""
        args = self.args
        load_optim = not (args.no_load_optim or args.finetune)
        load_rng = not (args.no_load_rng or args.finetune)
        t0 = time.perf_counter()

        def read(template):
            if engine is not None:
                return load_sharded(engine, template, ckpt_dir)
            from megatron.core import dist_checkpointing
            return dist_checkpointing.load(template, ckpt_dir)

        if args.finetune:  # the weights only: a model-only checkpoint (e.g. from upstream) has nothing else
            model_sd = self.model.sharded_state_dict(metadata=sharded_metadata(args))
            self.model.load_state_dict(read({"model": model_sd})["model"], strict=True)
            print_rank_0(f"successfully loaded the model weights of {ckpt_dir} ({fmt}) for fine-tuning from "
                         f"iteration 0 in {(time.perf_counter() - t0) * 1e3:.1f} ms")
            return 0, 0
        saved = saved_common(ckpt_dir, fmt, engine)
        _require_training_state(ckpt_dir, set(saved), load_optim)
        metadata = saved.get("content_metadata") or sharded_metadata(args)
        if load_optim:
            _require_loadable_optimizer(ckpt_dir, args, saved.get("args"), metadata)
        template_args = _LoadArgs(args, no_save_optim=not load_optim, no_save_rng=True)
        # The RNG states are rank-local (one per (pp, tp, dp) coordinate): they are read in a second step, only
        # when the checkpoint's layout is this run's (see _restore_rng). Everything else reshards.
        state = build_state(template_args, self.model, self.optimizer, self.scheduler, 0, 0, fmt=fmt,
                            is_loading=True, metadata=metadata)
        loaded = read(state)
        self.model.load_state_dict(loaded["model"], strict=True)
        if load_optim:
            load_optimizer_state(self.optimizer, loaded["optimizer"])
            self.scheduler.load_state_dict(loaded["opt_param_scheduler"])
        it = int(loaded["iteration"])
        saved_layout = _layout_of(loaded.get("args"))
        if load_rng:
            self._restore_rng(read, saved_layout, int(loaded["iteration"]))
        if saved_layout is not None and saved_layout != _current_layout():
            print_rank_0(f"resharded checkpoint {ckpt_dir} from {_describe_layout(saved_layout)} to "
                         f"{_describe_layout(_current_layout())}")
        consumed = int(loaded["train_state"]["consumed_train_samples"])
        print_rank_0(f"successfully loaded checkpoint from {source} ({fmt}) at iteration {it} "
                     f"in {(time.perf_counter() - t0) * 1e3:.1f} ms")
        return it, consumed

    def _restore_rng(self, read, saved_layout, iteration: int) -> None:
        """Restore this rank's RNG states when the checkpoint has this run's (tp, pp, dp) layout.

        RNG states are per rank: under another layout there is no saved state that belongs to this rank (and
        another world size may have none at all), so, as Megatron-LM does on a TP/PP change, they are not loaded;
        every rank re-seeds deterministically from --seed and the loaded iteration instead (the same numbers on
        every rerun of the same layout). A checkpoint whose args name no layout is treated as this run's."""
        from .initialize import set_seed
        now = _current_layout()
        if saved_layout is None or saved_layout == now:
            loaded = read({"rng_state": rng_sharded_object()})
            rng = loaded["rng_state"]
            set_rng_state(rng[0] if isinstance(rng, list) else rng)
            return
        seed = self.args.seed + iteration
        print_rank_0(f"NOTICE: the checkpoint was saved with {_describe_layout(saved_layout)}, this run is "
                     f"{_describe_layout(now)}: its per-rank RNG states are not loaded; RNGs re-seeded from "
                     f"--seed + iteration = {seed}")
        set_seed(seed)

    def _load_legacy(self, ckpt_dir, load_optim, load_rng):
        args = self.args
        path = _legacy_file(ckpt_dir)
        if not os.path.isfile(path):
            raise CheckpointError(f"{path!r} is missing: the torch checkpoint was saved with another TP/PP layout")
        state = torch.load(path, map_location="cpu", weights_only=False)
        self.model.load_state_dict(state["model"], strict=True)
        if load_optim:
            self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["opt_param_scheduler"])
        if load_rng:
            rngs = state["rng_state"]
            set_rng_state(rngs[ps.get_data_parallel_rank() % len(rngs)])
        it = 0 if args.finetune else int(state["iteration"])
        consumed = 0 if args.finetune else int(state["train_state"]["consumed_train_samples"])
        print_rank_0(f"successfully loaded checkpoint from {args.load} (torch) at iteration {it}")
        return it, consumed


def saved_common(ckpt_dir: str, fmt: str, engine) -> dict:
    """A sharded checkpoint's common state, top-level names -> values (args and content_metadata read, the rest
    None): what a load must know before it builds its template."""
    wanted = ("args", "content_metadata")
    if fmt == "datastates":
        names = {name[len(COMMON_PREFIX):].split("/")[0] for name in engine.reader(ckpt_dir).global_index()
                 if name.startswith(COMMON_PREFIX)}
        present = [n for n in wanted if n in names]
        values = load_sharded(engine, {n: Common(None) for n in present}, ckpt_dir) if present else {}
        return {n: values.get(n) for n in names}
    from megatron.core import dist_checkpointing
    return dict(dist_checkpointing.load_common_state_dict(ckpt_dir))


def _require_training_state(ckpt_dir: str, names: set[str], load_optim: bool) -> None:
    """A resume needs the iteration and the data position (and the scheduler with the optimizer): a checkpoint
    without them, e.g. the weights megatron-core's `dist_checkpointing.save` wrote from a model, gets a message
    naming the flag that loads it, before anything is read."""
    missing = [n for n in ("iteration", "train_state") if n not in names]
    if missing:
        raise CheckpointError(f"checkpoint {ckpt_dir!r} has no {' and no '.join(missing)}: it holds no training "
                              "state to resume (a model-only checkpoint?); pass --finetune to train from its "
                              "weights starting at iteration 0")
    if load_optim and "opt_param_scheduler" not in names:
        raise CheckpointError(f"checkpoint {ckpt_dir!r} has no optimizer state (no opt_param_scheduler); pass "
                              "--no-load-optim to resume with a fresh optimizer, or --finetune")


def _require_loadable_optimizer(ckpt_dir: str, args, saved_args, metadata: dict) -> None:
    """Refuse, before reading, an optimizer state this run cannot take: another optimizer kind, or the
    distributed optimizer's dp_reshardable layout (flat bucket shards of one TP x PP domain) into another TP/PP."""
    if saved_args is None:
        return
    saved_dist = bool(getattr(saved_args, "use_distributed_optimizer", False))
    if saved_dist != bool(args.use_distributed_optimizer):
        raise CheckpointError(
            f"checkpoint {ckpt_dir!r} was saved {'with' if saved_dist else 'without'} --use-distributed-optimizer "
            f"and this run is {'with' if args.use_distributed_optimizer else 'without'} it: the optimizer states "
            "differ in kind; match the flag, or pass --no-load-optim to start a fresh optimizer")
    saved_layout, now = _layout_of(saved_args), _current_layout()
    if saved_dist and metadata.get("distrib_optim_sharding_type") == "dp_reshardable" and \
            saved_layout is not None and saved_layout[:2] != now[:2]:
        raise CheckpointError(
            f"checkpoint {ckpt_dir!r} holds the distributed optimizer in megatron-core's dp_reshardable layout, "
            f"saved with {_describe_layout(saved_layout)}; it reshards across DP sizes only, and this run is "
            f"{_describe_layout(now)}. Save with --dist-ckpt-optim-fully-reshardable to change TP/PP, or pass "
            "--no-load-optim")


def _fence(engine, pending: list) -> list:
    """Wait until the snapshots of `pending` saves are taken; the wait counts as the newest one's stall."""
    if engine is None or not pending or all(h.snapshot_done for _, h, _ in pending):
        return pending
    t0 = time.perf_counter()
    engine.wait_for_snapshot()
    it, h, stall = pending[-1]
    return pending[:-1] + [(it, h, stall + time.perf_counter() - t0)]


def _current_layout() -> tuple:
    return (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
            ps.get_data_parallel_world_size())


def _layout_of(saved_args):
    """(tp, pp, dp) sizes the checkpoint was saved with, from its args; None when they are not recorded."""
    names = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "data_parallel_size")
    values = tuple(getattr(saved_args, n, None) for n in names)
    return None if any(v is None for v in values) else tuple(int(v) for v in values)


def _describe_layout(layout) -> str:
    return "TP{}xPP{}xDP{}".format(*layout)


class _LoadArgs:
    """args seen through the load flags (what the template must ask for)."""

    def __init__(self, args, **overrides):
        self._args, self._over = args, overrides

    def __getattr__(self, name):
        if name in self.__dict__.get("_over", {}):
            return self._over[name]
        return getattr(self._args, name)


# ----- Megatron-style module API -----

_CHECKPOINTER: Checkpointer | None = None


def get_checkpointer(args=None, model=None, optimizer=None, scheduler=None) -> Checkpointer:
    global _CHECKPOINTER
    if _CHECKPOINTER is None:
        _CHECKPOINTER = Checkpointer(args, model, optimizer, scheduler)
    return _CHECKPOINTER


def save_checkpoint(iteration, model, optimizer, opt_param_scheduler, consumed_samples):
    from .global_vars import get_args
    get_checkpointer(get_args(), model, optimizer, opt_param_scheduler).save(iteration, consumed_samples)


def load_checkpoint(model, optimizer, opt_param_scheduler):
    from .global_vars import get_args
    return get_checkpointer(get_args(), model, optimizer, opt_param_scheduler).load()
