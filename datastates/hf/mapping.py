"""What every architecture's name mapping is made of (datastates/hf/architectures/ build their rules from it).

Keys are megatron-core's global (TP/PP-independent) sharded keys; a key under `decoder.layers.` holds every layer
stacked on a first axis, and maps to one transformers name per layer (`{i}`); an expert's key also stacks the
experts on a second axis (`{e}`: one name per layer and expert). The splits of the tensors megatron-core fuses:
- linear_qkv: the rows of each query group in turn, [its query heads, its key head, its value head] (`qkv`);
- linear_fc1 with SwiGLU: [gate; up] (`halves`; megatron-core applies silu to the first half);
- linear layers stored transposed on the transformers side (`transposed`: GPT-2's Conv1D, in x out).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from typing import Callable

import torch

from .geometry import Geometry

LAYER, EXPERT = "{i}", "{e}"


def whole(t: torch.Tensor) -> list[torch.Tensor]:
    return [t]


def only(pieces: list[torch.Tensor]) -> torch.Tensor:
    return pieces[0]


@dataclass(frozen=True)
class Rule:
    """One megatron-core tensor and the transformers tensors it is, with the exact split and its inverse."""
    megatron: str
    hf: tuple[str, ...]
    split: Callable[[torch.Tensor], list[torch.Tensor]] = whole
    merge: Callable[[list[torch.Tensor]], torch.Tensor] = only
    vocab: bool = False  # rows are the (padded) vocabulary
    also: str | None = None  # another key megatron-core gives the same tensor in another layer spec
    at: tuple[int, ...] = ()  # the leading index of this rule's part of a stacked tensor (a layer of it)

    @property
    def axes(self) -> tuple[str, ...]:
        """The indexed leading axes (after `at`), in order: none, layers, experts, or layers and experts."""
        return tuple(p for p in (LAYER, EXPERT) if p in self.hf[0])

    @property
    def lead(self) -> int:
        """How many leading axes are indexed."""
        return len(self.axes)

    def names(self, index: tuple[int, ...]) -> list[str]:
        """The transformers names of one unit: `index` gives the layer and/or expert of `axes`."""
        values = dict(zip(self.axes, map(str, index)))
        out = []
        for name in self.hf:
            for key, value in values.items():
                name = name.replace(key, value)
            out.append(name)
        return out

    def with_key(self, present) -> "Rule":
        """This rule under the key the checkpoint has, where megatron-core has two for it."""
        if self.also is not None and self.megatron not in present and self.also in present:
            return replace(self, megatron=self.also, also=None)
        return self


def qkv(geo: Geometry) -> tuple[Callable, Callable]:
    """Split megatron-core's per-group [q heads, k, v] rows into q, k, v (weights and biases alike)."""
    per = geo.heads // geo.groups

    def split(t):
        g = t.reshape(geo.groups, per + 2, geo.head_dim, *t.shape[1:])
        return [g[:, :per].reshape(-1, *t.shape[1:]), g[:, per].reshape(-1, *t.shape[1:]),
                g[:, per + 1].reshape(-1, *t.shape[1:])]

    def merge(pieces):
        q, k, v = pieces
        rest = q.shape[1:]
        return torch.cat([q.reshape(geo.groups, per, geo.head_dim, *rest),
                          k.reshape(geo.groups, 1, geo.head_dim, *rest),
                          v.reshape(geo.groups, 1, geo.head_dim, *rest)], dim=1).reshape(-1, *rest)
    return split, merge


def halves(t):
    return list(t.chunk(2, dim=0))


def cat(pieces):
    return torch.cat(pieces, dim=0)


def transposed(t):
    return [t.t()]


def untransposed(pieces):
    return pieces[0].t()


def unit_sizes(rule: Rule, geo: Geometry) -> tuple[int, ...]:
    """How many units each indexed leading axis of a rule's tensor has."""
    return tuple({LAYER: geo.layers, EXPERT: geo.experts}[a] for a in rule.axes)


def unit_indices(rule: Rule, geo: Geometry) -> list[tuple[int, ...]]:
    """Every unit of a rule's tensor: () for a whole one, (layer,), (expert,) or (layer, expert) for stacked ones."""
    return [tuple(i) for i in itertools.product(*(range(n) for n in unit_sizes(rule, geo)))]


def linear_extra_state(geo: Geometry) -> dict[str, tuple[int, ...]]:
    """The `_extra_state` objects of megatron-core's linear layers (None for the local implementation) in a model
    whose layers are stacked (every architecture but DeepSeek-V3's), which its model state dict holds and a load
    into the model expects: key -> its grid (one per layer, or per layer and expert)."""
    mlp = (("mlp.experts.experts.linear_fc1", "mlp.experts.experts.linear_fc2") if geo.experts
           else ("mlp.linear_fc1", "mlp.linear_fc2"))
    grid = (geo.layers, geo.experts) if geo.experts else (geo.layers,)
    out = {f"decoder.layers.self_attention.{m}._extra_state": (geo.layers,) for m in ("linear_qkv", "linear_proj")}
    out.update({f"decoder.layers.{m}._extra_state": grid for m in mlp})
    return out


def padded_vocab(vocab: int, divisible_by: int, tensor_parallel: int) -> int:
    """Megatron's padded vocabulary: a multiple of divisible_by x TP."""
    mult = divisible_by * tensor_parallel
    return -(-vocab // mult) * mult


def pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """The vocabulary padded as Megatron-LM's checkpoint loaders pad it: the last row repeated."""
    if rows == t.shape[0]:
        return t
    return torch.cat([t, t[-1:].expand(rows - t.shape[0], *t.shape[1:])], dim=0)


def swiglu_rules(megatron: str, hf: str, names=("gate_proj", "up_proj", "down_proj"), kind: str = "weight"):
    """A SwiGLU MLP's two megatron-core tensors (under `megatron`) as transformers' gate, up and down projections
    (under `hf`): linear_fc1 is [gate; up]."""
    gate, up, down = names
    return [Rule(f"{megatron}linear_fc1.{kind}", (f"{hf}{gate}.{kind}", f"{hf}{up}.{kind}"), halves, cat),
            Rule(f"{megatron}linear_fc2.{kind}", (f"{hf}{down}.{kind}",))]
