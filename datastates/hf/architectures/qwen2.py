"""Qwen2 and Qwen2.5 (Qwen2ForCausalLM): Llama with biases on the query/key/value projections alone
(--add-qkv-bias with --disable-bias-linear) and its own rotary base.

Qwen models may run sliding-window attention on their upper layers (use_sliding_window, layer_types);
megatron-core's attention here is full attention only, so such a model is refused by key.
"""
from __future__ import annotations

from .. import HFError
from ..geometry import Geometry
from .llama import LlamaFamily

NO_SLIDING_WINDOW = {"use_sliding_window": (False, False)}


def refuse_sliding_window_layers(config: dict, where: str) -> None:
    sliding = [i for i, kind in enumerate(config.get("layer_types") or []) if kind != "full_attention"]
    if sliding:
        raise HFError(f"{where}: layer_types makes layers {sliding} sliding-window attention: pretrain_gpt.py has "
                      f"full attention only")


def full_attention_config(geo: Geometry) -> dict:
    """The config.json keys that say every layer attends to the whole sequence."""
    return {"use_sliding_window": False, "sliding_window": None, "max_window_layers": geo.layers,
            "layer_types": ["full_attention"] * geo.layers}


class Qwen2(LlamaFamily):
    model_type, hf_class, label = "qwen2", "Qwen2ForCausalLM", "Qwen2"
    needs = {"--add-qkv-bias": ("add_qkv_bias", True), "--disable-bias-linear": ("disable_bias_linear", True),
             "--qk-layernorm": ("qk_layernorm", False)}
    checks = NO_SLIDING_WINDOW

    def sizes_from_args(self, args) -> dict:
        return {"qkv_bias": True}

    def own_config(self, geo: Geometry) -> dict:
        return full_attention_config(geo)

    def check_config(self, config: dict, where: str) -> None:
        refuse_sliding_window_layers(config, where)

    def sizes_from_config(self, config: dict, where: str) -> dict:
        return {"bias": False, "qkv_bias": True}


ARCHITECTURE = Qwen2()
