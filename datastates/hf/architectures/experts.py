"""What Mixtral and Qwen3-MoE share: the Llama family's attention with a softmax top-k router over SwiGLU experts
in every layer, no shared expert.

megatron-core's router (without --moe-router-pre-softmax) takes the top k logits and their softmax; transformers'
takes the softmax of all logits, their top k, renormalised: in fp32 both pick the same experts and weigh them
alike. With --moe-router-pre-softmax megatron-core keeps the top k of the softmax over all experts as they are,
which is Qwen3-MoE's `norm_topk_prob: false`.
"""
from __future__ import annotations

from .. import HFError, saved_flag
from ..geometry import Geometry
from .llama import LlamaFamily

# MoE flags whose values both routers compute (anything else is refused, by name)
ROUTER_FLAGS = {"--moe-router-score-function": ("moe_router_score_function", "softmax"),
                "--moe-shared-expert-intermediate-size": ("moe_shared_expert_intermediate_size", None),
                "--moe-router-enable-expert-bias (aux-loss-free balancing)": ("moe_router_enable_expert_bias", False),
                "--moe-router-num-groups": ("moe_router_num_groups", None),
                "--moe-router-group-topk": ("moe_router_group_topk", None),
                "--moe-router-topk-scaling-factor": ("moe_router_topk_scaling_factor", None),
                "--moe-expert-capacity-factor": ("moe_expert_capacity_factor", None),
                "--moe-input-jitter-eps": ("moe_input_jitter_eps", None)}


class TopKExperts(LlamaFamily):
    kind = "moe"
    fc2 = "decoder.layers.mlp.experts.experts.linear_fc2.weight"

    def differences(self, args) -> list[str]:
        diffs = super().differences(args)
        freq = saved_flag(args, "moe_layer_freq", 1)
        if freq != 1 and not (isinstance(freq, list) and all(v == 1 for v in freq)):
            diffs.append(f"--moe-layer-freq is {freq!r} ({self.label} has experts in every layer: needs 1)")
        if saved_flag(args, "moe_router_load_balancing_type") == "sinkhorn":
            diffs.append(f"--moe-router-load-balancing-type is 'sinkhorn' (it routes by Sinkhorn in training and by "
                         f"sigmoid scores for top-1; {self.label} routes by the softmax of the top-k logits)")
        return diffs

    def sizes_from_args(self, args) -> dict:
        return {"experts": saved_flag(args, "num_experts"), "topk": saved_flag(args, "moe_router_topk"),
                "aux_loss": float(saved_flag(args, "moe_aux_loss_coeff") or 0.0)}

    def routing_from_config(self, config: dict, where: str, experts: int, normalised: bool) -> dict:
        """The Geometry fields of `experts` experts, `num_experts_per_tok` of them per token, their weights
        renormalised or not."""
        topk = config.get("num_experts_per_tok", 2)
        if topk == 1 and normalised:
            raise HFError(f"{where}: num_experts_per_tok 1: {self.label} then weighs the chosen expert by 1, "
                          f"megatron-core's top-1 softmax router needs --moe-router-pre-softmax, which weighs it by "
                          f"its probability")
        return {"experts": experts, "topk": topk, "pre_softmax": not normalised,
                "aux_loss": float(config.get("router_aux_loss_coef", 0.001))}

    def flags(self, geo: Geometry) -> list:
        flags = super().flags(geo) + ["--num-experts", geo.experts, "--moe-router-topk", geo.topk,
                                      "--moe-ffn-hidden-size", geo.ffn, "--moe-aux-loss-coeff", geo.aux_loss]
        return flags + (["--moe-router-pre-softmax"] if geo.pre_softmax else [])
