"""What a checkpoint's tensors are, read from the names megatron-core gives them (no data is read).

- the optimizer state: the distributed optimizer's dp_reshardable flat buckets, or model-shaped state per
  parameter, with the bytes of each kind (main params, moments); a MoE model's chained optimizer (a dense and
  an expert optimizer, megatron-core's order: experts last) part by part;
- the experts of a MoE model: how many per MoE layer, how many MoE layers, and which ranks write and hold which
  experts (the expert-parallel layout). megatron-core keys every expert of a layer alike,
  `...mlp.experts.experts.linear_fc1.weight`, with the expert index as an axis prepended after the layer axes.
"""
from __future__ import annotations

import math
import re

from datastates.names import common_path

# names of layer-stacked tensors: a prepended axis per such segment not followed by an index (megatron-core)
STACK_SEGMENTS = ("layers", "local_experts")
EXPERT_SEGMENT = "experts"
_CHAIN = re.compile(r"^chained_(\d+)\.(.+)$")
_DIST_OPT = re.compile(r"^optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_\d+\.dtype_.*\.bucket_idx_\d+\.(\w+)$")
_MODEL_SPACE = re.compile(r"^optimizer\.state\.(\w+)\.(.+)$")
_CHAIN_PATH = re.compile(r"^optimizer/(\d+)/optimizer$")  # of a common value

DIST_LAYOUT = "distributed optimizer, dp_reshardable (flat bucket shards per TP x PP domain)"
MODEL_LAYOUT = "model-shaped (fully_reshardable distributed optimizer, or a non-distributed one)"


def stack_slots(parts: list[str]) -> list[int]:
    """The positions of the segments of a key (split at dots) that each prepend an axis, in axis order."""
    return [i for i, p in enumerate(parts) if p in STACK_SEGMENTS and not (i + 1 < len(parts) and
                                                                          parts[i + 1].isdigit())]


def expert_axis(key: str) -> int | None:
    """The axis of a MoE expert tensor that indexes its experts (after the layer axes before it), or None."""
    parts = key.split(".")
    if EXPERT_SEGMENT not in parts:
        return None
    at = parts.index(EXPERT_SEGMENT)
    return sum(1 for i in stack_slots(parts) if i < at)


def _written_bytes(t: dict) -> int:
    return sum(s["nbytes"] for s in t["shards"] if s["write"])


def _is_expert(name: str) -> bool:
    return EXPERT_SEGMENT in name.split(".")


def optimizer_summary(tensors: dict[str, dict], objects: dict) -> dict | None:
    """The optimizer state's layout and bytes by kind (and, for a chain of several, by part)."""
    kinds: dict[str, int] = {}
    parts: dict[str, dict[str, int]] = {}
    domains, buckets, params = set(), 0, set()
    layout = None
    for name, t in tensors.items():
        chained = _CHAIN.match(name)
        part, bare = (int(chained[1]), chained[2]) if chained else (None, name)
        if m := _DIST_OPT.match(bare):
            layout, kind = DIST_LAYOUT, m[2]
            domains.add((part, m[1]))
            buckets += 1
        elif m := _MODEL_SPACE.match(bare):
            layout, kind = layout or MODEL_LAYOUT, m[1]
            params.add(m[2])
            part = part if part is not None else ("expert" if _is_expert(m[2]) else "dense")
        else:
            continue
        nbytes = _written_bytes(t)
        kinds[kind] = kinds.get(kind, 0) + nbytes
        by_kind = parts.setdefault(str(part), {})
        by_kind[kind] = by_kind.get(kind, 0) + nbytes
    if not kinds:
        return None
    out = {"layout": layout, "bytes_by_kind": kinds}
    if domains:
        out.update(domains=len(domains), buckets=buckets // max(1, len(kinds)))
    else:
        out["parameters"] = len(params)
    chain = _chain_length(objects, parts)
    if chain > 1:
        out["chain"] = {"parts": chain, "bytes_by_part": _named_parts(parts, chain)}
    return out


def _chain_length(objects: dict, parts: dict) -> int:
    """How many optimizers are chained: megatron-core keeps each part's hyper-parameters as its own object."""
    saved = {int(m[1]) for name in objects.get("global", {}) if (m := _CHAIN_PATH.match(common_path(name) or ""))}
    prefixed = {int(p) for p in parts if p.isdigit()}
    return len(saved | prefixed) or 1


def _named_parts(parts: dict, chain: int) -> dict:
    """Bytes by part: `chained_<i>` prefixes name them (part chain-1, the last, is the experts' optimizer);
    model-shaped state without prefixes is told apart by parameter name."""
    names = {str(i): ("expert" if i == chain - 1 else "dense") + f" (part {i})" for i in range(chain)}
    return {names.get(p, p): kinds for p, kinds in sorted(parts.items())}


def experts_summary(tensors: dict[str, dict]) -> dict | None:
    """The experts of a MoE model's weights (optimizer state excluded): count per MoE layer, MoE layers, the
    expert-parallel size, and for each block of experts the ranks that write it and hold it."""
    expert = {n: t for n, t in tensors.items() if _is_expert(n) and not n.startswith(("optimizer.", "chained_"))}
    if not expert:
        return None
    moe_layers, placement, ep, count = 0, None, None, None
    for name, t in sorted(expert.items()):
        axis, shape = expert_axis(name), t["global_shape"]
        if axis >= len(shape):
            continue
        if name.endswith("linear_fc1.weight"):
            moe_layers += math.prod(shape[:axis])
        if placement is None:
            count, placement = shape[axis], _placement(t, axis)
            ep = len(placement)
    return {"experts": count, "moe_layers": moe_layers, "expert_parallel": ep, "placement": placement,
            "tensors": len(expert), "bytes": sum(_written_bytes(t) for t in expert.values())}


def _placement(t: dict, axis: int) -> list[dict]:
    """Blocks of experts [first, last) along `axis` held by the same ranks (one block per expert-parallel rank),
    each with the ranks that hold it (its expert data-parallel replicas) and that write it (any layer)."""
    held: dict[int, set] = {}
    written: dict[int, set] = {}
    for s in t["shards"]:
        lo = s["offset"][axis]
        for e in range(lo, lo + s["shape"][axis]):
            held.setdefault(e, set()).add(s["rank"])
            if s["write"]:
                written.setdefault(e, set()).add(s["rank"])
    blocks: list[dict] = []
    for e in sorted(held):
        if blocks and blocks[-1]["held_by"] == sorted(held[e]) and blocks[-1]["experts"][1] == e:
            blocks[-1]["experts"][1] = e + 1
            blocks[-1]["written_by"] = sorted(set(blocks[-1]["written_by"]) | written.get(e, set()))
        else:
            blocks.append({"experts": [e, e + 1], "written_by": sorted(written.get(e, set())),
                           "held_by": sorted(held[e])})
    return blocks
