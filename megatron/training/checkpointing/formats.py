"""One CheckpointFormat per --ckpt-format, behind one small interface (save, read, the common state, format
detection): the manager and the load policy never ask which format they hold, and adding a format means adding a
CheckpointFormat to `FORMATS`.

- ``datastates`` (default): `datastates.CheckpointEngine`, which saves in the background and keeps the pending
  saves; the manager's mode decides whether a save is waited for at once.
- ``torch_dist``: megatron-core's `dist_checkpointing.save/load` (synchronous), on a file system or on msc://
  through megatron-core's own multi-storage-client support.
- ``torch``: Megatron's legacy per-(tp, pp) `torch.save` of model_optim_rng.pt, written by DP rank 0.
- ``torch_dcp``: upstream's plain DCP checkpoint of an FSDP2 run, loaded only (found by its files).

A checkpoint is published (`latest_checkpointed_iteration.txt` rewritten atomically) only once every rank has
finished writing it; the engine does this off the training thread, the synchronous formats after a barrier.
"""
from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
from typing import ClassVar, NamedTuple

import torch

from megatron.core import parallel_state as ps

from datastates import (DEFAULT_READ_THREADS, CheckpointEngine, CheckpointError, CheckpointReader, Exchange,
                        LoadStats, SaveHandle, Storage, clean_leftovers, holds_dcp, holds_legacy, node_of, storage_for,
                        write_latest)
from datastates.paths import METADATA, checkpoint_dir, data_file, join as join_path, scheme as url_scheme
from datastates.megatron import COMMON_PREFIX, Common, ReplicaOwnership, load_sharded, make_registry, save_sharded

from ..fsdp import localized, with_dtensors
from ..virtual_pipeline import chunk_keys
from .hf_ownership import FileAlignedWriters
from .state import get_rng_state, saved_bytes_bound, state_nbytes

log = logging.getLogger(__name__)


class Written(NamedTuple):
    """A save that was durable and published when `CheckpointFormat.save` returned: `nbytes` of this rank written."""
    nbytes: int


class CheckpointFormat:
    """Writes and reads checkpoints of one format (`name`, the `--ckpt-format` value)."""

    name: ClassVar[str]
    wraps_common: ClassVar[bool] = False  # whether the state's plain values go in as `Common` (see build_state)
    writes_from_pages: ClassVar[bool] = False  # whether `save` writes from the memory tier's save of the state
    engine: CheckpointEngine | None = None  # where the pending saves are, for a format that saves in the background

    def __init__(self, args, model, optimizer, scheduler):
        self.args, self.model, self.optimizer, self.scheduler = args, model, optimizer, scheduler

    @classmethod
    def holds(cls, ckpt_dir: str) -> bool:
        """Whether `ckpt_dir` is a checkpoint of this format (told without reading its tensors)."""
        raise NotImplementedError

    @classmethod
    def for_loading(cls, args, model, optimizer, scheduler, root: str) -> CheckpointFormat:
        """A format that only reads the save root `root` (--load or --pretrained-checkpoint: a checkpoint of
        another format than this run's --ckpt-format, or on another storage than --save's)."""
        return cls(args, model, optimizer, scheduler)

    def reads(self, ckpt_dir: str) -> bool:
        """Whether this format's readers reach `ckpt_dir` (whatever storage its path names, unless it has an
        engine bound to one)."""
        return True

    @classmethod
    def alone(cls) -> CheckpointFormat:
        """A reader of the common state for one process, before the distributed start (--use-checkpoint-args)."""
        return cls(None, None, None, None)

    def save(self, state: dict, iteration: int, from_save: SaveHandle | None = None,
             keep=None) -> SaveHandle | Written:
        """Save `state` as checkpoint `iteration` under --save: the engine's handle when the save goes on in
        the background, else `Written` once it is durable and published. `from_save`: the memory tier's save
        of the same state, to write from (given only to a format that `writes_from_pages`); `keep`: the tensors
        (by name) the save keeps past itself (`SaveHandle.kept`; given only under --save-hf, datastates only)."""
        nbytes = self.write(state, checkpoint_dir(self.args.save, iteration))
        torch.distributed.barrier()
        if torch.distributed.get_rank() == 0:
            write_latest(self.args.save, iteration, fsync=self.args.ckpt_fsync)
        return Written(nbytes)

    def write(self, state: dict, ckpt_dir: str) -> int:
        """A synchronous format's files of this rank; the bytes written."""
        raise NotImplementedError

    def load(self, loader, ckpt_dir: str, source: str) -> tuple[int, int]:
        """Load `ckpt_dir` through `loader` (the load policy); (iteration, consumed samples)."""
        return loader.load_sharded(self, ckpt_dir, source)

    def read(self, template: dict, ckpt_dir: str) -> dict:
        """The sharded state of `ckpt_dir` that `template` asks for, in this run's layout."""
        raise NotImplementedError

    def saved_common(self, ckpt_dir: str) -> dict:
        """The checkpoint's common state, top-level names -> values (at least args and content_metadata read, and
        the keys under the optimizer's entry)."""
        raise NotImplementedError

    def saved_optimizer(self, ckpt_dir: str) -> dict:
        """The plain values of the checkpoint's optimizer entry (param groups, steps), as saved."""
        return self.saved_common(ckpt_dir)["optimizer"]

    def read_stats(self, ckpt_dir: str) -> LoadStats | None:
        """What this rank read of `ckpt_dir` from storage and passed between ranks, where the format counts it."""
        return None

    def close(self) -> None:
        """Finish every pending save (raising a failure not yet seen) and release what the format holds."""


class DatastatesFormat(CheckpointFormat):
    name = "datastates"
    wraps_common = True
    writes_from_pages = True  # one copy for both levels: the tier's pages are the snapshot

    def __init__(self, args, model, optimizer, scheduler, *, engine: CheckpointEngine | None = None,
                 clean_leftovers: bool = True, root: str | None = None):
        """`engine`: one owned elsewhere to read through (the memory tier's, whose ranks each read their own
        node's files; a lone reader's), which never exchanges; else one of --ckpt-* is built on the storage of
        `root` (default --save, else --load)."""
        super().__init__(args, model, optimizer, scheduler)
        self.may_exchange = engine is None
        # replicas are balanced inside the DP group: one small exchange per structure, flat in the world size
        group = ps.get_data_parallel_group(with_context_parallel=True) if torch.distributed.is_initialized() else None
        self.engine = engine
        self.root = root or (args.save or args.load if args else None)
        # --save-hf: a replicated weight written where its Hugging Face file is (nothing passes between replicas)
        prefer = FileAlignedWriters(args, group) if group is not None and getattr(args, "save_hf", None) and \
            self.root == args.save else None
        self.ownership = ReplicaOwnership(group=group, prefer=prefer)
        if engine is None and self.root:
            self.engine = _engine(args, self.ownership, self.root, model)
            if self.root == args.save and clean_leftovers:
                _clean_leftovers(args.save, self.engine.storage)

    @classmethod
    def for_loading(cls, args, model, optimizer, scheduler, root: str) -> CheckpointFormat:
        return cls(args, model, optimizer, scheduler, clean_leftovers=False, root=root)

    def reads(self, ckpt_dir: str) -> bool:
        return self.root is None or storage_of(ckpt_dir) == storage_of(self.root)

    @classmethod
    def alone(cls) -> CheckpointFormat:
        return cls(None, None, None, None,
                   engine=CheckpointEngine(rank=0, world_size=1, registry=make_registry(self_contained=True),
                                           stage_ahead=False))  # a few reads: its slots made as they are taken

    @classmethod
    def holds(cls, ckpt_dir: str) -> bool:  # told apart without reading the index (the engine reads it once, later)
        storage = storage_for(ckpt_dir)
        return storage.exists(join_path(ckpt_dir, METADATA)) and \
            storage.exists(join_path(ckpt_dir, data_file(0)))

    def save(self, state: dict, iteration: int, from_save: SaveHandle | None = None, keep=None) -> SaveHandle:
        return save_sharded(self.engine, state, checkpoint_dir(self.args.save, iteration),
                            ownership=self.ownership, from_save=from_save, keep=keep)

    def read(self, template: dict, ckpt_dir: str) -> dict:
        if self.args is not None and self.args.use_torch_fsdp2:  # each DTensor's rows, read in place
            return with_dtensors(load_sharded(self.engine, localized(template), ckpt_dir, self._exchange(ckpt_dir)),
                                 template)
        return load_sharded(self.engine, template, ckpt_dir, self._exchange(ckpt_dir))

    def read_stats(self, ckpt_dir: str) -> LoadStats:
        return self.engine.checkpoint(ckpt_dir).stats

    def _exchange(self, ckpt_dir: str) -> Exchange | None:
        """--ckpt-fully-parallel-load: by default on for object stores, off on file systems (docs/architecture.md,
        "Read once, pass on"). Within the DP group, where the save spread the replicas: what the ranks agree on
        grows with DP, not with the world."""
        if not (self.may_exchange and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1):
            return None
        on = self.args.ckpt_fully_parallel_load
        if on is None:
            on = url_scheme(ckpt_dir) is not None
        return Exchange(self.ownership.group, self.args.ckpt_publish_timeout_s) if on else None

    def saved_common(self, ckpt_dir: str) -> dict:
        wanted = ("args", "content_metadata")
        paths = [name[len(COMMON_PREFIX):].split("/") for name in self.engine.checkpoint(ckpt_dir).global_index()
                 if name.startswith(COMMON_PREFIX)]
        names = {p[0] for p in paths}
        present = [n for n in wanted if n in names]
        values = load_sharded(self.engine, {n: Common(None) for n in present}, ckpt_dir,
                              self._exchange(ckpt_dir)) if present else {}
        values["optimizer"] = {p[1] for p in paths if p[0] == "optimizer" and len(p) > 1}
        return {n: values.get(n) for n in names}

    def saved_optimizer(self, ckpt_dir: str) -> dict:
        return CheckpointReader(self.engine.checkpoint(ckpt_dir)).common()["optimizer"]

    def close(self) -> None:
        if self.engine is not None:
            engine, self.engine = self.engine, None
            engine.close()


def mcore_msc_missing() -> str | None:
    """Why the installed megatron-core cannot save and load torch_dist on msc:// (None: it can). Told by what it
    has, not by its version: its MSC switch (`megatron.core.msc_utils.MultiStorageClientFeature`) with
    multi-storage-client importable to it, and a torch_dist strategy that consults that switch."""
    try:
        from megatron.core import msc_utils
    except ImportError as e:
        return f"this megatron-core has no megatron.core.msc_utils ({e})"
    if not hasattr(msc_utils, "MultiStorageClientFeature"):
        return "this megatron-core's msc_utils has no MultiStorageClientFeature"
    if getattr(msc_utils, "msc", None) is None:
        return "megatron-core cannot import multistorageclient (pip install multi-storage-client)"
    try:
        from megatron.core.dist_checkpointing.strategies import torch as strategies
    except ImportError as e:
        return f"megatron-core's torch_dist strategy does not import ({e})"
    if not hasattr(strategies, "MultiStorageClientFeature"):
        return "this megatron-core's torch_dist strategy does not write through multi-storage-client"
    return None


def disable_mcore_msc() -> None:
    """--disable-msc, as upstream: megatron-core's MSC switch off, so that no path goes through multi-storage-client
    (megatron-core 0.16 turns it on whenever the package is installed)."""
    try:
        from megatron.core.msc_utils import MultiStorageClientFeature
    except ImportError:
        return
    MultiStorageClientFeature.disable()


@contextlib.contextmanager
def _through_msc(path: str):
    """megatron-core's MSC switch on while it reads or writes `path`, an msc:// URL, and back as it was after.

    The switch is one global of megatron-core, and it sends every path through MSC, local ones too; 0.16
    turns it on whenever multi-storage-client is installed, 0.19 leaves it off until upstream's --enable-msc
    turns it on. Scoped to msc:// paths, it leaves local torch_dist saves and loads as each release does them.
    (--disable-msc refuses msc:// paths before any work: argument_checks.)"""
    if url_scheme(path) != "msc":
        yield
        return
    why = mcore_msc_missing()
    if why:
        raise CheckpointError(f"{path!r}: torch_dist on msc:// needs megatron-core's multi-storage-client "
                              f"support: {why}")
    from megatron.core.msc_utils import MultiStorageClientFeature as feature
    was = feature.is_enabled()  # its package is importable (checked above): the switch itself
    feature.enable()
    try:
        yield
    finally:
        if not was:
            feature.disable()


class TorchDistFormat(CheckpointFormat):
    """megatron-core's dist_checkpointing, on a file system or, through megatron-core's own multi-storage-client
    support, on msc:// (`_through_msc`); the tracker and format detection go through `storage_for` as for
    every format."""
    name = "torch_dist"
    _save_strategy = None  # built at the first save (the cached plan lives in it)

    @classmethod
    def holds(cls, ckpt_dir: str) -> bool:
        try:
            return "sharded_backend" in json.loads(storage_for(ckpt_dir).read_bytes(join_path(ckpt_dir, METADATA)))
        except (OSError, ValueError):
            return False

    def write(self, state: dict, ckpt_dir: str) -> int:
        """megatron-core's save, with upstream's strategy flags: --ckpt-fully-parallel-save spreads the replicated
        state over the DP ranks, --ckpt-assume-constant-structure reuses the save plan."""
        from megatron.core import dist_checkpointing
        from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
        from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper
        nbytes = state_nbytes(state)
        if torch.distributed.get_rank() == 0 and url_scheme(ckpt_dir) is None:  # an object store has no dirs
            os.makedirs(ckpt_dir, exist_ok=True)
        torch.distributed.barrier()
        if self._save_strategy is None:
            strategy = get_default_save_sharded_strategy()
            strategy.use_cached_ckpt_structure = self.args.ckpt_assume_constant_structure
            if self.args.ckpt_fully_parallel_save:
                strategy = FullyParallelSaveStrategyWrapper(strategy, ps.get_data_parallel_group(
                    with_context_parallel=True), self.args.ckpt_assume_constant_structure)
            self._save_strategy = strategy
        with _through_msc(ckpt_dir):
            dist_checkpointing.save(state, ckpt_dir, self._save_strategy)
        return nbytes

    def read(self, template: dict, ckpt_dir: str) -> dict:
        """megatron-core's load; --ckpt-fully-parallel-load reads each replica once in the DP group and exchanges
        it; --dist-ckpt-strictness decides about entries the model lacks (missing ones always fail here)."""
        from megatron.core import dist_checkpointing
        from megatron.core.dist_checkpointing.serialization import get_default_load_sharded_strategy
        from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelLoadStrategyWrapper
        with _through_msc(ckpt_dir):
            strategy = None
            if self.args.ckpt_fully_parallel_load:
                strategy = FullyParallelLoadStrategyWrapper(get_default_load_sharded_strategy(ckpt_dir),
                                                            ps.get_data_parallel_group(with_context_parallel=True),
                                                            exchange_algo="gather_object")
            loaded = dist_checkpointing.load(template, ckpt_dir, strategy, strict=self.args.dist_ckpt_strictness)
        return loaded[0] if isinstance(loaded, tuple) else loaded

    def saved_common(self, ckpt_dir: str) -> dict:
        from megatron.core import dist_checkpointing
        with _through_msc(ckpt_dir):
            return dict(dist_checkpointing.load_common_state_dict(ckpt_dir))


class TorchFormat(CheckpointFormat):
    """Megatron's legacy format: one `torch.save` per (tp, pp), every DP rank's RNG gathered to DP rank 0."""
    name = "torch"

    @classmethod
    def holds(cls, ckpt_dir: str) -> bool:
        return holds_legacy(storage_for(ckpt_dir), ckpt_dir)

    def write(self, state: dict, ckpt_dir: str) -> int:
        nbytes = state_nbytes(state)
        legacy = self._legacy_state(state)
        if legacy is None:
            return 0
        path = _legacy_file(ckpt_dir)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        torch.save(legacy, path)
        if self.args.ckpt_fsync:
            with open(path, "rb") as f:
                os.fsync(f.fileno())
        return nbytes

    def _legacy_state(self, sharded):
        """Megatron's legacy checkpoint of this (tp, pp) rank, RNG of every DP rank gathered; None off DP rank 0."""
        rngs = [None] * ps.get_data_parallel_world_size()
        torch.distributed.all_gather_object(rngs, get_rng_state(), group=ps.get_data_parallel_group())
        if ps.get_data_parallel_rank() != 0:
            return None
        state = {k: sharded[k] for k in ("args", "checkpoint_version", "iteration", "train_state")}
        state.update({key: chunk.state_dict() for key, chunk in zip(chunk_keys(self.model), self.model)})
        if "optimizer" in sharded:
            state["optimizer"] = self.optimizer.state_dict()
            state["opt_param_scheduler"] = self.scheduler.state_dict()
        state["rng_state"] = rngs
        return state

    def saved_common(self, ckpt_dir: str) -> dict:
        """Every (tp, pp) file holds the same common state: the first one's, read whole."""
        first = sorted(n for n in os.listdir(ckpt_dir) if n.startswith("mp_rank_"))[0]
        state = torch.load(os.path.join(ckpt_dir, first, "model_optim_rng.pt"), map_location="cpu",
                           weights_only=False)
        return {k: v for k, v in state.items() if k not in ("model", "optimizer", "rng_state")}

    def load(self, loader, ckpt_dir: str, source: str) -> tuple[int, int]:
        path = _legacy_file(ckpt_dir)
        if not os.path.isfile(path):
            raise CheckpointError(f"{path!r} is missing: the torch checkpoint was saved with another TP/PP layout")
        return loader.load_whole(torch.load(path, map_location="cpu", weights_only=False), source)


class TorchDcpFormat(CheckpointFormat):
    """Upstream's torch_dcp (an `--use-torch-fsdp2` run's plain DCP checkpoint), read only: `torch_dcp_load`. This
    trainer saves FSDP2 runs in datastates; tools/convert_checkpoint.py writes torch_dcp."""
    name = "torch_dcp"

    @classmethod
    def holds(cls, ckpt_dir: str) -> bool:
        return holds_dcp(storage_for(ckpt_dir), ckpt_dir)

    def load(self, loader, ckpt_dir: str, source: str) -> tuple[int, int]:
        from .torch_dcp_load import load
        return load(self.args, self.model, self.optimizer, self.scheduler, ckpt_dir)

    def saved_common(self, ckpt_dir: str) -> dict:
        """args (as plain values) and iteration: what --use-checkpoint-args reads."""
        from .torch_dcp import plain_args, read_objects
        saved = read_objects(ckpt_dir, ("args", "iteration"))
        return {**saved, "args": plain_args(saved["args"])}


class FsdpDtensorFormat(TorchDcpFormat):
    """Upstream's fsdp_dtensor (a `--use-megatron-fsdp` run's DCP checkpoint, its model under `model.module.`):
    told apart from torch_dcp by its keys; --load refuses it naming the conversion that reads it (its layout, fc1
    split in halves and Adam's states by name, is read model-free by tools/convert_checkpoint.py)."""
    name = "fsdp_dtensor"

    @classmethod
    def holds(cls, ckpt_dir: str) -> bool:
        if not holds_dcp(storage_for(ckpt_dir), ckpt_dir):
            return False
        from torch.distributed.checkpoint import FileSystemReader
        keys = FileSystemReader(ckpt_dir).read_metadata().state_dict_metadata
        return any(k.startswith("model.module.") for k in keys)

    def load(self, loader, ckpt_dir: str, source: str) -> tuple[int, int]:
        raise CheckpointError(f"{ckpt_dir!r} is upstream's fsdp_dtensor (Megatron-FSDP's checkpoint), which --load "
                              "does not read: convert it first with tools/convert_checkpoint.py --from fsdp_dtensor "
                              "--to datastates, which any layout loads (docs/fsdp.md)")


# in the order `detect` asks (fsdp_dtensor before torch_dcp: both are plain DCP)
FORMATS: tuple[type[CheckpointFormat], ...] = (DatastatesFormat, TorchDistFormat, TorchFormat, FsdpDtensorFormat,
                                               TorchDcpFormat)


def format_class(name: str) -> type[CheckpointFormat]:
    """The CheckpointFormat of --ckpt-format `name`."""
    for cls in FORMATS:
        if cls.name == name:
            return cls
    raise ValueError(f"--ckpt-format {name!r}: no such format (one of {', '.join(c.name for c in FORMATS)})")


def detect(ckpt_dir: str) -> type[CheckpointFormat]:
    """The CheckpointFormat of the checkpoint at `ckpt_dir`."""
    for cls in FORMATS:
        if cls.holds(ckpt_dir):
            return cls
    raise CheckpointError(f"{ckpt_dir!r} is not a checkpoint this trainer can load (no datastates or torch_dist "
                          "metadata.json, no mp_rank_* directories, no DCP .metadata)")


def _legacy_file(ckpt_dir: str) -> str:
    tp, pp = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
    name = f"mp_rank_{tp:02d}" if ps.get_pipeline_model_parallel_world_size() == 1 else f"mp_rank_{tp:02d}_{pp:03d}"
    return os.path.join(ckpt_dir, name, "model_optim_rng.pt")


def storage_of(path: str) -> tuple[str, str] | None:
    """Which storage `path` is on: None for the file system, else its scheme and, for msc://, the profile (which
    has its own endpoint); every s3:// bucket is reached through one client."""
    scheme = url_scheme(path)
    return (scheme, path.split("://", 1)[1].split("/")[0] if scheme == "msc" else "") if scheme else None


DEFAULT_STAGING = 4 << 30  # an engine that only reads (no model to size it by), when --ckpt-host-buffer-gb is unset
HOST_SHARE = 0.5  # of the node's available memory at start, split over its ranks: the most staging takes unasked


def rank_share_bytes(args, model: list) -> int:
    """What this rank's storage save writes, about: its model chunk's state (`saved_bytes_bound`) over the DP
    group, which shards the distributed optimizer's state and spreads the replicas (ReplicaOwnership)."""
    return -(-saved_bytes_bound(args, model) // _dp_shards())


def rank_held_bytes(args, model: list) -> int:
    """What this rank holds of a checkpoint, at most: a memory-tier part (self-contained: every replica it holds),
    its model chunk's weights and its optimizer state, a DP shard of it with the distributed optimizer."""
    weights = sum(p.numel() * p.element_size() for chunk in model for p in chunk.parameters())
    optimizer = saved_bytes_bound(args, model) - weights
    return weights + -(-optimizer // (_dp_shards() if args.use_distributed_optimizer else 1))


def _dp_shards() -> int:
    """The fewest ranks a DP shard is spread over: the data-parallel size, or the experts' when smaller."""
    if not torch.distributed.is_initialized():
        return 1
    return min(ps.get_data_parallel_world_size(), ps.get_expert_data_parallel_world_size())


def staging_bytes(args, model: list | None) -> int:
    """One engine's host staging: all that this rank's save writes (its share of the state, the replicas spread
    over the DP group; a tenth and 64 MiB more for packing chunks into slots and for the objects), so that a
    snapshot never waits on storage. Without --ckpt-host-buffer-gb it is bounded by HOST_SHARE of the node's
    available memory over the ranks on the node; with it, by the flag. Smaller than the save, a NOTICE says what
    that costs. Made when the engine starts (`CheckpointEngine(stage_ahead=)`)."""
    cap = None if args.ckpt_host_buffer_gb is None else int(args.ckpt_host_buffer_gb * (1 << 30))
    if model is None:
        return cap or DEFAULT_STAGING
    want = rank_share_bytes(args, model) * 11 // 10 + (64 << 20)
    bound, why = (cap, "--ckpt-host-buffer-gb") if cap is not None else _host_share()
    if bound < want:
        _notice(f"NOTICE: host staging is {bound / 2**30:.2f} GiB per rank ({why}) where this rank's checkpoint "
                f"needs {want / 2**30:.2f} GiB: each snapshot copies the rest only as storage frees staging, so "
                "training can stall on storage before the next optimizer step (docs/sizing.md)")
    return min(bound, want)


def _host_share() -> tuple[int, str]:
    """(bytes, how they were found): HOST_SHARE of the node's available memory over the ranks on the node."""
    with open("/proc/meminfo") as f:
        available = next(int(line.split()[1]) << 10 for line in f if line.startswith("MemAvailable:"))
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    ranks = node_of(rank, world)[1]
    return int(available * HOST_SHARE) // ranks, (f"half of the node's {available / 2**30:.1f} GiB available "
                                                  f"memory over its {ranks} ranks")


@functools.lru_cache(maxsize=None)
def _notice(text: str) -> None:
    """Log `text` once per process (the storage engine and the memory tier's size their staging alike)."""
    log.info(text)


def _engine(args, ownership: ReplicaOwnership, root: str, model: list | None) -> CheckpointEngine:
    """The engine the --ckpt-* flags describe, on the storage of `root` (--save's, or --load's where that is
    another storage: each is read and written through its own)."""
    read_threads = args.ckpt_read_threads or DEFAULT_READ_THREADS
    storage = storage_for(root, fsync=args.ckpt_fsync, direct_io=args.ckpt_direct_io,
                          writer_threads=args.ckpt_writer_threads, read_threads=read_threads,
                          read_mode=args.ckpt_read_mode)
    return CheckpointEngine(
        host_buffer_bytes=staging_bytes(args, model), stage_ahead=True,
        keep_last=args.ckpt_keep_last, publish_timeout_s=args.ckpt_publish_timeout_s,
        registry=make_registry(ownership), storage=storage, compress=args.ckpt_compress)


def _clean_leftovers(save_dir: str, storage: Storage) -> None:
    """Remove what saves killed before publication left behind (through the engine's own storage of `save_dir`);
    one rank, while no one saves."""
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    if rank == 0:
        for path in clean_leftovers(save_dir, storage):
            log.info("removed the leftovers of an unfinished checkpoint: %s", path)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
