"""megatron-core sharded keys <-> transformers tensor names, per architecture.

Keys are megatron-core's global (TP/PP-independent) sharded keys; a key under `decoder.layers.` holds every layer
stacked on a first axis, and maps to one transformers name per layer (`{i}`); an expert's key also stacks the
experts on a second axis (`{e}`: one name per layer and expert). Two tensors are fused in megatron-core and split
here:
- linear_qkv: the rows of each query group in turn, [its query heads, its key head, its value head];
- linear_fc1 with SwiGLU: [gate; up] (megatron-core applies silu to the first half).
transformers' GPT-2 stores linear layers transposed (Conv1D, in x out) and its c_attn as [all q; all k; all v].
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from typing import Callable

import torch

from .arch import Geometry

LAYER, EXPERT = "{i}", "{e}"


def _whole(t: torch.Tensor) -> list[torch.Tensor]:
    return [t]


def _only(pieces: list[torch.Tensor]) -> torch.Tensor:
    return pieces[0]


@dataclass(frozen=True)
class Rule:
    """One megatron-core tensor and the transformers tensors it is, with the exact split and its inverse."""
    megatron: str
    hf: tuple[str, ...]
    split: Callable[[torch.Tensor], list[torch.Tensor]] = _whole
    merge: Callable[[list[torch.Tensor]], torch.Tensor] = _only
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


def _qkv(geo: Geometry) -> tuple[Callable, Callable]:
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


def _halves(t):
    return list(t.chunk(2, dim=0))


def _cat(pieces):
    return torch.cat(pieces, dim=0)


def _transposed(t):
    return [t.t()]


def _untransposed(pieces):
    return pieces[0].t()


def _gpt2_qkv(geo: Geometry, weight: bool) -> tuple[Callable, Callable]:
    """GPT-2's c_attn: [q; k; v] (then transposed, for the weight)."""
    split_qkv, merge_qkv = _qkv(geo)

    def split(t):
        fused = torch.cat(split_qkv(t), dim=0)
        return [fused.t() if weight else fused]

    def merge(pieces):
        fused = pieces[0].t() if weight else pieces[0]
        return merge_qkv(list(fused.chunk(3, dim=0)))
    return split, merge


def _llama_family_rules(geo: Geometry) -> list[Rule]:
    """Everything but the MLP, shared by Llama and Mixtral."""
    att, hf = "decoder.layers.self_attention.", "model.layers.{i}."
    qkv_split, qkv_merge = _qkv(geo)
    rules = [Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), vocab=True),
             Rule(att + "linear_qkv.layer_norm_weight", (hf + "input_layernorm.weight",)),
             Rule(att + "linear_proj.weight", (hf + "self_attn.o_proj.weight",)),
             Rule("decoder.layers.mlp.linear_fc1.layer_norm_weight", (hf + "post_attention_layernorm.weight",),
                  also="decoder.layers.pre_mlp_layernorm.weight"),
             Rule("decoder.final_layernorm.weight", ("model.norm.weight",))]
    for kind in ("weight", "bias") if geo.bias else ("weight",):
        rules.append(Rule(att + f"linear_qkv.{kind}", tuple(f"{hf}self_attn.{p}_proj.{kind}" for p in "qkv"),
                          qkv_split, qkv_merge))
    if geo.bias:
        rules.append(Rule(att + "linear_proj.bias", (hf + "self_attn.o_proj.bias",)))
    if not geo.tied:
        rules.append(Rule("output_layer.weight", ("lm_head.weight",), vocab=True))
    return rules


def llama_rules(geo: Geometry) -> list[Rule]:
    mlp, hf = "decoder.layers.mlp.", "model.layers.{i}.mlp."
    rules = _llama_family_rules(geo)
    for kind in ("weight", "bias") if geo.bias else ("weight",):
        rules += [Rule(mlp + f"linear_fc1.{kind}", (f"{hf}gate_proj.{kind}", f"{hf}up_proj.{kind}"), _halves, _cat),
                  Rule(mlp + f"linear_fc2.{kind}", (f"{hf}down_proj.{kind}",))]
    return rules


def mixtral_rules(geo: Geometry) -> list[Rule]:
    """Mixtral's names as its released checkpoints have them (and transformers 5 still saves them): per expert
    w1 (gate), w3 (up), w2 (down); megatron-core's SequentialMLP saves every expert's fc1 as [gate; up]."""
    moe, hf = "decoder.layers.mlp.", "model.layers.{i}.block_sparse_moe."
    return _llama_family_rules(geo) + [
        Rule(moe + "router.weight", (hf + "gate.weight",)),
        Rule(moe + "experts.experts.linear_fc1.weight", (hf + "experts.{e}.w1.weight", hf + "experts.{e}.w3.weight"),
             _halves, _cat),
        Rule(moe + "experts.experts.linear_fc2.weight", (hf + "experts.{e}.w2.weight",))]


def gpt2_rules(geo: Geometry) -> list[Rule]:
    att, mlp, hf = "decoder.layers.self_attention.", "decoder.layers.mlp.", "transformer.h.{i}."
    rules = [Rule("embedding.word_embeddings.weight", ("transformer.wte.weight",), vocab=True),
             Rule("embedding.position_embeddings.weight", ("transformer.wpe.weight",)),
             Rule(att + "linear_qkv.weight", (hf + "attn.c_attn.weight",), *_gpt2_qkv(geo, weight=True)),
             Rule(att + "linear_qkv.bias", (hf + "attn.c_attn.bias",), *_gpt2_qkv(geo, weight=False)),
             Rule(att + "linear_proj.weight", (hf + "attn.c_proj.weight",), _transposed, _untransposed),
             Rule(att + "linear_proj.bias", (hf + "attn.c_proj.bias",)),
             Rule(mlp + "linear_fc1.weight", (hf + "mlp.c_fc.weight",), _transposed, _untransposed),
             Rule(mlp + "linear_fc1.bias", (hf + "mlp.c_fc.bias",)),
             Rule(mlp + "linear_fc2.weight", (hf + "mlp.c_proj.weight",), _transposed, _untransposed),
             Rule(mlp + "linear_fc2.bias", (hf + "mlp.c_proj.bias",))]
    for kind in ("weight", "bias"):
        rules += [Rule(f"{att}linear_qkv.layer_norm_{kind}", (f"{hf}ln_1.{kind}",)),
                  Rule(f"{mlp}linear_fc1.layer_norm_{kind}", (f"{hf}ln_2.{kind}",)),
                  Rule(f"decoder.final_layernorm.{kind}", (f"transformer.ln_f.{kind}",))]
    if not geo.tied:
        rules.append(Rule("output_layer.weight", ("lm_head.weight",), vocab=True))
    return rules


def rules_for(geo: Geometry, present=()) -> list[Rule]:
    """The rules of `geo`'s architecture (`present`: the checkpoint's tensor names, where the rules depend on how
    megatron-core laid the layers out)."""
    if geo.arch == "deepseek_v3":
        from .deepseek_mapping import deepseek_rules  # it builds on this module's rules and splits
        return deepseek_rules(geo, present)
    return {"llama": llama_rules, "mixtral": mixtral_rules, "gpt2": gpt2_rules}[geo.arch](geo)


def unit_sizes(rule: Rule, geo: Geometry) -> tuple[int, ...]:
    """How many units each indexed leading axis of a rule's tensor has."""
    return tuple({LAYER: geo.layers, EXPERT: geo.experts}[a] for a in rule.axes)


def unit_indices(rule: Rule, geo: Geometry) -> list[tuple[int, ...]]:
    """Every unit of a rule's tensor: () for a whole one, (layer,), (expert,) or (layer, expert) for stacked ones."""
    return [tuple(i) for i in itertools.product(*(range(n) for n in unit_sizes(rule, geo)))]


def extra_state_objects(geo: Geometry) -> dict[str, tuple[int, ...]]:
    """The `_extra_state` objects of megatron-core's linear layers (None for the local implementation), which its
    model state dict holds and a load into the model expects: key -> its grid (one per layer, or per layer and
    expert)."""
    if geo.deepseek is not None:
        from .deepseek_mapping import deepseek_extra_state
        return deepseek_extra_state(geo)
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
