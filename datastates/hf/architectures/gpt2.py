"""GPT-2 (GPT2LMHeadModel): this trainer's default GPT, with learned absolute positions, LayerNorm, GELU (erf),
biases, tied or untied. transformers' GPT-2 stores its linear layers transposed (Conv1D, in x out) and its
c_attn as [all q; all k; all v]."""
from __future__ import annotations

from typing import Callable

import torch

from .. import saved_flag
from ..geometry import Geometry, differences, require, stacked_geometry
from ..mapping import Rule, qkv, transposed, untransposed
from .base import Architecture


def _gpt2_qkv(geo: Geometry, weight: bool) -> tuple[Callable, Callable]:
    """GPT-2's c_attn: [q; k; v] (then transposed, for the weight)."""
    split_qkv, merge_qkv = qkv(geo)

    def split(t):
        fused = torch.cat(split_qkv(t), dim=0)
        return [fused.t() if weight else fused]

    def merge(pieces):
        fused = pieces[0].t() if weight else pieces[0]
        return merge_qkv(list(fused.chunk(3, dim=0)))
    return split, merge


class GPT2(Architecture):
    model_type, hf_class, label, kind = "gpt2", "GPT2LMHeadModel", "GPT-2", "dense"

    def differences(self, args) -> list[str]:
        diffs = differences(args, {"--position-embedding-type": ("position_embedding_type", "learned_absolute"),
                                   "--normalization": ("normalization", "LayerNorm"),
                                   "--swiglu": ("swiglu", False),
                                   "--disable-bias-linear": ("disable_bias_linear", False),
                                   "--qk-layernorm": ("qk_layernorm", False)})
        heads = saved_flag(args, "num_attention_heads")
        if saved_flag(args, "group_query_attention") and saved_flag(args, "num_query_groups") != heads:
            diffs.append("--group-query-attention with fewer query groups than heads (GPT-2 has one key/value head "
                         "per query head)")
        kv, h = saved_flag(args, "kv_channels"), saved_flag(args, "hidden_size")
        if kv is not None and kv * heads != h:
            diffs.append(f"--kv-channels {kv} (GPT-2's head size is hidden size / heads = {h // heads})")
        return diffs

    def geometry(self, args, shapes: dict, where: str) -> Geometry:
        return stacked_geometry(self.model_type, args, shapes, "decoder.layers.mlp.linear_fc2.weight", where)

    def config(self, geo: Geometry, dtype: str) -> dict:
        return {"architectures": [self.hf_class], "model_type": self.model_type, "vocab_size": geo.vocab,
                "tie_word_embeddings": geo.tied, "dtype": dtype, "torch_dtype": dtype,
                "n_embd": geo.hidden, "n_inner": geo.ffn, "n_layer": geo.layers, "n_head": geo.heads,
                "n_positions": geo.max_positions, "layer_norm_epsilon": geo.norm_eps, "activation_function": "gelu",
                "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "scale_attn_weights": True,
                "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False}

    def from_config(self, config: dict, where: str) -> Geometry:
        require(config, where, {"activation_function": ("gelu_new", "gelu"),
                                "scale_attn_by_inverse_layer_idx": (False, False),
                                "scale_attn_weights": (True, True)})
        h = config["n_embd"]
        return Geometry("gpt2", config["n_layer"], h, config.get("n_inner") or 4 * h, config["n_head"],
                        config["n_head"], h // config["n_head"], config["vocab_size"], True,
                        bool(config.get("tie_word_embeddings", True)), config["n_positions"],
                        float(config.get("layer_norm_epsilon", 1e-5)))

    def flags(self, geo: Geometry) -> list:
        return []

    def rules(self, geo: Geometry, present) -> list[Rule]:
        att, mlp, hf = "decoder.layers.self_attention.", "decoder.layers.mlp.", "transformer.h.{i}."
        rules = [Rule("embedding.word_embeddings.weight", ("transformer.wte.weight",), vocab=True),
                 Rule("embedding.position_embeddings.weight", ("transformer.wpe.weight",)),
                 Rule(att + "linear_qkv.weight", (hf + "attn.c_attn.weight",), *_gpt2_qkv(geo, weight=True)),
                 Rule(att + "linear_qkv.bias", (hf + "attn.c_attn.bias",), *_gpt2_qkv(geo, weight=False)),
                 Rule(att + "linear_proj.weight", (hf + "attn.c_proj.weight",), transposed, untransposed),
                 Rule(att + "linear_proj.bias", (hf + "attn.c_proj.bias",)),
                 Rule(mlp + "linear_fc1.weight", (hf + "mlp.c_fc.weight",), transposed, untransposed),
                 Rule(mlp + "linear_fc1.bias", (hf + "mlp.c_fc.bias",)),
                 Rule(mlp + "linear_fc2.weight", (hf + "mlp.c_proj.weight",), transposed, untransposed),
                 Rule(mlp + "linear_fc2.bias", (hf + "mlp.c_proj.bias",))]
        for kind in ("weight", "bias"):
            rules += [Rule(f"{att}linear_qkv.layer_norm_{kind}", (f"{hf}ln_1.{kind}",)),
                      Rule(f"{mlp}linear_fc1.layer_norm_{kind}", (f"{hf}ln_2.{kind}",)),
                      Rule(f"decoder.final_layernorm.{kind}", (f"transformer.ln_f.{kind}",))]
        if not geo.tied:
            rules.append(Rule("output_layer.weight", ("lm_head.weight",), vocab=True))
        return rules


ARCHITECTURE = GPT2()
