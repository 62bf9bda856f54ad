"""Llama (LlamaForCausalLM), and what the Llama family shares: RoPE, RMSNorm, SwiGLU, grouped-query attention.

Mixtral, Qwen2, Qwen3 and Qwen3-MoE are this family with its options: biases on the q/k/v projections alone, q/k
norms, experts. megatron-core's RoPE rotates the two halves of each head as transformers' Llama does, so no weight
is permuted; its rotary base is --rotary-base (rope_theta). RoPE scaling has no pretrain_gpt.py flag: refused.
"""
from __future__ import annotations

from .. import HFError, saved_flag
from ..geometry import ROPE_BASE, Geometry, differences, require, rope_base, stacked_geometry
from ..mapping import Rule, qkv, swiglu_rules
from .base import Architecture

ATTENTION, HF_LAYER = "decoder.layers.self_attention.", "model.layers.{i}."
# the saved flags every member of the family needs
FAMILY_FLAGS = {"--position-embedding-type": ("position_embedding_type", "rope"),
                "--rotary-percent": ("rotary_percent", 1.0),
                "--normalization": ("normalization", "RMSNorm"),
                "--swiglu": ("swiglu", True)}


def rope_base_from_config(config: dict, where: str) -> float:
    """rope_theta, refused where pretrain_gpt.py has no equivalent: RoPE scaling, or a base --rotary-base (an
    integer flag) cannot give."""
    params, scaling = config.get("rope_parameters") or {}, config.get("rope_scaling") or {}
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if kind != "default":
        raise HFError(f"{where}: rope_type {kind!r}: pretrain_gpt.py has megatron-core's unscaled RoPE only (no "
                      f"flag for RoPE scaling)")
    theta = float(params.get("rope_theta") or config.get("rope_theta") or ROPE_BASE)
    if theta != int(theta):
        raise HFError(f"{where}: rope_theta {theta!r}: pretrain_gpt.py's --rotary-base is an integer")
    return theta


class LlamaFamily(Architecture):
    """The family's shared export checks, config keys, flags and names; a member states what it adds."""
    kind = "dense"
    fc2 = "decoder.layers.mlp.linear_fc2.weight"  # the tensor whose last axis is the MLP's hidden size
    needs: dict = {}  # saved flags the member needs beyond FAMILY_FLAGS: flag -> (attribute, value)
    checks: dict = {}  # config.json keys the member needs: key -> (transformers' default, value)

    def differences(self, args) -> list[str]:
        return differences(args, {**FAMILY_FLAGS, **self.needs})

    def geometry(self, args, shapes: dict, where: str) -> Geometry:
        return stacked_geometry(self.model_type, args, shapes, self.fc2, where, rope_base=rope_base(args),
                                **self.sizes_from_args(args))

    def sizes_from_args(self, args) -> dict:
        """The member's Geometry fields beyond the family's, from the saved flags."""
        return {}

    def config(self, geo: Geometry, dtype: str) -> dict:
        return {"architectures": [self.hf_class], "model_type": self.model_type, "vocab_size": geo.vocab,
                "tie_word_embeddings": geo.tied, "dtype": dtype, "torch_dtype": dtype, "hidden_size": geo.hidden,
                "intermediate_size": geo.ffn, "num_hidden_layers": geo.layers, "num_attention_heads": geo.heads,
                "num_key_value_heads": geo.groups, "head_dim": geo.head_dim, "hidden_act": "silu",
                "max_position_embeddings": geo.max_positions, "rms_norm_eps": geo.norm_eps,
                "rope_theta": geo.rope_base, "rope_scaling": None,  # transformers 4; 5 reads rope_parameters
                "rope_parameters": {"rope_type": "default", "rope_theta": geo.rope_base}, "attention_dropout": 0.0,
                **self.own_config(geo)}

    def own_config(self, geo: Geometry) -> dict:
        """The member's config.json keys beyond the family's."""
        return {}

    def from_config(self, config: dict, where: str) -> Geometry:
        require(config, where, {"hidden_act": ("silu", "silu"), "partial_rotary_factor": (1.0, 1.0), **self.checks})
        base = rope_base_from_config(config, where)
        self.check_config(config, where)
        h, n = config["hidden_size"], config["num_attention_heads"]
        sizes = {"arch": self.model_type, "layers": config["num_hidden_layers"], "hidden": h,
                 "ffn": config["intermediate_size"], "heads": n, "groups": config.get("num_key_value_heads") or n,
                 "head_dim": config.get("head_dim") or h // n, "vocab": config["vocab_size"],
                 "bias": bool(config.get("attention_bias", False)),
                 "tied": bool(config.get("tie_word_embeddings", False)),
                 "max_positions": config["max_position_embeddings"], "norm_eps": float(config.get("rms_norm_eps", 1e-6)),
                 "rope_base": base}
        return Geometry(**{**sizes, **self.sizes_from_config(config, where)})

    def check_config(self, config: dict, where: str) -> None:
        """Refuse, by key, what the member's config.json holds that pretrain_gpt.py does not compute."""

    def sizes_from_config(self, config: dict, where: str) -> dict:
        """The member's Geometry fields beyond (or instead of) the family's, from config.json."""
        return {}

    def flags(self, geo: Geometry) -> list:
        flags = ["--kv-channels", geo.head_dim] if geo.head_dim * geo.heads != geo.hidden else []
        flags += ["--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu"]
        if geo.rope_base != ROPE_BASE:
            flags += ["--rotary-base", int(geo.rope_base)]
        if geo.qkv_bias:
            flags.append("--add-qkv-bias")
        if geo.qk_norm:
            flags.append("--qk-layernorm")
        return flags

    def rules(self, geo: Geometry, present) -> list[Rule]:
        return self.attention_rules(geo) + self.mlp_rules(geo)

    def attention_rules(self, geo: Geometry) -> list[Rule]:
        """Everything but the MLP."""
        att, hf = ATTENTION, HF_LAYER
        qkv_split, qkv_merge = qkv(geo)
        rules = [Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), vocab=True),
                 Rule(att + "linear_qkv.layer_norm_weight", (hf + "input_layernorm.weight",)),
                 Rule(att + "linear_proj.weight", (hf + "self_attn.o_proj.weight",)),
                 Rule("decoder.layers.mlp.linear_fc1.layer_norm_weight", (hf + "post_attention_layernorm.weight",),
                      also="decoder.layers.pre_mlp_layernorm.weight"),
                 Rule("decoder.final_layernorm.weight", ("model.norm.weight",))]
        for kind in ("weight", "bias") if geo.bias or geo.qkv_bias else ("weight",):
            rules.append(Rule(att + f"linear_qkv.{kind}", tuple(f"{hf}self_attn.{p}_proj.{kind}" for p in "qkv"),
                              qkv_split, qkv_merge))
        if geo.bias:
            rules.append(Rule(att + "linear_proj.bias", (hf + "self_attn.o_proj.bias",)))
        if geo.qk_norm:
            rules += [Rule(f"{att}{p}_layernorm.weight", (f"{hf}self_attn.{p}_norm.weight",)) for p in "qk"]
        if not geo.tied:
            rules.append(Rule("output_layer.weight", ("lm_head.weight",), vocab=True))
        return rules

    def mlp_rules(self, geo: Geometry) -> list[Rule]:
        rules = []
        for kind in ("weight", "bias") if geo.bias else ("weight",):
            rules += swiglu_rules("decoder.layers.mlp.", HF_LAYER + "mlp.", kind=kind)
        return rules


class Llama(LlamaFamily):
    model_type, hf_class, label = "llama", "LlamaForCausalLM", "Llama"
    needs = {"--qk-layernorm (that is Qwen3)": ("qk_layernorm", False)}
    checks = {"pretraining_tp": (1, 1)}

    def differences(self, args) -> list[str]:
        diffs = super().differences(args)
        if saved_flag(args, "add_qkv_bias") and saved_flag(args, "disable_bias_linear"):
            diffs.append("--add-qkv-bias with --disable-bias-linear (Llama's attention_bias also biases o_proj: "
                         "that is Qwen2)")
        return diffs

    def own_config(self, geo: Geometry) -> dict:
        return {"attention_bias": geo.bias, "mlp_bias": geo.bias}

    def check_config(self, config: dict, where: str) -> None:
        if config.get("attention_bias", False) != config.get("mlp_bias", False):
            raise HFError(f"{where}: attention_bias {config.get('attention_bias')} and mlp_bias "
                          f"{config.get('mlp_bias')} differ; --disable-bias-linear sets both at once")


ARCHITECTURE = Llama()
