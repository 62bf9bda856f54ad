"""The checkpointing systems compared side by side, behind one small interface.

Each system saves one rank's share of the state (see common.make_state) and exposes:
  setup(ctx)            once per process (ctx: rank, world, shared objects)
  save(state, path, it) the call the training loop makes; returns when the loop may go on (minus the fence)
  fence()               what the loop must wait for before it mutates the saved state (optimizer step)
  wait()                until the checkpoint is durable (fsynced) and complete; returns extra stats
  poll()                non-blocking progress made once per iteration (megatron-core finalization)
  load(state, path)     restore into `state` in place
  teardown()
Synchronous systems do all the work in save(); fence() and wait() are no-ops for them. After wait(), the
harness fsyncs every file of the checkpoint for every system alike (cheap when already durable), so that
"durable" means the same thing everywhere.
"""
from __future__ import annotations

import os
import time
import warnings

import torch
import torch.distributed as dist

from common import iter_tensors


def _copy_into(dst, src):
    """Copy tensors of src into the matching tensors of dst (nested dicts); replace non-tensor leaves."""
    if isinstance(dst, dict):
        for k in dst:
            if isinstance(dst[k], (dict, list)):
                _copy_into(dst[k], src[k])
            elif isinstance(dst[k], torch.Tensor):
                if src[k] is not dst[k] and src[k].data_ptr() != dst[k].data_ptr():
                    dst[k].copy_(src[k])
            else:
                dst[k] = src[k]
    elif isinstance(dst, list):
        for i in range(len(dst)):
            if isinstance(dst[i], torch.Tensor):
                dst[i].copy_(src[i])
            else:
                _copy_into(dst[i], src[i])


class System:
    name = "base"
    label = "base"
    asynchronous = False

    def setup(self, ctx):
        self.rank, self.world = ctx["rank"], ctx["world"]
        self.ctx = ctx

    def save(self, state, path, it):
        raise NotImplementedError

    def fence(self):
        pass

    def wait(self) -> dict:
        return {}

    def poll(self):
        pass

    def load(self, state, path):
        raise NotImplementedError

    def teardown(self):
        pass


# --------------------------------------------------------------------------------------------------------
class TorchSave(System):
    """Megatron's legacy --ckpt-format torch: one torch.save file per rank, then fsync."""

    name, label = "torch_save", "torch.save (sync)"

    def _file(self, path):
        return os.path.join(path, f"mp_rank_{self.rank:03d}", "model_optim_rng.pt")

    def save(self, state, path, it):
        f = self._file(path)
        os.makedirs(os.path.dirname(f), exist_ok=True)
        with open(f, "wb") as fh:
            torch.save(state, fh)
            fh.flush()
            os.fsync(fh.fileno())

    def load(self, state, path):
        loaded = torch.load(self._file(path), map_location="cpu", weights_only=False)
        _copy_into(state, loaded)


# --------------------------------------------------------------------------------------------------------
class _TorchDistBase(System):
    """megatron-core dist_checkpointing with the torch_dist backend (what Megatron-LM uses by default)."""

    def setup(self, ctx):
        super().setup(ctx)
        from megatron.core import dist_checkpointing as dc  # noqa: F401  (import cost outside the timings)

    def _sharded(self, state):
        """Megatron-style sharded state dict: each rank holds rows of logical tensors sharded along dim 0;
        the small Python objects are per-rank ShardedObjects (like Megatron's RNG state)."""
        from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

        out = {}
        for k, t in iter_tensors(state):
            out[k] = ShardedTensor.from_rank_offsets(k, t, (0, self.rank, self.world), replica_id=0)
        for k in ("iteration", "args"):
            out[k] = ShardedObject(k, state[k], (self.world,), (self.rank,), replica_id=0)
        out["optimizer.step"] = ShardedObject("optimizer.step", state["optimizer"]["step"], (self.world,),
                                              (self.rank,), replica_id=0)
        return out

    def _strategy(self):
        from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy

        return get_default_save_sharded_strategy("torch_dist")

    def load(self, state, path):
        from megatron.core import dist_checkpointing as dc

        sd = self._sharded(state)
        loaded = dc.load(sd, path)
        flat = dict(iter_tensors(state))
        for k, t in flat.items():
            if loaded[k].data_ptr() != t.data_ptr():
                t.copy_(loaded[k])
        state["iteration"], state["args"] = loaded["iteration"], loaded["args"]
        state["optimizer"]["step"] = loaded["optimizer.step"]


class TorchDistSync(_TorchDistBase):
    name, label = "torch_dist_sync", "mcore torch_dist (sync)"

    def save(self, state, path, it):
        from megatron.core import dist_checkpointing as dc

        os.makedirs(path, exist_ok=True)
        dc.save(self._sharded(state), path, sharded_strategy=self._strategy())


class TorchDistAsync(_TorchDistBase):
    """async_sharded_save=True + AsyncCallsQueue, as Megatron-LM --async-save does (forked writer)."""

    name, label, asynchronous = "torch_dist_async", "mcore torch_dist (async)", True

    def setup(self, ctx):
        super().setup(ctx)
        import inspect

        from megatron.core import dist_checkpointing as dc
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

        self.queue = AsyncCallsQueue(persistent=False)
        # megatron-core 0.17+ writes asynchronously through nvidia-resiliency-ext by default ("nvrx"); where that
        # is not installed (it is an optional GPU extra), through its own writer ("mcore"), as upstream lets one
        self.save_kwargs = {}
        if "async_strategy" in inspect.signature(dc.save).parameters:
            try:
                import nvidia_resiliency_ext  # noqa: F401
            except ImportError:
                self.save_kwargs["async_strategy"] = "mcore"

    def save(self, state, path, it):
        from megatron.core import dist_checkpointing as dc

        os.makedirs(path, exist_ok=True)
        req = dc.save(self._sharded(state), path, sharded_strategy=self._strategy(), async_sharded_save=True,
                      **self.save_kwargs)
        self.queue.schedule_async_request(req)

    def poll(self):
        self.queue.maybe_finalize_async_calls(blocking=False)

    def wait(self):
        self.queue.maybe_finalize_async_calls(blocking=True)
        return {}

    def teardown(self):
        self.queue.close()


# --------------------------------------------------------------------------------------------------------
class _DCPBase(System):
    """PyTorch Distributed Checkpoint with its default FileSystemWriter (sync_files=True: fsync per file).
    Keys carry the rank so that each rank's share is saved (plain tensors with equal keys would be deduped
    as replicas)."""

    def _sd(self, state):
        return {f"rank{self.rank}": state}

    def load(self, state, path):
        import torch.distributed.checkpoint as dcp

        sd = self._sd(state)
        dcp.load(sd, checkpoint_id=path)
        _copy_into(state, sd[f"rank{self.rank}"])


class DCPSync(_DCPBase):
    name, label = "dcp_sync", "DCP save (sync)"

    def save(self, state, path, it):
        import torch.distributed.checkpoint as dcp

        dcp.save(self._sd(state), checkpoint_id=path)


# torch 2.11's DefaultStager closes its state-dict stager after each staging, so a second save through it fails
# (KeyError: <class 'type'>); 2.13 keeps it. Before 2.13 each save gets a stager of its own, pinning its staging anew.
STAGER_SERVES_ONE_SAVE = torch.torch_version.TorchVersion(torch.__version__) < (2, 13)


class DCPAsync(_DCPBase):
    """dcp.async_save with a reused DefaultStager: staging in a background thread, waited for right before
    the optimizer step (what torchtitan does with async_with_pinned_mem). Pinned memory is requested;
    torch ignores it (with a warning) when CUDA is absent, so on this machine the staging is pageable, and
    non-blocking copies (which need an accelerator) are requested only when CUDA is present."""

    name, label, asynchronous = "dcp_async", "DCP async_save (staged)", True

    def setup(self, ctx):
        super().setup(ctx)
        self.stager, self.stager_used = self._stager(), False
        self.resp = None

    @staticmethod
    def _stager():
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return DefaultStager(StagingOptions(use_pinned_memory=True, use_shared_memory=False,
                                               use_async_staging=True, use_non_blocking_copy=torch.cuda.is_available()))

    def save(self, state, path, it):
        import torch.distributed.checkpoint as dcp

        if STAGER_SERVES_ONE_SAVE and self.stager_used:  # the previous save's staging is done (fence or wait)
            self.stager.close()
            self.stager = self._stager()
        self.stager_used = True
        self.resp = dcp.async_save(self._sd(state), checkpoint_id=path, async_stager=self.stager)

    def fence(self):
        r = self.resp
        if r is not None and hasattr(r, "staging_completion"):
            r.staging_completion.result()

    def wait(self):
        r = self.resp
        if r is not None:
            (r.upload_completion if hasattr(r, "upload_completion") else r).result()
        self.resp = None
        return {}

    def teardown(self):
        try:
            self.stager.close()
        except Exception:
            pass


# --------------------------------------------------------------------------------------------------------
class _EngineBase(System):
    """This project's engine. Both modes share one CheckpointEngine per process (one staging pool), which is
    how a trainer would use it: staging sized to the state (capped by the budget) and made when the engine
    starts, ready before the first save as it is in a trainer, where building the model takes longer."""

    def setup(self, ctx):
        super().setup(ctx)
        if "engine" not in ctx:
            from datastates import CheckpointEngine, PosixOptions

            budget = int(ctx.get("engine_buffer_bytes", 4 << 30))
            if "state_bytes" in ctx:
                budget = min(budget, ctx["state_bytes"] * 11 // 10 + (64 << 20))
            ctx["engine"] = CheckpointEngine(
                host_buffer_bytes=budget,
                storage=PosixOptions(writer_threads=int(ctx.get("engine_writer_threads", 4)), direct_io="auto",
                                     fsync=True),
                rank=self.rank, world_size=self.world, stage_ahead=True)
            t0 = time.perf_counter()
            ctx["engine"].staging_ready()
            ctx["engine_staging_s"] = time.perf_counter() - t0
        self.eng = ctx["engine"]
        self.handle = None

    def _stats(self):
        st = self.handle.stats.as_dict() if self.handle is not None else {}
        return {f"engine_{k}": v for k, v in st.items() if isinstance(v, (int, float))}

    def load(self, state, path):
        out = self.eng.load(path, template=state)
        if out is not None and out is not state:
            _copy_into(state, out)

    def teardown(self):
        eng = self.ctx.pop("engine", None)
        if eng is not None:
            eng.close()


class EngineSync(_EngineBase):
    name, label = "engine_sync", "this engine (sync)"

    def save(self, state, path, it):
        self.handle = self.eng.save(state, path)
        self.eng.wait()

    def wait(self):
        return self._stats()


class EngineLazy(_EngineBase):
    name, label, asynchronous = "engine_lazy", "this engine (lazy async)", True

    def save(self, state, path, it):
        self.handle = self.eng.save(state, path)

    def fence(self):
        self.eng.wait_for_snapshot()

    def wait(self):
        self.eng.wait()
        return self._stats()


REGISTRY = {c.name: c for c in (TorchSave, TorchDistSync, TorchDistAsync, DCPSync, DCPAsync, EngineSync,
                                EngineLazy)}
DEFAULT_SYSTEMS = list(REGISTRY)


def available(names, log=print):
    """The systems among names whose dependencies import; the others are reported and skipped."""
    ok = []
    for n in names:
        try:
            if n.startswith("engine"):
                from datastates import CheckpointEngine  # noqa: F401
            elif n.startswith("torch_dist"):
                from megatron.core import dist_checkpointing  # noqa: F401
            ok.append(n)
        except Exception as e:  # the engine may not exist yet in a fresh tree
            log(f"skipping {n}: {type(e).__name__}: {e}")
    return ok


def barrier():
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
