"""An optimizer state saved by one kind of megatron-core optimizer, read by the other: the distributed optimizer
in its fully_reshardable layout <-> the non-distributed optimizers (what FSDP2 and DDP without
--use-distributed-optimizer train with).

Both keep Adam's moments per parameter under the same names (`optimizer.state.exp_avg.<key>`, `exp_avg_sq`) and
megatron-core's keys and global shapes, so the read plan reshards them like any tensor. They differ in two
places, translated here in the load's template, never in the files:

- the fp32 main parameters: `optimizer.state.param.<key>` (distributed) and `optimizer.state.fp32_param.<key>`
  (non-distributed, 16-bit training); an fp32 non-distributed run has none: its main parameters are the model's
  weights `<key>`;
- the plain values: the distributed optimizer keeps its param groups whole, each with Adam's step; the
  non-distributed ones keep each group's hyper-parameters apart and one `common_step`. The template's plain
  values are filled from the checkpoint's (read before the load) and kept as they are by the load.

The dp_reshardable layout (flat buffer shards of one TP x PP domain), fp16 (a loss scaler of each kind's own
shape) and chained optimizers (MoE with expert parallelism) are refused before anything is read.
"""
from __future__ import annotations

import dataclasses

from datastates.megatron import Common

MAIN_PARAM = {True: "optimizer.state.param.", False: "optimizer.state.fp32_param."}  # by "distributed"
_GROUP_IDENTITY = ("wd_mult", "lr_mult", "is_expert_parallel", "is_decoupled_lr")


def crosses(saved_args, args) -> bool:
    """Whether the checkpoint's optimizer is of the other kind than this run's."""
    return saved_args is not None and \
        bool(getattr(saved_args, "use_distributed_optimizer", False)) != bool(args.use_distributed_optimizer)


def refusal(saved_args, args, metadata: dict) -> str | None:
    """Why this run cannot read the other kind's optimizer state (None: it can)."""
    saved_dist = bool(getattr(saved_args, "use_distributed_optimizer", False))
    if saved_dist and metadata.get("distrib_optim_sharding_type") != "fully_reshardable":
        return ("it holds the distributed optimizer in megatron-core's dp_reshardable layout (flat buffer shards), "
                "which only a distributed optimizer reads; save with --dist-ckpt-optim-fully-reshardable")
    if getattr(saved_args, "fp16", False) or args.fp16:
        return "fp16's loss scaler state has another shape in each kind"
    if bool(getattr(saved_args, "bf16", False)) != bool(args.bf16):
        return "its main parameters were kept for another precision (--bf16 differs)"
    for who, a in (("it was", saved_args), ("this run is", args)):
        if (getattr(a, "expert_model_parallel_size", None) or 1) > 1:
            return f"{who} saved with expert parallelism, whose optimizer is a chain of two"
    return None


def template_as_saved(template: dict, saved_common: dict, saved_dist: bool, bf16: bool) -> dict:
    """This run's optimizer template (`optimizer_sharded_state_dict(is_loading=True)`, plain values as Common)
    asking for what the other kind saved: main parameters under the saved names, plain values filled from
    `saved_common` (the checkpoint's optimizer entry, read) as objects the load keeps."""
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject
    groups, step = _saved_groups(saved_common, saved_dist)
    values = _Values(groups, step)

    def walk(node, path: tuple):
        if isinstance(node, Common):
            return LocalNonpersistentObject(values.at(path, node.value))
        if isinstance(node, dict):
            return {k: walk(v, path + (k,)) for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v, path + (i,)) for i, v in enumerate(node)]
        key = getattr(node, "key", None)
        if isinstance(key, str) and key.startswith(MAIN_PARAM[not saved_dist]):
            model_key = key[len(MAIN_PARAM[not saved_dist]):]
            saved_key = MAIN_PARAM[saved_dist] + model_key if (saved_dist or bf16) else model_key
            return dataclasses.replace(node, key=saved_key)
        return node

    return walk(template, ())


def _saved_groups(saved: dict, saved_dist: bool) -> tuple[list[dict], float]:
    """(the saved param groups without their step, Adam's step) of either kind's common optimizer entry."""
    inner = saved.get("optimizer", saved)
    groups = [dict(g) for g in inner["param_groups"]]
    if saved_dist:
        steps = {g.pop("step", None) for g in groups}
        step = next(iter(steps - {None}), 0.0)
    else:
        step = inner.get("state", {}).get("common_step", 0.0)
    return groups, float(step)


class _Values:
    """The value of each plain entry of this run's template (its path from the optimizer's root, and this run's
    own value to check group identities against), from the saved groups and step."""

    def __init__(self, groups: list[dict], step: float):
        self.groups, self.step = groups, step

    def at(self, path: tuple, own):
        if path and path[-1] == "common_step":
            return self.step
        if path and path[-1] == "param_state_sharding_type":
            return "fully_reshardable"
        if "param_groups" in path:
            rest = path[path.index("param_groups") + 1:]
            if not rest:
                return [self._group(i, g) for i, g in enumerate(own)]
            group = self._group(rest[0], None)
            return group if len(rest) == 1 else group[rest[1]]
        if isinstance(own, dict) and "param_groups" in own:  # the distributed optimizer's whole entry
            return {**own, "param_groups": [{**self._group(i, g), "step": self.step}
                                            for i, g in enumerate(own["param_groups"])]}
        raise ValueError(f"the optimizer entry {'/'.join(map(str, path))} has no counterpart in the other kind's "
                         "checkpoint")

    def _group(self, i: int, own: dict | None) -> dict:
        if i >= len(self.groups):
            raise ValueError(f"the checkpoint's optimizer has {len(self.groups)} param groups, this run's more")
        saved = self.groups[i]
        if own is not None and any(saved.get(k) != own.get(k) for k in _GROUP_IDENTITY if k in own):
            raise ValueError(f"the checkpoint's param group {i} is another group than this run's "
                             f"({ {k: saved.get(k) for k in _GROUP_IDENTITY} } against "
                             f"{ {k: own.get(k) for k in _GROUP_IDENTITY} })")
        return {k: v for k, v in saved.items() if k != "params"}
