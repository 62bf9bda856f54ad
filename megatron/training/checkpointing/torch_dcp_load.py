"""--load of upstream's torch_dcp checkpoint (`torch_dcp`): read by PyTorch DCP straight into this run's model and
optimizer, the state dict built as upstream's loader builds it (the unwrapped model's `state_dict()`, the
optimizer's plain `state_dict()` with its state made first, the scheduler, one RNG state for every rank).

DCP reads each rank's rows of every DTensor from whatever rows the saving ranks held, so a checkpoint of N FSDP2
ranks loads into M. The checkpoint's keys and global shapes are checked against the run's before anything is read:
a checkpoint of another model is refused naming the tensor. Upstream writes torch_dcp at TP 1 and PP 1 only; a run
of another layout, or with the distributed optimizer, is refused naming the flag (convert the checkpoint to
datastates, which any layout loads).
"""
from __future__ import annotations

import logging

import torch
from torch.distributed import checkpoint as dcp
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from datastates import CheckpointError

from ..optimizer_state import init_optimizer_state
from . import torch_dcp as names
from .state import set_rng_state

log = logging.getLogger(__name__)
RNG = "rng_state.0."


def _refusal(args) -> str | None:
    for flag, on in (("--tensor-model-parallel-size > 1", args.tensor_model_parallel_size > 1),
                     ("--pipeline-model-parallel-size > 1", args.pipeline_model_parallel_size > 1),
                     ("--use-distributed-optimizer", args.use_distributed_optimizer)):
        if on:
            return flag
    return None


def _unwrapped(module):
    while hasattr(module, "module"):
        module = module.module
    return module


def _template(args, model, optimizer, scheduler, meta: dict, load_optim: bool) -> dict:
    """The state this run asks the checkpoint for, in upstream's structure."""
    state = {"model": _unwrapped(model[0]).state_dict(), "iteration": None, "args": None}
    if load_optim:
        init_optimizer_state(optimizer)
        state["optimizer"] = optimizer.state_dict()
        state["opt_param_scheduler"] = scheduler.state_dict()
    if not (args.no_load_rng or args.finetune):  # as saved: the shapes come from the checkpoint
        for key, item in meta.items():
            if key.startswith(RNG):
                state[key] = None if isinstance(item, BytesStorageMetadata) else \
                    torch.empty(tuple(item.size), dtype=item.properties.dtype)
    return state


def _check(ckpt_dir: str, state: dict, meta: dict) -> None:
    """Every key the run asks for is in the checkpoint with the same global shape; else refused naming it."""
    flat, _ = flatten_state_dict(state)
    missing = [k for k in flat if k not in meta]
    if missing:
        raise CheckpointError(f"torch_dcp checkpoint {ckpt_dir!r} has no {missing[0]!r} ({len(missing)} of this "
                              f"run's keys missing): it holds another model or optimizer")
    for key, value in flat.items():
        item = meta[key]
        if isinstance(value, torch.Tensor) and not isinstance(item, BytesStorageMetadata) and \
                tuple(item.size) != tuple(value.shape):
            raise CheckpointError(f"torch_dcp checkpoint {ckpt_dir!r}: {key!r} has shape {tuple(item.size)}, this "
                                  f"run's {tuple(value.shape)}: it holds another model")


def _rng(state: dict) -> dict:
    """Upstream's RNG fields as this trainer's RNG state (torch's as bytes)."""
    return names.rng_state({k[len(RNG):]: v for k, v in state.items() if k.startswith(RNG)})


def load(args, model, optimizer, scheduler, ckpt_dir: str) -> tuple[int, int]:
    """Load the torch_dcp checkpoint `ckpt_dir` into the run; (iteration, consumed samples)."""
    flag = _refusal(args)
    if flag:
        raise CheckpointError(f"{ckpt_dir!r} is upstream's torch_dcp, which holds whole tensors of a TP 1, PP 1 "
                              f"model, and this run has {flag}: convert it with tools/convert_checkpoint.py --from "
                              "torch_dcp --to datastates, which any layout loads (docs/fsdp.md)")
    reader = dcp.FileSystemReader(ckpt_dir)
    meta = reader.read_metadata().state_dict_metadata
    load_optim = not (args.no_load_optim or args.finetune)
    state = _template(args, model, optimizer, scheduler, meta, load_optim)
    _check(ckpt_dir, state, meta)
    dcp.load(state, storage_reader=reader, planner=names.SafeObjectsPlanner())
    _unwrapped(model[0]).load_state_dict(state["model"])
    if args.finetune:
        return 0, 0
    if load_optim:
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["opt_param_scheduler"])
    if RNG + "torch_rng_state" in state:
        set_rng_state(_rng(state))
    iteration = int(state["iteration"])
    consumed = int(getattr(state["args"], "consumed_train_samples", 0) or 0)
    log.info(f"successfully loaded upstream's torch_dcp checkpoint {ckpt_dir} at iteration {iteration}")
    return iteration, consumed
