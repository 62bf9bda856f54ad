"""Qwen3 (Qwen3ForCausalLM): Llama without biases, with a per-head RMSNorm of queries and keys before RoPE
(--qk-layernorm: megatron-core norms each head's query and key with --norm-epsilon, as Qwen3 does with
rms_norm_eps), a head size of its own (head_dim: --kv-channels) and its rotary base. attention_bias (which
would bias o_proj as well as q/k/v) and sliding-window layers are refused by key."""
from __future__ import annotations

from ..geometry import Geometry
from .llama import LlamaFamily
from .qwen2 import NO_SLIDING_WINDOW, full_attention_config, refuse_sliding_window_layers

QWEN3_FLAGS = {"--qk-layernorm": ("qk_layernorm", True), "--disable-bias-linear": ("disable_bias_linear", True),
               "--add-qkv-bias": ("add_qkv_bias", False)}
QWEN3_CHECKS = {**NO_SLIDING_WINDOW, "attention_bias": (False, False)}


class Qwen3(LlamaFamily):
    model_type, hf_class, label = "qwen3", "Qwen3ForCausalLM", "Qwen3"
    needs, checks = QWEN3_FLAGS, QWEN3_CHECKS

    def sizes_from_args(self, args) -> dict:
        return {"qk_norm": True}

    def own_config(self, geo: Geometry) -> dict:
        return {"attention_bias": False, **full_attention_config(geo)}

    def check_config(self, config: dict, where: str) -> None:
        refuse_sliding_window_layers(config, where)

    def sizes_from_config(self, config: dict, where: str) -> dict:
        return {"qk_norm": True}


ARCHITECTURE = Qwen3()
