"""Mixtral (MixtralForCausalLM): the Llama family's attention, experts in every layer, no biases.

Its names are those of Mixtral's released checkpoints (transformers 5, which fuses the experts in memory, still
reads and writes them): per expert w1 (gate), w3 (up), w2 (down).
"""
from __future__ import annotations

from ..geometry import Geometry
from ..mapping import Rule, swiglu_rules
from .experts import ROUTER_FLAGS, TopKExperts
from .llama import HF_LAYER


class Mixtral(TopKExperts):
    model_type, hf_class, label = "mixtral", "MixtralForCausalLM", "Mixtral"
    needs = {**ROUTER_FLAGS, "--moe-router-pre-softmax": ("moe_router_pre_softmax", False),
             "--disable-bias-linear (Mixtral has no biases)": ("disable_bias_linear", True),
             "--qk-layernorm (that is Qwen3-MoE)": ("qk_layernorm", False)}
    checks = {"sliding_window": (None, None), "router_jitter_noise": (0.0, 0.0)}

    def own_config(self, geo: Geometry) -> dict:
        return {"num_local_experts": geo.experts, "num_experts_per_tok": geo.topk, "sliding_window": None,
                "router_jitter_noise": 0.0, "router_aux_loss_coef": geo.aux_loss, "output_router_logits": False}

    def sizes_from_config(self, config: dict, where: str) -> dict:
        return self.routing_from_config(config, where, config.get("num_local_experts", 8), normalised=True)

    def mlp_rules(self, geo: Geometry) -> list[Rule]:
        moe, hf = "decoder.layers.mlp.", HF_LAYER + "block_sparse_moe."
        return [Rule(moe + "router.weight", (hf + "gate.weight",)),
                *swiglu_rules(moe + "experts.experts.", hf + "experts.{e}.", ("w1", "w3", "w2"))]


ARCHITECTURE = Mixtral()
