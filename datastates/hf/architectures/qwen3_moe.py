"""Qwen3-MoE (Qwen3MoeForCausalLM): Qwen3's attention (q/k norms, no biases) with a softmax top-k router over
SwiGLU experts in every layer and no shared expert. norm_topk_prob true is megatron-core's default router,
false is --moe-router-pre-softmax (datastates/hf/architectures/experts.py). Dense layers among the MoE ones
(decoder_sparse_step other than 1, mlp_only_layers) are refused by key.
"""
from __future__ import annotations

from .. import saved_flag
from ..geometry import Geometry
from ..mapping import Rule, swiglu_rules
from .experts import ROUTER_FLAGS, TopKExperts
from .llama import HF_LAYER
from .qwen2 import full_attention_config, refuse_sliding_window_layers
from .qwen3 import QWEN3_CHECKS, QWEN3_FLAGS


class Qwen3Moe(TopKExperts):
    model_type, hf_class, label = "qwen3_moe", "Qwen3MoeForCausalLM", "Qwen3-MoE"
    needs = {**ROUTER_FLAGS, **QWEN3_FLAGS}
    checks = {**QWEN3_CHECKS, "decoder_sparse_step": (1, 1), "mlp_only_layers": ([], [])}

    def sizes_from_args(self, args) -> dict:
        return {**super().sizes_from_args(args), "qk_norm": True,
                "pre_softmax": bool(saved_flag(args, "moe_router_pre_softmax"))}

    def own_config(self, geo: Geometry) -> dict:
        return {"attention_bias": False, **full_attention_config(geo), "num_experts": geo.experts,
                "num_experts_per_tok": geo.topk, "moe_intermediate_size": geo.ffn, "norm_topk_prob": not geo.pre_softmax,
                "decoder_sparse_step": 1, "mlp_only_layers": [], "router_aux_loss_coef": geo.aux_loss,
                "output_router_logits": False}

    def check_config(self, config: dict, where: str) -> None:
        refuse_sliding_window_layers(config, where)

    def sizes_from_config(self, config: dict, where: str) -> dict:
        experts = config.get("num_experts") or config.get("num_local_experts") or 128  # Qwen3MoeConfig's default
        return {"qk_norm": True, "ffn": config["moe_intermediate_size"],
                **self.routing_from_config(config, where, experts, normalised=bool(config.get("norm_topk_prob")))}

    def mlp_rules(self, geo: Geometry) -> list[Rule]:
        moe, hf = "decoder.layers.mlp.", HF_LAYER + "mlp."
        return [Rule(moe + "router.weight", (hf + "gate.weight",)),
                *swiglu_rules(moe + "experts.experts.", hf + "experts.{e}.")]


ARCHITECTURE = Qwen3Moe()
