"""DeepSeek-style runs (multi-latent attention, dense first layers then routed + shared experts, sigmoid routing)
<-> transformers' DeepseekV3ForCausalLM: the flags checked each way, config.json, and the pretrain_gpt.py flags.

What both compute, and so what is checked:
- attention: megatron-core's MLASelfAttention and DeepseekV3Attention have the same projections and latent norms
  (transformers fixes those norms' epsilon at 1e-6, megatron-core uses --norm-epsilon for every norm: it must be
  1e-6); both take the rotary part of each head as interleaved pairs (megatron-core's MLA rope and transformers'
  `rope_interleave`), so the weights map as they are;
- YaRN: megatron-core's YarnRotaryEmbedding and transformers' "yarn" rope agree when mscale and mscale_all_dim are
  both set, or mscale is 1 (transformers then ignores mscale); the softmax scale is mscale_all_dim's on both sides;
- routing: transformers scores by sigmoid only, chooses among groups by their top-2 scores (megatron-core: their
  top topk/group_topk), normalises the chosen weights as megatron-core does for top-k > 1, then scales them.
Multi-token prediction has no transformers module (arch.py refuses it unless --drop-mtp leaves it out).
"""
from __future__ import annotations

from dataclasses import dataclass

from ... import HFError
from ... import saved_flag as _get
from ...geometry import ROPE_BASE

LATENT_NORM_EPS = 1e-6  # DeepseekV3RMSNorm's default, which transformers gives the q and kv latent norms
# megatron-core's MLATransformerConfig YaRN defaults (0.16 and 0.19); pretrain_gpt.py has no flags for them
YARN_DEFAULTS = {"original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0,
                 "rope_theta": ROPE_BASE}


@dataclass(frozen=True)
class DeepSeek:
    """What a DeepSeek-style model adds to the common Geometry."""
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_dim: int  # --qk-head-dim
    qk_rope_dim: int  # --qk-pos-emb-head-dim
    v_head_dim: int
    dense_layers: int  # first_k_dense_replace
    moe_ffn: int
    shared_experts: int  # n_shared_experts (x moe_ffn = the shared expert's size)
    groups: int  # n_group (1: no group-limited routing)
    group_topk: int
    scaling: float  # routed_scaling_factor
    expert_bias: bool  # the checkpoint holds the router's expert bias (else transformers' is zeros)
    rope: tuple  # transformers' rope_parameters, as sorted (key, value) pairs


# ----- export: saved flags -> DeepSeek -----

def _flag_differences(args) -> list[str]:
    wanted = {"--position-embedding-type": ("position_embedding_type", "rope"),
              "--normalization": ("normalization", "RMSNorm"), "--swiglu": ("swiglu", True),
              "--disable-bias-linear (DeepseekV3 has no biases)": ("disable_bias_linear", True),
              "--qk-layernorm (DeepseekV3 always norms the q and kv latents)": ("qk_layernorm", True),
              "--norm-epsilon (DeepseekV3's latent norms use 1e-6)": ("norm_epsilon", LATENT_NORM_EPS),
              "--rotary-percent": ("rotary_percent", 1.0),
              "--moe-router-score-function (DeepseekV3 routes by sigmoid scores)":
                  ("moe_router_score_function", "sigmoid"),
              "--moe-expert-capacity-factor": ("moe_expert_capacity_factor", None),
              "--moe-input-jitter-eps": ("moe_input_jitter_eps", None)}
    diffs = [f"{flag} is {_get(args, attr)!r} (needs {need!r})" for flag, (attr, need) in wanted.items()
             if _get(args, attr) != need]
    for flag, attr in (("--rotary-interleaved", "rotary_interleaved"), ("--moe-shared-expert-gate",
                                                                        "moe_shared_expert_gate")):
        if _get(args, attr):
            diffs.append(f"{flag} is set")
    if _get(args, "moe_router_load_balancing_type") == "sinkhorn":
        diffs.append("--moe-router-load-balancing-type is 'sinkhorn' (it routes by Sinkhorn in training)")
    if _get(args, "moe_router_dtype") == "fp64":
        diffs.append("--moe-router-dtype is 'fp64' (DeepseekV3 routes in fp32)")
    return diffs


def _rope_from_args(args) -> tuple[dict | None, list[str]]:
    """transformers' rope_parameters of the run's MLA rope, or the differences that leave none."""
    base = float(_get(args, "rotary_base", ROPE_BASE) or ROPE_BASE)
    factor, mscale = float(_get(args, "rotary_scaling_factor", 1.0)), float(_get(args, "mscale", 1.0))
    all_dim = float(_get(args, "mscale_all_dim", 0.0))
    if _get(args, "rope_type") == "rope":
        if factor > 1 and all_dim:
            return None, [f"--rope-type rope with --rotary-scaling-factor {factor:g} and --mscale-all-dim "
                          f"{all_dim:g} (megatron-core scales the softmax by YaRN's mscale_all_dim, transformers' "
                          f"default rope does not)"]
        return {"rope_type": "default", "rope_theta": base}, []
    diffs = []
    if mscale == 0 or (all_dim == 0 and mscale != 1):
        diffs.append(f"--mscale {mscale:g} with --mscale-all-dim {all_dim:g} (transformers' YaRN ignores mscale "
                     f"unless both are non-zero)")
    yarn = {"rope_type": "yarn", "factor": factor, "mscale": mscale, "mscale_all_dim": all_dim,
            **{k: float(_get(args, k, v)) for k, v in YARN_DEFAULTS.items() if k != "rope_theta"},
            "rope_theta": base}
    yarn["original_max_position_embeddings"] = int(yarn["original_max_position_embeddings"])
    return (None if diffs else yarn), diffs


def _layer_pattern(args) -> tuple[int, list[str]]:
    """(first_k_dense_replace, differences) from --moe-layer-freq: dense layers first, then MoE only."""
    layers, freq = _get(args, "num_layers"), _get(args, "moe_layer_freq", 1)
    pattern = freq if isinstance(freq, list) else [int(i % freq == 0) for i in range(layers)]
    dense = pattern.index(1) if 1 in pattern else layers
    if pattern != [0] * dense + [1] * (layers - dense) or dense == layers:
        return 0, [f"--moe-layer-freq is {freq!r} (DeepseekV3 has dense layers first, then MoE layers only: "
                   f"first_k_dense_replace)"]
    return dense, []


def _routing_from_args(args) -> tuple[dict, list[str]]:
    experts, topk = _get(args, "num_experts"), _get(args, "moe_router_topk")
    moe_ffn, shared = _get(args, "moe_ffn_hidden_size"), _get(args, "moe_shared_expert_intermediate_size")
    diffs = []
    if not shared or shared % moe_ffn:
        diffs.append(f"--moe-shared-expert-intermediate-size is {shared!r} (DeepseekV3's shared experts are "
                     f"n_shared_experts x --moe-ffn-hidden-size {moe_ffn}: needs a positive multiple of it)")
    groups, group_topk = _get(args, "moe_router_num_groups"), _get(args, "moe_router_group_topk")
    if group_topk:
        if not groups or experts % groups or topk // group_topk != 2:
            diffs.append(f"--moe-router-num-groups {groups!r} with --moe-router-group-topk {group_topk} (DeepseekV3 "
                         f"scores a group by its top 2 experts, megatron-core by its top topk / group_topk = "
                         f"{topk // group_topk}; the groups must divide --num-experts {experts})")
    else:
        groups = group_topk = 1
    return dict(moe_ffn=moe_ffn, shared_experts=(shared or 0) // moe_ffn, groups=groups,
                group_topk=group_topk, scaling=float(_get(args, "moe_router_topk_scaling_factor") or 1.0),
                expert_bias=bool(_get(args, "moe_router_enable_expert_bias"))), diffs


def deepseek_differences(args) -> list[str]:
    """What DeepseekV3 does not compute in an MLA checkpoint's saved flags, by flag."""
    if not _get(args, "num_experts"):
        return ["multi-latent attention without --num-experts (this converter exports MLA only as "
                "DeepseekV3ForCausalLM, whose MoE layers need experts)"]
    return _flag_differences(args) + _rope_from_args(args)[1] + _layer_pattern(args)[1] + _routing_from_args(args)[1]


def deepseek_from_args(args) -> DeepSeek:
    """The DeepSeek part of the geometry of an MLA checkpoint in whose flags deepseek_differences finds none."""
    return DeepSeek(q_lora_rank=_get(args, "q_lora_rank"), kv_lora_rank=_get(args, "kv_lora_rank"),
                    qk_nope_dim=_get(args, "qk_head_dim"), qk_rope_dim=_get(args, "qk_pos_emb_head_dim"),
                    v_head_dim=_get(args, "v_head_dim"), rope=tuple(sorted(_rope_from_args(args)[0].items())),
                    dense_layers=_layer_pattern(args)[0], **_routing_from_args(args)[0])


def check_deepseek_shapes(geo, shapes: dict, where: str) -> None:
    """The latent projections and experts of the last layer (an MoE one), against the saved flags."""
    ds: DeepSeek = geo.deepseek
    q = ("linear_q_up_proj", ds.q_lora_rank) if ds.q_lora_rank else ("linear_q_proj", geo.hidden)
    want = {f"self_attention.{q[0]}.weight": (geo.heads * (ds.qk_nope_dim + ds.qk_rope_dim), q[1]),
            "self_attention.linear_kv_down_proj.weight": (ds.kv_lora_rank + ds.qk_rope_dim, geo.hidden),
            "self_attention.linear_kv_up_proj.weight": (geo.heads * (ds.qk_nope_dim + ds.v_head_dim), ds.kv_lora_rank),
            "mlp.experts.experts.linear_fc2.weight": (geo.experts, geo.hidden, ds.moe_ffn)}
    last = geo.layers - 1
    for suffix, shape in want.items():
        own, stacked = shapes.get(f"decoder.layers.{last}.{suffix}"), shapes.get(f"decoder.layers.{suffix}")
        got = tuple(own) if own is not None else tuple(stacked[1:]) if stacked is not None else None
        if got != shape:
            raise HFError(f"{where}: decoder.layers.{last}.{suffix} has shape {got}, but the saved flags (heads, "
                          f"hidden size, the MLA and expert flags) make it {shape}")


def deepseek_config(geo, dtype: str) -> dict:
    """config.json of the DeepseekV3ForCausalLM that computes what megatron-core computed."""
    ds: DeepSeek = geo.deepseek
    return {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": geo.vocab,
            "tie_word_embeddings": geo.tied, "dtype": dtype, "torch_dtype": dtype, "hidden_size": geo.hidden,
            "intermediate_size": geo.ffn, "moe_intermediate_size": ds.moe_ffn, "num_hidden_layers": geo.layers,
            "num_attention_heads": geo.heads, "num_key_value_heads": geo.heads, "n_shared_experts": ds.shared_experts,
            "n_routed_experts": geo.experts, "num_experts_per_tok": geo.topk, "routed_scaling_factor": ds.scaling,
            "kv_lora_rank": ds.kv_lora_rank, "q_lora_rank": ds.q_lora_rank, "qk_rope_head_dim": ds.qk_rope_dim,
            "v_head_dim": ds.v_head_dim, "qk_nope_head_dim": ds.qk_nope_dim, "n_group": ds.groups,
            "topk_group": ds.group_topk, "first_k_dense_replace": ds.dense_layers, "norm_topk_prob": geo.topk > 1,
            "hidden_act": "silu", "max_position_embeddings": geo.max_positions, "rms_norm_eps": geo.norm_eps,
            "rope_parameters": dict(ds.rope), "rope_interleave": True, "attention_bias": False,
            "attention_dropout": 0.0, "num_nextn_predict_layers": 0, "output_router_logits": False}


# ----- import: config.json -> DeepSeek -----

def _rope_from_config(config: dict, where: str) -> dict:
    rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {"rope_type": "default"})
    rope.setdefault("rope_theta", config.get("rope_theta", ROPE_BASE))
    kind = rope.get("rope_type") or rope.get("type") or "default"
    if float(rope["rope_theta"]) != ROPE_BASE:
        raise HFError(f"{where}: rope_theta {rope['rope_theta']!r}: the DeepseekV3 import keeps megatron-core's "
                      f"default rotary base {ROPE_BASE:g} (it prints no --rotary-base)")
    if kind == "default":
        return {"rope_type": "default", "rope_theta": ROPE_BASE}
    if kind != "yarn":
        raise HFError(f"{where}: rope_type {kind!r}: multi-latent attention runs rope or yarn")
    bad = [f"{k} is {rope.get(k, v)!r} (pretrain_gpt.py has no flag for it: megatron-core's {v!r})"
           for k, v in YARN_DEFAULTS.items() if float(rope.get(k, v)) != float(v)]
    bad += [f"{k} is {rope[k]!r} (needs {v!r})" for k, v in (("attention_factor", None), ("truncate", True))
            if rope.get(k, v) != v]
    all_dim = float(rope.get("mscale_all_dim") or 0.0)
    mscale = float(rope.get("mscale") or 1.0) if all_dim else 1.0  # transformers ignores mscale without all_dim
    if not rope.get("mscale") and all_dim:
        bad.append("mscale unset with mscale_all_dim set (transformers then ignores mscale_all_dim for the "
                   "rotary scale, megatron-core does not)")
    if bad:
        raise HFError(f"{where}: YaRN rope_parameters with no exact pretrain_gpt.py equivalent: {'; '.join(bad)}")
    return {"rope_type": "yarn", "factor": float(rope["factor"]), "mscale": mscale, "mscale_all_dim": all_dim,
            "original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0, "rope_theta": ROPE_BASE}


def deepseek_from_config(config: dict, where: str) -> DeepSeek:
    """The DeepSeek part of a DeepseekV3 config.json; refuses what pretrain_gpt.py does not compute, by key."""
    heads, topk = config["num_attention_heads"], config.get("num_experts_per_tok", 8)
    n_group, topk_group = config.get("n_group") or 1, config.get("topk_group") or 1
    checks = {"hidden_act": ("silu", "silu"), "attention_bias": (False, False), "pretraining_tp": (1, 1),
              "rope_interleave": (True, True), "num_key_value_heads": (heads, heads),
              "rms_norm_eps": (1e-6, LATENT_NORM_EPS), "norm_topk_prob": (True, topk > 1)}
    bad = [f"{k} is {config.get(k, d)!r} (needs {need!r})" for k, (d, need) in checks.items()
           if config.get(k, d) != need]
    layers, dense = config["num_hidden_layers"], config.get("first_k_dense_replace", 3)
    if not 0 <= dense < layers:
        bad.append(f"first_k_dense_replace {dense} (needs at least one MoE layer of {layers})")
    if config.get("n_shared_experts", 1) < 1:
        bad.append("n_shared_experts is 0 (megatron-core's DeepSeek layers need a shared expert)")
    if n_group > 1 and (topk // topk_group != 2 or config.get("n_routed_experts", 256) % n_group):
        bad.append(f"n_group {n_group} with topk_group {topk_group} and num_experts_per_tok {topk} (megatron-core "
                   f"scores a group by its top num_experts_per_tok / topk_group experts, transformers by its top 2)")
    if bad:
        raise HFError(f"{where}: this deepseek_v3 model has no exact equivalent in pretrain_gpt.py: {'; '.join(bad)}")
    return DeepSeek(q_lora_rank=config.get("q_lora_rank"), kv_lora_rank=config["kv_lora_rank"],
                    qk_nope_dim=config["qk_nope_head_dim"], qk_rope_dim=config["qk_rope_head_dim"],
                    v_head_dim=config["v_head_dim"], dense_layers=dense, moe_ffn=config["moe_intermediate_size"],
                    shared_experts=config.get("n_shared_experts", 1), groups=n_group, group_topk=topk_group,
                    scaling=float(config.get("routed_scaling_factor", 2.5)), expert_bias=True,
                    rope=tuple(sorted(_rope_from_config(config, where).items())))


def deepseek_flags(geo) -> list:
    """The pretrain_gpt.py flags of the multi-latent attention and routing of a DeepSeek geometry."""
    ds: DeepSeek = geo.deepseek
    rope = dict(ds.rope)
    flags = ["--multi-latent-attention", "--kv-lora-rank", ds.kv_lora_rank, "--qk-head-dim", ds.qk_nope_dim,
             "--qk-pos-emb-head-dim", ds.qk_rope_dim, "--v-head-dim", ds.v_head_dim, "--qk-layernorm"]
    if ds.q_lora_rank is not None:
        flags += ["--q-lora-rank", ds.q_lora_rank]
    if rope["rope_type"] == "yarn":
        flags += ["--rope-type", "yarn", "--rotary-scaling-factor", rope["factor"], "--mscale", rope["mscale"],
                  "--mscale-all-dim", rope["mscale_all_dim"]]
    else:
        flags += ["--rope-type", "rope"]
    pattern = "[" + ",".join(["0"] * ds.dense_layers + ["1"] * (geo.layers - ds.dense_layers)) + "]"
    flags += ["--moe-layer-freq", pattern, "--moe-shared-expert-intermediate-size", ds.shared_experts * ds.moe_ffn,
              "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
              "--moe-router-load-balancing-type", "none", "--moe-router-topk-scaling-factor", ds.scaling]
    if ds.groups > 1:
        flags += ["--moe-router-num-groups", ds.groups, "--moe-router-group-topk", ds.group_topk]
    return flags
