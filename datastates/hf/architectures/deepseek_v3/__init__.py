"""DeepSeek-V3 (DeepseekV3ForCausalLM): multi-latent attention, dense first layers then routed + shared experts,
sigmoid routing: the whole of its export and import is this package; the saved flags and config.json each way
are flags.py's, the tensor names here.

megatron-core saves the layers of a model whose layers differ (dense first, then MoE: a --moe-layer-freq list)
each under its own key, `decoder.layers.<i>.`; layers that are all alike it stacks under `decoder.layers.` (then
each rule reads its layer of the stacked tensor). The import always writes the per-layer keys (its flags give
--moe-layer-freq as a list). The projections and norms map one to one: megatron-core's linear_kv_down_proj rows
are [the kv latent; the shared rotary key], its up projections' rows per head [no-position part; rotary part] (q)
and [key; value] (kv), as transformers splits them. The MoE layer's experts are stacked per layer ({e}); the
dense and shared-expert SwiGLU fc1 is [gate; up].
"""
from __future__ import annotations

import torch

from ... import HFError, saved_flag
from ...geometry import Geometry, check_embedding, max_positions, vocab
from ...mapping import EXPERT, Rule, cat, halves, only
from ..base import Architecture
from .flags import (check_deepseek_shapes, deepseek_config, deepseek_differences, deepseek_flags, deepseek_from_args,
                    deepseek_from_config)


def _with_zero_bias(t: torch.Tensor) -> list[torch.Tensor]:
    """The router weight and, for a run without --moe-router-enable-expert-bias, the bias transformers adds to the
    sigmoid scores before choosing experts: zeros (the same choice)."""
    return [t, torch.zeros(t.shape[0], dtype=t.dtype, device=t.device)]


def _attention(geo, hf: str) -> list[tuple[str, tuple[str, ...], str | None]]:
    """(megatron-core suffix, transformers names, the key of Transformer Engine's fused norm) of one layer."""
    att, out = "self_attention.", []
    if geo.deepseek.q_lora_rank is None:
        out.append((att + "linear_q_proj.weight", (hf + "self_attn.q_proj.weight",), None))
    else:
        out += [(att + "linear_q_down_proj.weight", (hf + "self_attn.q_a_proj.weight",), None),
                (att + "q_layernorm.weight", (hf + "self_attn.q_a_layernorm.weight",),
                 att + "linear_q_up_proj.layer_norm_weight"),
                (att + "linear_q_up_proj.weight", (hf + "self_attn.q_b_proj.weight",), None)]
    return out + [(att + "linear_kv_down_proj.weight", (hf + "self_attn.kv_a_proj_with_mqa.weight",), None),
                  (att + "kv_layernorm.weight", (hf + "self_attn.kv_a_layernorm.weight",),
                   att + "linear_kv_up_proj.layer_norm_weight"),
                  (att + "linear_kv_up_proj.weight", (hf + "self_attn.kv_b_proj.weight",), None),
                  (att + "linear_proj.weight", (hf + "self_attn.o_proj.weight",), None),
                  ("input_layernorm.weight", (hf + "input_layernorm.weight",), None),
                  ("pre_mlp_layernorm.weight", (hf + "post_attention_layernorm.weight",),
                   "mlp.linear_fc1.layer_norm_weight")]


def _swiglu(megatron: str, hf: str) -> list[tuple]:
    return [(megatron + "linear_fc1.weight", (hf + "gate_proj.weight", hf + "up_proj.weight"), halves, cat),
            (megatron + "linear_fc2.weight", (hf + "down_proj.weight",))]


def _mlp(geo, layer: int, hf: str) -> list[tuple]:
    """(megatron-core suffix, transformers names[, split, merge]) of one layer's MLP."""
    if layer < geo.deepseek.dense_layers:
        return _swiglu("mlp.", hf + "mlp.")
    gate = hf + "mlp.gate."
    if geo.deepseek.expert_bias:
        out = [("mlp.router.weight", (gate + "weight",)),
               ("mlp.router.expert_bias", (gate + "e_score_correction_bias",))]
    else:
        out = [("mlp.router.weight", (gate + "weight", gate + "e_score_correction_bias"), _with_zero_bias, only)]
    return out + _swiglu("mlp.experts.experts.", f"{hf}mlp.experts.{EXPERT}.") + \
        _swiglu("mlp.shared_experts.", hf + "mlp.shared_experts.")


def _layer_rules(geo, layer: int, present) -> list[Rule]:
    hf, own = f"model.layers.{layer}.", f"decoder.layers.{layer}."
    stacked = not any(n.startswith(own) for n in present) and any(n.startswith("decoder.layers.") for n in present)
    prefix, at = ("decoder.layers.", (layer,)) if stacked else (own, ())
    fused = {s: te for s, _, te in _attention(geo, hf) if te}  # Transformer Engine's key for the same norm
    return [Rule(prefix + suffix, names, *fns, also=prefix + fused[suffix] if suffix in fused else None, at=at)
            for suffix, names, *fns in [(s, n) for s, n, _ in _attention(geo, hf)] + _mlp(geo, layer, hf)]


def _rules(geo, present) -> list[Rule]:
    rules = [Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), vocab=True),
             Rule("decoder.final_layernorm.weight", ("model.norm.weight",))]
    for layer in range(geo.layers):
        rules += _layer_rules(geo, layer, present)
    if not geo.tied:
        rules.append(Rule("output_layer.weight", ("lm_head.weight",), vocab=True))
    return rules


def _extra_state(geo) -> dict[str, tuple[int, ...]]:
    """The `_extra_state` objects of the per-layer keys the import writes: key -> grid (one, or one per expert)."""
    q = ("linear_q_proj",) if geo.deepseek.q_lora_rank is None else ("linear_q_down_proj", "linear_q_up_proj")
    out = {}
    for layer in range(geo.layers):
        own = f"decoder.layers.{layer}."
        linears = [f"self_attention.{name}" for name in q + ("linear_kv_down_proj", "linear_kv_up_proj", "linear_proj")]
        if layer < geo.deepseek.dense_layers:
            linears += ["mlp.linear_fc1", "mlp.linear_fc2"]
        else:
            linears += ["mlp.shared_experts.linear_fc1", "mlp.shared_experts.linear_fc2"]
            out.update({f"{own}mlp.experts.experts.{fc}._extra_state": (geo.experts,)
                        for fc in ("linear_fc1", "linear_fc2")})
        out.update({f"{own}{name}._extra_state": (1,) for name in linears})
    return out


class DeepSeekV3(Architecture):
    model_type, hf_class, label, kind = "deepseek_v3", "DeepseekV3ForCausalLM", "DeepseekV3", "mla"

    def differences(self, args) -> list[str]:
        return deepseek_differences(args)

    def geometry(self, args, shapes: dict, where: str) -> Geometry:
        heads = saved_flag(args, "num_attention_heads")
        if "embedding.word_embeddings.weight" not in shapes:
            raise HFError(f"{where} lacks the model weight embedding.word_embeddings.weight")
        ds = deepseek_from_args(args)
        geo = Geometry(arch=self.model_type, layers=saved_flag(args, "num_layers"),
                       hidden=saved_flag(args, "hidden_size"), ffn=saved_flag(args, "ffn_hidden_size"), heads=heads,
                       groups=heads, head_dim=ds.v_head_dim, vocab=vocab(args, where), bias=False,
                       tied=not saved_flag(args, "untie_embeddings_and_output_weights"),
                       max_positions=max_positions(args), norm_eps=saved_flag(args, "norm_epsilon"),
                       experts=saved_flag(args, "num_experts"), topk=saved_flag(args, "moe_router_topk"), deepseek=ds)
        check_embedding(geo, shapes, where)
        check_deepseek_shapes(geo, shapes, where)
        return geo

    def config(self, geo: Geometry, dtype: str) -> dict:
        return deepseek_config(geo, dtype)

    def from_config(self, config: dict, where: str) -> Geometry:
        ds = deepseek_from_config(config, where)
        heads = config["num_attention_heads"]
        return Geometry(self.model_type, config["num_hidden_layers"], config["hidden_size"],
                        config["intermediate_size"], heads, heads, ds.v_head_dim, config["vocab_size"], False,
                        bool(config.get("tie_word_embeddings", False)), config["max_position_embeddings"],
                        float(config.get("rms_norm_eps", 1e-6)), experts=config.get("n_routed_experts", 256),
                        topk=config.get("num_experts_per_tok", 8), deepseek=ds)

    def flags(self, geo: Geometry) -> list:
        return ["--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu", "--num-experts",
                geo.experts, "--moe-router-topk", geo.topk, "--moe-ffn-hidden-size", geo.deepseek.moe_ffn,
                *deepseek_flags(geo)]

    def rules(self, geo: Geometry, present) -> list[Rule]:
        return _rules(geo, present)

    def extra_state(self, geo: Geometry) -> dict[str, tuple[int, ...]]:
        return _extra_state(geo)


ARCHITECTURE = DeepSeekV3()
