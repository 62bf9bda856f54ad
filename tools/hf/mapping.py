"""megatron-core sharded keys <-> transformers tensor names, per architecture.

Keys are megatron-core's global (TP/PP-independent) sharded keys; a key under `decoder.layers.` holds every layer
stacked on a first axis, and maps to one transformers name per layer (`{i}`). Two tensors are fused in
megatron-core and split here:
- linear_qkv: the rows of each query group in turn, [its query heads, its key head, its value head];
- linear_fc1 with SwiGLU: [gate; up] (megatron-core applies silu to the first half).
transformers' GPT-2 stores linear layers transposed (Conv1D, in x out) and its c_attn as [all q; all k; all v].
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .arch import Geometry

LAYER = "{i}"


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

    @property
    def layered(self) -> bool:
        return LAYER in self.hf[0]

    def names(self, layer: int | None) -> list[str]:
        return [n.replace(LAYER, str(layer)) for n in self.hf] if self.layered else list(self.hf)


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


def llama_rules(geo: Geometry) -> list[Rule]:
    att, mlp, hf = "decoder.layers.self_attention.", "decoder.layers.mlp.", "model.layers.{i}."
    qkv_split, qkv_merge = _qkv(geo)
    rules = [Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), vocab=True),
             Rule(att + "linear_qkv.layer_norm_weight", (hf + "input_layernorm.weight",)),
             Rule(att + "linear_proj.weight", (hf + "self_attn.o_proj.weight",)),
             Rule(mlp + "linear_fc1.layer_norm_weight", (hf + "post_attention_layernorm.weight",)),
             Rule(mlp + "linear_fc2.weight", (hf + "mlp.down_proj.weight",)),
             Rule("decoder.final_layernorm.weight", ("model.norm.weight",))]
    for kind in ("weight", "bias") if geo.bias else ("weight",):
        rules += [Rule(att + f"linear_qkv.{kind}", tuple(f"{hf}self_attn.{p}_proj.{kind}" for p in "qkv"),
                       qkv_split, qkv_merge),
                  Rule(mlp + f"linear_fc1.{kind}", (f"{hf}mlp.gate_proj.{kind}", f"{hf}mlp.up_proj.{kind}"),
                       _halves, _cat)]
    if geo.bias:
        rules += [Rule(att + "linear_proj.bias", (hf + "self_attn.o_proj.bias",)),
                  Rule(mlp + "linear_fc2.bias", (hf + "mlp.down_proj.bias",))]
    if not geo.tied:
        rules.append(Rule("output_layer.weight", ("lm_head.weight",), vocab=True))
    return rules


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


def rules_for(geo: Geometry) -> list[Rule]:
    return llama_rules(geo) if geo.arch == "llama" else gpt2_rules(geo)


def extra_state_keys() -> list[str]:
    """The per-layer `_extra_state` objects of megatron-core's linear layers, which its model state dict holds
    (None for the local implementation) and a load into the model expects."""
    return [f"decoder.layers.{m}._extra_state" for m in ("self_attention.linear_qkv", "self_attention.linear_proj",
                                                          "mlp.linear_fc1", "mlp.linear_fc2")]


def padded_vocab(vocab: int, divisible_by: int, tensor_parallel: int) -> int:
    """Megatron's padded vocabulary: a multiple of divisible_by x TP."""
    mult = divisible_by * tensor_parallel
    return -(-vocab // mult) * mult


def pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """The vocabulary padded as Megatron-LM's checkpoint loaders pad it: the last row repeated."""
    if rows == t.shape[0]:
        return t
    return torch.cat([t, t[-1:].expand(rows - t.shape[0], *t.shape[1:])], dim=0)
