"""What a checkpoint holds: megatron-core's sharded state dict of the model and optimizer, every rank's RNG
states, and the common state (args, iteration, LR scheduler, consumed samples, the layout it was built in).

The same structure is the save's state and the load's template, whatever format writes it.
"""
from __future__ import annotations

import argparse
import random

import numpy as np
import torch

from megatron.core import parallel_state as ps
from megatron.core.dist_checkpointing.mapping import ShardedObject

from datastates.megatron import Common

from ..fsdp import whole_dtensors
from ..optimizer_state import optimizer_sharded_state_dict
from ..virtual_pipeline import chunks_sharded_state_dict

CHECKPOINT_VERSION = 3.0

_PRIMITIVES = (str, int, float, bool, type(None))


def saveable_args(args) -> argparse.Namespace:
    """The args namespace with only plain values (what a restricted unpickler accepts)."""
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


def build_state(args, model: list, optimizer, scheduler, iteration: int, consumed: int, *, wrap_common: bool,
                is_loading: bool = False, metadata: dict | None = None, saved_chain: int | None = None) -> dict:
    """The sharded state dict of one checkpoint (same structure for save and as the load template).

    `model`: the model chunks, under `model` (one) or `model0`, `model1`, ... (virtual pipeline stages).
    `wrap_common`: the plain values go in as `datastates.megatron.Common` (the saver stores them as objects);
    `metadata`: the layout to build (a load passes the checkpoint's own); default this run's flags.
    `saved_chain`: a load's, the number of optimizers chained in the checkpoint (optimizer_state.chain_length)."""
    common = Common if wrap_common else (lambda v: v)
    metadata = dict(metadata or sharded_metadata(args))
    model_sd = chunks_sharded_state_dict(model, metadata)  # megatron-core adds process groups to it
    state = {
        "args": common(saveable_args(args)),
        "checkpoint_version": common(CHECKPOINT_VERSION),
        "iteration": common(iteration),
        "train_state": common({"consumed_train_samples": consumed, "iteration": iteration}),
        "content_metadata": common(metadata),
        **model_sd,
    }
    if not args.no_save_optim and optimizer is not None:
        with whole_dtensors():  # FSDP2: the optimizer finds its DTensor parameters in model_sd
            state["optimizer"] = optimizer_sharded_state_dict(optimizer, model_sd, dict(metadata),
                                                              is_loading=is_loading, common=wrap_common,
                                                              saved_chain=saved_chain)
        state["opt_param_scheduler"] = common(scheduler.state_dict())
    if not args.no_save_rng:
        state["rng_state"] = rng_sharded_object()
    return state


def saved_bytes_bound(args, model: list) -> int:
    """What one rank's save holds at most: its parameters and, with the optimizer, two fp32 Adam moments and (with
    16-bit parameters) fp32 main parameters. An upper bound: the distributed optimizer shards those."""
    params = [p for chunk in model for p in chunk.parameters()]
    nbytes = sum(p.numel() * p.element_size() for p in params)
    if not args.no_save_optim:
        nbytes += sum(p.numel() for p in params) * 4 * (3 if (args.bf16 or args.fp16) else 2)
    return nbytes


def state_nbytes(state) -> int:
    """The bytes of every tensor in a sharded state dict."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    tensors = [x.data if isinstance(x, ShardedTensor) else x for x in nested_values(state)]
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def current_layout() -> tuple:
    """This run's (tp, pp, dp) sizes."""
    return (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
            ps.get_data_parallel_world_size())


def layout_of(saved_args):
    """(tp, pp, dp) sizes the checkpoint was saved with, from its args; None when they are not recorded."""
    names = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "data_parallel_size")
    values = tuple(getattr(saved_args, n, None) for n in names)
    return None if any(v is None for v in values) else tuple(int(v) for v in values)


def describe_layout(layout) -> str:
    return "TP{}xPP{}xDP{}".format(*layout)


def model_layout(args) -> tuple:
    """(expert parallel, expert tensor parallel, virtual stages per pipeline rank) of a run's args or a
    checkpoint's (a checkpoint from before these flags: one chunk, no experts)."""
    ep = getattr(args, "expert_model_parallel_size", None) or 1
    etp = getattr(args, "expert_tensor_parallel_size", None) or getattr(args, "tensor_model_parallel_size", 1)
    return ep, etp, getattr(args, "virtual_pipeline_model_parallel_size", None) or 1


def describe_model_layout(layout) -> str:
    return "EP{}xETP{} with {} virtual stage(s) per pipeline rank".format(*layout)
