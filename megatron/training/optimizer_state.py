"""The optimizer's part of a checkpoint: megatron-core's optimizer sharded state dicts, and the megatron-core
defects this trainer works around when that state is saved and loaded.

Every optimizer is megatron-core's (`DistributedOptimizer`, `Float16OptimizerWithFloat16Params`, `FP32Optimizer`);
its `sharded_state_dict` / `load_state_dict` do the work. The workarounds, each where it applies, and each needed
by both supported releases, 0.16.1 and 0.19.2 (the code they work around is unchanged between them; the
bit-exact resume and resharding tests, which fail without them, run in both environments):

- with torch's Adam (no TE/apex) a fresh optimizer has no `step` to describe (`init_optimizer_state`), the
  non-distributed optimizers leave their common step out at 0 (`_one_common_step`), the
  DistributedOptimizer shares one step tensor between all parameters and its dp_reshardable loader overwrites the
  steps (`_restore_adam_steps`), and its fully_reshardable loader fails on the step (`_load_fully_reshardable`);
- megatron-core 0.16 does not mark --decoupled-lr's param groups, so its loader mixes them up with the others
  (`_mark_decoupled_lr_groups`);
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


def _with_state_dicts(optimizer, state_dict) -> list[tuple[object, dict]]:
    """(part, its state dict) for each part of `optimizer`: a ChainedOptimizer of one part describes that part's
    state alone; one of several (a MoE model's dense and expert optimizers) keys each part's by its index."""
    parts = _parts(optimizer)
    if len(parts) == 1:
        return [(parts[0], state_dict)]
    if sorted(state_dict) != list(range(len(parts))):
        raise ValueError(f"the optimizer state holds parts {sorted(state_dict)}, this run's chained optimizer has "
                         f"{len(parts)} (dense and expert optimizers): the checkpoint is of another model")
    return [(part, state_dict[i]) for i, part in enumerate(parts)]


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


def _one_common_step(optimizer_sd: dict, opt) -> None:
    """A FP32Optimizer / Float16Optimizer state dict always with its `common_step`.

    megatron-core saves the Adam step shared by all parameters once, as `common_step`, and restores every
    parameter's step from it; but it leaves `common_step` out when the step is 0, so a fresh optimizer
    describing what it will load would not ask for it, and the loaded parameters would have no step."""
    inner = optimizer_sd.get("optimizer", optimizer_sd)
    state = inner.get("state") if isinstance(inner, dict) else None
    if not isinstance(state, dict) or "common_step" in state:
        return  # DistributedOptimizer: its step lives in the param groups
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


def init_optimizer_state(optimizer) -> None:
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


def _mark_decoupled_lr_groups(optimizer) -> None:
    """--decoupled-lr: tell its param groups apart by `is_decoupled_lr`, the key megatron-core's loader matches
    saved groups to live ones by (with wd_mult, lr_mult and is_expert_parallel); 0.16 leaves it False on the
    decoupled groups too, so a load gave every group one group's learning rates."""
    for opt in _parts(optimizer):
        config, inner = getattr(opt, "config", None), getattr(opt, "optimizer", None)
        decoupled = getattr(config, "decoupled_lr", None)
        if inner is None or decoupled is None or decoupled == config.lr:
            continue
        for group in inner.param_groups:
            if group.get("max_lr") == decoupled:
                group["is_decoupled_lr"] = True


def optimizer_sharded_state_dict(optimizer, model_sd: dict, metadata: dict, *, is_loading: bool,
                                 common: bool, saved_chain: int | None = None) -> dict:
    """megatron-core's optimizer sharded state dict; for datastates its plain values become `Common`.

    Non-distributed optimizers always describe their Adam step (see `_one_common_step`). A save before the first
    step the optimizer took (fp16's loss scaler skips the steps that overflow) describes the zero moments and
    step 0 Adam would create at that first step, the same math: a load always asks for them. `saved_chain`: a
    load template for a checkpoint whose chained optimizer has that many parts (see `_template_for_chain`)."""
    init_optimizer_state(optimizer)
    _mark_decoupled_lr_groups(optimizer)
    with _bucket_padded_gather(optimizer, metadata):
        sd = optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=metadata)
    for part, part_sd in _with_state_dicts(optimizer, sd):
        _one_common_step(part_sd, part)
        if part_sd.get("grad_scaler"):  # fp16's loss scale: plain numbers (a 1-element tensor on the device else)
            part_sd["grad_scaler"] = {k: v.item() if isinstance(v, torch.Tensor) else v
                                      for k, v in part_sd["grad_scaler"].items()}
    sd = _as_common(sd) if common else sd
    if saved_chain is not None and saved_chain != len(_parts(optimizer)):
        sd = _template_for_chain(optimizer, sd, saved_chain, Common if common else lambda value: value)
    return sd


def chain_length(optimizer_keys) -> int:
    """How many optimizers a saved chain holds, from the keys of its `optimizer` entry (0, 1, ... per part of a
    chain of several; a single optimizer's own keys otherwise)."""
    parts = [k for k in optimizer_keys if str(k).isdigit()]
    return len(parts) or 1


def _template_for_chain(optimizer, sd: dict, saved_chain: int, common) -> dict:
    """A load template for a fully_reshardable checkpoint whose chain has another number of parts than this run's.

    A MoE model's experts have an optimizer of their own only with expert parallelism (EP > 1), so EP2 -> EP1 turns
    a chain of two into one. fully_reshardable tensors are keyed by parameter, not by part: this run's tensors
    load as they are (kept under RUN_PARTS); the hyper-parameters and step of each saved part (and fp16's loss
    scale) are read where they were saved, and `_regrouped` gives them to this run's parts."""
    run_parts = _with_state_dicts(optimizer, sd)
    fp16 = any(part_sd.get("grad_scaler") for _, part_sd in run_parts)

    def part():
        return {"optimizer": common(None), "param_state_sharding_type": common(None),
                **({"grad_scaler": common(None)} if fp16 else {})}

    template = {i: part() for i in range(saved_chain)} if saved_chain > 1 else part()
    template[RUN_PARTS] = [part_sd["param_state"] for _, part_sd in run_parts]
    return template


RUN_PARTS = "this_run_parts"  # in a `_template_for_chain` template: this run's parts' tensors


def _regrouped(optimizer, loaded: dict) -> dict:
    """A `_template_for_chain` load as this run's chained optimizer state: each of this run's param groups takes
    the hyper-parameters and step of the saved group with the same identity (megatron-core's
    `param_group_identifier_keys`), whichever part of the saved chain it was in; every part takes the saved
    chain's loss scale (fp16: one scale for the whole chain, which steps only when no part overflowed)."""
    from megatron.core.optimizer.optimizer import param_group_identifier_keys
    saved_parts = ([loaded] if "optimizer" in loaded
                   else [loaded[k] for k in sorted(k for k in loaded if k != RUN_PARTS)])
    saved_groups = [g for part in saved_parts for g in part["optimizer"]["param_groups"]]
    keys = [k for k in param_group_identifier_keys if k != "is_expert_parallel"]
    scale = {"grad_scaler": saved_parts[0]["grad_scaler"]} if saved_parts[0].get("grad_scaler") else {}
    regrouped = []
    for part, param_state in zip(_parts(optimizer), loaded[RUN_PARTS]):
        groups = []
        for group in part.optimizer.param_groups:
            same = [g for g in saved_groups if all(g.get(k) == group.get(k) for k in keys)]
            if not same:
                raise ValueError(f"the checkpoint's optimizer has no param group like this run's "
                                 f"{ {k: group.get(k) for k in keys} }")
            same.sort(key=lambda g: g.get("is_expert_parallel") != group.get("is_expert_parallel"))
            groups.append({**same[0], "is_expert_parallel": group.get("is_expert_parallel")})
        regrouped.append({"optimizer": {"param_groups": groups}, "param_state": param_state,
                          "param_state_sharding_type": "fully_reshardable", **scale})
    return regrouped[0] if len(regrouped) == 1 else dict(enumerate(regrouped))


def load_optimizer_state(optimizer, loaded: dict) -> None:
    """The loaded optimizer state into each part of `optimizer` (both of a MoE model's chain), in its layout."""
    if RUN_PARTS in loaded:
        loaded = _regrouped(optimizer, loaded)
    for part, part_loaded in _with_state_dicts(optimizer, loaded):
        scaler = part_loaded.pop("grad_scaler", None)  # restored below: megatron-core's loader moves it with .cuda()
        inner = part_loaded.get("optimizer", part_loaded)
        state = inner.get("state") if isinstance(inner, dict) else None
        if isinstance(state, dict) and isinstance(state.get("common_step"), (int, float)):
            state["common_step"] = torch.tensor(float(state["common_step"]), dtype=torch.float32)  # Adam's type
        with torch.no_grad():  # copies into the main params, never a step autograd should see
            if part_loaded.get("param_state_sharding_type") == "fully_reshardable":
                _load_fully_reshardable(part, part_loaded)
            else:
                part.load_state_dict(part_loaded)
        if scaler:
            _restore_grad_scaler(part, scaler)
    _restore_adam_steps(optimizer)


def _restore_grad_scaler(opt, saved: dict) -> None:
    """fp16's dynamic loss scale and its trackers, on the device the scale lives on."""
    grad_scaler = getattr(opt, "grad_scaler", None)
    if grad_scaler is not None and hasattr(grad_scaler, "_scale"):
        scale = saved["scale"]
        grad_scaler._scale = torch.tensor([scale] if not isinstance(scale, torch.Tensor) else scale.tolist(),
                                          dtype=grad_scaler._scale.dtype, device=grad_scaler._scale.device)
        grad_scaler._growth_tracker = int(saved["growth_tracker"])
        grad_scaler._hysteresis_tracker = int(saved["hysteresis_tracker"])

def _load_fully_reshardable(opt, loaded: dict) -> None:
    """DistributedOptimizer.load_state_dict in its two steps, the Adam steps set aside for the second.

    megatron-core (0.16.1, 0.19.2) copies a fully_reshardable param state into every key of the parameter's
    optimizer state; with torch's Adam (no TE/apex) that state also holds `step`, which the checkpoint keeps in
    the param groups, and the copy fails (KeyError: 'step'). The steps come back from the param groups
    afterwards."""
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
