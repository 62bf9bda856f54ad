"""--use-torch-fsdp2: megatron-core's TorchFullyShardedDataParallel (torch's `fully_shard` over the DP group), its
flags' checks, and its DTensors in a checkpoint's sharded state dict.

Under FSDP2 every parameter (and, through megatron-core's non-distributed optimizers, every fp32 main parameter
and Adam moment) is a DTensor sharded on dim 0 over the DP ranks, unevenly when the rows do not divide. A
checkpoint keeps megatron-core's keys and global shapes, so it is the same logical checkpoint a DDP or
distributed-optimizer run writes: `localized` turns each ShardedTensor (or SwiGLU factory) over a DTensor into
ShardedTensors over the rows this rank holds, with their global offsets; the DP ranks no longer hold replicas of
each other, each writes its own rows. Nothing is gathered, and the engine snapshots and restores the DTensors'
own storage in place. `with_dtensors` gives a load's result its DTensors back, for the module's and the
optimizer's `load_state_dict`.
"""
from __future__ import annotations

import contextlib
import dataclasses

import torch

from datastates.dtensors import is_dtensor, local_shard

# What megatron-core (0.16.1, 0.19.2) refuses beside --use-torch-fsdp2, and why
_REFUSED_BESIDE = (
    ("pipeline_model_parallel_size", lambda v: v != 1, "--pipeline-model-parallel-size > 1",
     "megatron-core's FSDP2 wrapper shards within one pipeline stage only"),
    ("expert_model_parallel_size", lambda v: (v or 1) != 1, "--expert-model-parallel-size > 1",
     "megatron-core's FSDP2 wrapper does not shard expert-parallel groups"),
    ("use_distributed_optimizer", bool, "--use-distributed-optimizer",
     "FSDP2 already shards the optimizer state over the DP ranks (it replaces ZeRO-1)"),
    ("overlap_grad_reduce", bool, "--overlap-grad-reduce", "belongs to DDP's gradient buckets; FSDP2 "
     "reduce-scatters each module's gradients as its backward ends"),
    ("overlap_param_gather", bool, "--overlap-param-gather", "belongs to the distributed optimizer; FSDP2 "
     "gathers each module's parameters before its forward"),
    ("virtual_pipeline_model_parallel_size", lambda v: (v or 1) != 1, "virtual pipeline stages",
     "they need pipeline parallelism"),
    ("untie_embeddings_and_output_weights", lambda v: not v, "tied embedding and output weights",
     "the output layer would read the embedding's weight outside its FSDP2 unit, still sharded; pass "
     "--untie-embeddings-and-output-weights (as Llama-style models are)"),
    ("fp16", bool, "--fp16", "megatron-core's fp16 loss scaler keeps an fp16 copy beside sharded parameters "
     "that FSDP2 mixed precision does not; train in --bf16"),
)


def validate_fsdp2(args) -> None:
    """--use-torch-fsdp2 beside what megatron-core refuses with it, and the checkpoint formats that cannot hold
    its sharded state. Raises ValueError naming the flag."""
    if not getattr(args, "use_torch_fsdp2", False):
        return
    for name, refused, flag, why in _REFUSED_BESIDE:
        if refused(getattr(args, name, None)):
            raise ValueError(f"--use-torch-fsdp2 with {flag}: {why}")
    if args.ckpt_format != "datastates":
        raise ValueError(f"--use-torch-fsdp2 with --ckpt-format {args.ckpt_format}: megatron-core's "
                         f"{args.ckpt_format} saver takes whole or TP-sharded tensors, not FSDP2's DTensor shards; "
                         "use --ckpt-format datastates (its checkpoints convert to torch_dist and Hugging Face "
                         "with tools/convert_checkpoint.py)")


def wrap(args, module: torch.nn.Module, config) -> torch.nn.Module:
    """`module` sharded by megatron-core's TorchFullyShardedDataParallel over the DP group (its transformer
    layers, embedding and output layer each a `fully_shard` unit, then the whole)."""
    from megatron.core.distributed import TorchFullyShardedDataParallel
    from megatron.core.distributed.torch_fully_sharded_data_parallel_config import (
        TorchFullyShardedDataParallelConfig)
    ddp_config = TorchFullyShardedDataParallelConfig(
        reshard_after_forward=args.torch_fsdp2_reshard_after_forward)
    wrapped = TorchFullyShardedDataParallel(config=config, ddp_config=ddp_config, module=module)
    wrapped.finish_grad_sync = _grads_already_reduced
    return wrapped


def _grads_already_reduced(force_all_reduce: bool = False) -> None:
    """FSDP2 reduce-scatters each unit's gradients in its backward hooks: nothing is left at the end. (megatron-
    core 0.16.1's wrapper inherits a `finish_grad_sync()` without the `force_all_reduce` its own
    finalize_model_grads passes.)"""


@contextlib.contextmanager
def whole_dtensors():
    """megatron-core's sharded state dicts built with FSDP2's DTensor parameters as they are (to be `localized`).

    megatron-core (0.16.1, 0.19.2) replaces a DTensor parameter by its local tensor in its `make_*sharded_tensor*`
    helpers, placed as if every DP rank held the same number of rows (wrong for uneven shards: torch gives the
    last ranks fewer), gathering the whole tensor when a rank would hold none; its non-distributed optimizers
    then find no parameter for their states. Its `HAVE_DTENSOR` off while the dict is built keeps the DTensors."""
    from megatron.core import utils
    was = utils.HAVE_DTENSOR
    utils.HAVE_DTENSOR = False
    try:
        yield
    finally:
        utils.HAVE_DTENSOR = was


def _rows(view: torch.Tensor, of: torch.Tensor) -> tuple[int, int]:
    """The dim-0 rows [first, end) of `of` that `view` (a slice of `of` along dim 0) covers."""
    first = (view.storage_offset() - of.storage_offset()) // of.stride(0)
    return first, first + view.shape[0]


def _local_pieces(pieces: list, shard, meta: torch.Tensor, where: str) -> list:
    """megatron-core ShardedTensors over row slices of `meta` (the DTensor's shape on the meta device), cut to the
    rows this rank holds (`shard`, its LocalShard) and rebuilt over its local tensor; each keeps its key, its global
    shape and its offset moved by the rows cut."""
    local = shard.tensor
    first = shard.global_offset[0]
    end = first + local.shape[0]
    if any(o != 0 for o in shard.global_offset[1:]):
        raise ValueError(f"{where}: FSDP2 state sharded along a dimension other than 0 ({shard.global_offset})")
    out = []
    for piece in pieces:
        piece_first, piece_end = _rows(piece.data, meta)
        lo, hi = max(piece_first, first), min(piece_end, end)
        if hi <= lo:
            continue
        offset = list(piece.global_offset)
        offset[piece.prepend_axis_num] += lo - piece_first
        data = local[lo - first:hi - first]
        rid = piece.replica_id  # the DP ranks' rows are their own: the DP component becomes 0 (main)
        replica = tuple(rid[:-1]) + (0 if shard.writes else 1,) if isinstance(rid, tuple) else int(not shard.writes)
        out.append(dataclasses.replace(piece, data=data, local_shape=tuple(data.shape), global_offset=tuple(offset),
                                       axis_fragmentations=None,  # uneven rows: no regular grid
                                       replica_id=replica))
    return out


def localized(state):
    """A copy of the sharded state dict `state` in which every ShardedTensor or ShardedTensorFactory over a
    DTensor is replaced by ShardedTensors over this rank's rows (a list when a factory splits the tensor, as
    SwiGLU's fc1 is saved as two halves); a rank that holds no row of a tensor keeps a LocalNonpersistentObject
    (nothing saved, nothing read)."""
    from megatron.core.dist_checkpointing.mapping import (LocalNonpersistentObject, ShardedTensor,
                                                          ShardedTensorFactory)
    if isinstance(state, dict):
        return {k: localized(v) for k, v in state.items()}
    if isinstance(state, list):
        return [localized(v) for v in state]
    if isinstance(state, (ShardedTensor, ShardedTensorFactory)) and is_dtensor(state.data):
        full = state.data
        meta = torch.empty(full.shape, dtype=full.dtype, device="meta")
        if isinstance(state, ShardedTensor):
            pieces = [dataclasses.replace(state, data=meta)]
        else:
            built = state.build_fn(state.key, meta, state.replica_id, state.flattened_range)
            pieces = list(built.values()) if isinstance(built, dict) else list(built)
            if not all(isinstance(p, ShardedTensor) and p.data is not None and p.data.is_contiguous()
                       for p in pieces):
                raise ValueError(f"{state.key}: megatron-core's factory for it does not cut the tensor into "
                                 "row slices; its FSDP2 shard cannot be saved without gathering it")
        shard = local_shard(full, state.key)
        local = _local_pieces(pieces, shard, meta, state.key)
        if not local:
            return LocalNonpersistentObject(shard.tensor)
        return local[0] if isinstance(state, ShardedTensor) else local
    return state


def with_dtensors(loaded, template):
    """`loaded` (the result of reading `localized(template)`) with the DTensor of `template` wherever the template
    held a ShardedTensor or factory over one: its rows were read in place into the DTensor's local tensor."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
    if isinstance(template, (ShardedTensor, ShardedTensorFactory)) and is_dtensor(template.data):
        return template.data
    if isinstance(template, dict) and isinstance(loaded, dict):
        return {k: with_dtensors(v, template[k]) if k in template else v for k, v in loaded.items()}
    if isinstance(template, list) and isinstance(loaded, list) and len(template) == len(loaded):
        return [with_dtensors(v, t) for v, t in zip(loaded, template)]
    return loaded
