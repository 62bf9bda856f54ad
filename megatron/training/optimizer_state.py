"""The optimizer's part of a checkpoint: megatron-core's optimizer sharded state dicts, and the megatron-core
defects this trainer works around when that state is saved and loaded.

Every optimizer is megatron-core's (`DistributedOptimizer`, `Float16OptimizerWithFloat16Params`, `FP32Optimizer`);
its `sharded_state_dict` / `load_state_dict` do the work. The workarounds, each where it applies, and each needed
by both supported releases, 0.16.1 and 0.19.2 (the code they work around is unchanged between them; the
bit-exact resume and resharding tests, which fail without them, run in both environments):

- with torch's Adam (no TE/apex) a fresh optimizer has no `step` to describe (`_init_optimizer_state`), the
  non-distributed optimizers leave their common step out at 0 (`_one_common_step`), the
  DistributedOptimizer shares one step tensor between all parameters and its dp_reshardable loader overwrites the
  steps (`_restore_adam_steps`), and its fully_reshardable loader fails on the step (`_load_fully_reshardable`);
- fp16's grad scaler state holds a device tensor, and its loader moves it with `.cuda()`: saved as numbers,
  restored here (`_restore_grad_scaler`);
- the fully_reshardable save reads parameters at their padded buffer offsets from a gather that dropped the
  padding between buckets, shifting every parameter after the first bucket (`_bucket_padded_gather`).
"""
from __future__ import annotations

import contextlib
import functools

import torch

from datastates.megatron import Common


def _parts(optimizer) -> list:
    """The megatron-core optimizers inside `optimizer` (a ChainedOptimizer's parts, or itself)."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _has_sharded(tree) -> bool:
    """Whether `tree` holds anything megatron-core's loaders treat specially (sharded, or kept on load)."""
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedBase
    if isinstance(tree, dict):
        return any(_has_sharded(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return any(_has_sharded(v) for v in tree)
    return isinstance(tree, (ShardedBase, LocalNonpersistentObject))


def _plain(value):
    """A plain copy of a common value: 0-dim tensors (Adam's common step) become numbers."""
    if isinstance(value, torch.Tensor) and value.dim() == 0:
        return value.item()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    return value


def _as_common(tree):
    """Every maximal subtree without sharded items becomes one `Common` (saved once, by rank 0, as megatron-core
    saves an optimizer's plain values in its common state)."""
    if not _has_sharded(tree):
        return Common(_plain(tree))
    if not isinstance(tree, (dict, list, tuple)):
        return tree  # a ShardedTensor / ShardedObject / factory / LocalNonpersistentObject
    if isinstance(tree, dict):
        return {k: _as_common(v) for k, v in tree.items()}
    return type(tree)(_as_common(v) for v in tree)


def _one_common_step(optimizer_sd: dict, optimizer) -> None:
    """A FP32Optimizer / Float16Optimizer state dict always with its `common_step`.

    megatron-core saves the Adam step shared by all parameters once, as `common_step`, and restores every
    parameter's step from it; but it leaves `common_step` out when the step is 0, so a fresh optimizer
    describing what it will load would not ask for it, and the loaded parameters would have no step."""
    inner = optimizer_sd.get("optimizer", optimizer_sd)
    state = inner.get("state") if isinstance(inner, dict) else None
    if not isinstance(state, dict) or "common_step" in state:
        return  # DistributedOptimizer: its step lives in the param groups
    for opt in _parts(optimizer):
        for st in getattr(getattr(opt, "optimizer", None), "state", {}).values():
            if "step" in st:
                state["common_step"] = st["step"].clone()
                return


@contextlib.contextmanager
def _bucket_padded_gather(optimizer, metadata: dict):
    """fully_reshardable: give megatron-core's gathered optimizer state its buffer's padded coordinates.

    `DistributedOptimizer.get_parameter_state_dp_zero` concatenates the buckets without the padding between them,
    but `sharded_param_state_fully_reshardable` slices it at each parameter's offset in the padded buffer: with
    more than one bucket (the embedding tied across pipeline stages gets its own; so does any bucketed
    --overlap-grad-reduce run) every later parameter comes out shifted, its tail zero-filled, with only a
    warning. Here each bucket's part is put back at the bucket's offset, where those slices look."""
    dist_opts = [o for o in _parts(optimizer) if hasattr(o, "get_parameter_state_dp_zero")]
    if metadata.get("distrib_optim_sharding_type") != "fully_reshardable" or not dist_opts:
        yield
        return
    for opt in dist_opts:
        opt.get_parameter_state_dp_zero = functools.partial(_padded_dp_zero_state, opt,
                                                            type(opt).get_parameter_state_dp_zero.__get__(opt))
    try:
        yield
    finally:
        for opt in dist_opts:
            del opt.get_parameter_state_dp_zero


def _padded_dp_zero_state(opt, gather, *args, **kwargs):
    state = gather(*args, **kwargs)
    if state is None:
        return None
    for gbuf_idx, dtype_states in state.items():
        if not isinstance(gbuf_idx, int):
            continue  # "buckets_coalesced"
        buffer = opt.buffers[gbuf_idx]
        for world in dtype_states.values():
            for key, flat in world.items():
                if not (isinstance(flat, torch.Tensor) and flat.dim() == 1 and flat.numel() == buffer.numel_unpadded):
                    continue
                padded = torch.zeros(buffer.numel, dtype=flat.dtype, device=flat.device)
                src = 0
                for bucket in buffer.buckets:
                    n = bucket.numel_unpadded
                    padded[bucket.offset:bucket.offset + n] = flat[src:src + n]
                    src += n
                world[key] = padded
    return state


def _init_optimizer_state(optimizer) -> None:
    """Give a fresh optimizer its state, Adam's step included, so that it can describe what it saves or loads.

    megatron-core's `init_state_fn` makes the moments but no step; with torch's Adam (no TE/apex) the
    optimizers' `state_dict()` then has no step to save, or to ask a checkpoint for."""
    for opt in _parts(optimizer):
        inner = getattr(opt, "optimizer", None)
        if inner is None or not hasattr(opt, "init_state_fn"):
            continue
        opt.init_state_fn(inner, opt.config)
        for group in inner.param_groups:
            for p in group["params"]:
                inner.state[p].setdefault("step", torch.tensor(0.0, dtype=torch.float32))


def optimizer_sharded_state_dict(optimizer, model_sd: dict, metadata: dict, *, is_loading: bool,
                                 common: bool) -> dict:
    """megatron-core's optimizer sharded state dict; for datastates its plain values become `Common`.

    Non-distributed optimizers always describe their Adam step (see `_one_common_step`). A save before the first
    step the optimizer took (fp16's loss scaler skips the steps that overflow) describes the zero moments and
    step 0 Adam would create at that first step, the same math: a load always asks for them."""
    _init_optimizer_state(optimizer)
    with _bucket_padded_gather(optimizer, metadata):
        sd = optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=metadata)
    _one_common_step(sd, optimizer)
    if sd.get("grad_scaler"):  # fp16's loss scale: plain numbers (a 1-element tensor on the device otherwise)
        sd["grad_scaler"] = {k: v.item() if isinstance(v, torch.Tensor) else v for k, v in sd["grad_scaler"].items()}
    return _as_common(sd) if common else sd


def load_optimizer_state(optimizer, loaded: dict) -> None:
    scaler = loaded.pop("grad_scaler", None)  # restored below: megatron-core's loader moves it with .cuda()
    inner = loaded.get("optimizer", loaded)
    state = inner.get("state") if isinstance(inner, dict) else None
    if isinstance(state, dict) and isinstance(state.get("common_step"), (int, float)):
        state["common_step"] = torch.tensor(float(state["common_step"]), dtype=torch.float32)  # Adam's type
    with torch.no_grad():  # copies into the main params, never a step autograd should see
        if loaded.get("param_state_sharding_type") == "fully_reshardable":
            _load_fully_reshardable(optimizer, loaded)
        else:
            optimizer.load_state_dict(loaded)
    _restore_adam_steps(optimizer)
    if scaler:
        _restore_grad_scaler(optimizer, scaler)


def _restore_grad_scaler(optimizer, saved: dict) -> None:
    """fp16's dynamic loss scale and its trackers, on the device the scale lives on."""
    for opt in _parts(optimizer):
        grad_scaler = getattr(opt, "grad_scaler", None)
        if grad_scaler is not None and hasattr(grad_scaler, "_scale"):
            scale = saved["scale"]
            grad_scaler._scale = torch.tensor([scale] if not isinstance(scale, torch.Tensor) else scale.tolist(),
                                              dtype=grad_scaler._scale.dtype, device=grad_scaler._scale.device)
            grad_scaler._growth_tracker = int(saved["growth_tracker"])
            grad_scaler._hysteresis_tracker = int(saved["hysteresis_tracker"])

def _load_fully_reshardable(optimizer, loaded: dict) -> None:
    """DistributedOptimizer.load_state_dict in its two steps, the Adam steps set aside for the second.

    megatron-core (0.16.1, 0.19.2) copies a fully_reshardable param state into every key of the parameter's
    optimizer state; with torch's Adam (no TE/apex) that state also holds `step`, which the checkpoint keeps in
    the param groups, and the copy fails (KeyError: 'step'). The steps come back from the param groups
    afterwards."""
    (opt,) = _parts(optimizer)
    param_state = loaded.pop("param_state")
    opt.load_state_dict(loaded)
    inner = opt.optimizer
    steps = {p: st.pop("step") for p, st in inner.state.items() if "step" in st}
    opt.load_parameter_state_from_fully_reshardable(param_state)
    for p, step in steps.items():
        inner.state[p]["step"] = step


def _restore_adam_steps(optimizer) -> None:
    """Every parameter's own Adam step, from the loaded param groups, for megatron-core's DistributedOptimizer.

    With torch's Adam (no TE/apex) megatron-core (0.16.1, 0.19.2) first gives every parameter one shared step
    tensor (torch's Adam increments it in place, once per parameter), then its dp_reshardable loader overwrites
    the steps with the template's. The step it saved in each param group is the truth."""
    for opt in _parts(optimizer):
        inner = getattr(opt, "optimizer", None)
        for group in (inner.param_groups if inner is not None else ()):
            if "step" not in group:
                continue
            for p in group["params"]:
                if "step" in inner.state.get(p, {}):
                    inner.state[p]["step"] = torch.tensor(float(group["step"]), dtype=torch.float32)
