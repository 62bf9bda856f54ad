"""Which transformers architecture a run is, read from its saved flags (export) or a config.json (import).

A model is exported only when a transformers class computes exactly what megatron-core computed: every flag
that changes the computation is checked, and anything else is refused with what differs. The same checks run
the other way for a config.json, which becomes the pretrain_gpt.py flags of that architecture.
"""
from __future__ import annotations

from dataclasses import dataclass

from . import HFError, saved_flag
from .deepseek import (DeepSeek, check_deepseek_shapes, deepseek_config, deepseek_flags, deepseek_from_args,
                       deepseek_from_config)

ROPE_BASE = 10000.0  # megatron-core's RotaryEmbedding default; this trainer has no --rotary-base flag


@dataclass(frozen=True)
class Geometry:
    """The sizes every name mapping and tensor split needs."""
    arch: str  # "llama", "mixtral", "gpt2" or "deepseek_v3"
    layers: int
    hidden: int
    ffn: int
    heads: int
    groups: int  # query groups (key/value heads)
    head_dim: int
    vocab: int  # the real vocabulary (transformers' vocab_size)
    bias: bool  # biases on every linear layer
    tied: bool  # output layer shares the word embedding
    max_positions: int
    norm_eps: float
    experts: int = 0  # routed experts per layer (Mixtral); 0: dense MLPs
    topk: int = 0  # experts per token
    aux_loss: float = 0.0  # weight of the load-balancing loss (a training choice both sides carry)
    deepseek: DeepSeek | None = None  # multi-latent attention, dense then MoE layers, shared experts (deepseek.py)


# ----- export: saved flags -> geometry -----

_get = saved_flag


def _differences(args, wanted: dict) -> list[str]:
    return [f"{flag} is {_get(args, attr)!r} (needs {need!r})" for flag, (attr, need) in wanted.items()
            if _get(args, attr) != need]


def _llama_differences(args) -> list[str]:
    return _differences(args, {"--position-embedding-type": ("position_embedding_type", "rope"),
                               "--rotary-percent": ("rotary_percent", 1.0),
                               "--normalization": ("normalization", "RMSNorm"),
                               "--swiglu": ("swiglu", True)})


def _gpt2_differences(args) -> list[str]:
    diffs = _differences(args, {"--position-embedding-type": ("position_embedding_type", "learned_absolute"),
                                "--normalization": ("normalization", "LayerNorm"),
                                "--swiglu": ("swiglu", False),
                                "--disable-bias-linear": ("disable_bias_linear", False)})
    if _get(args, "group_query_attention") and _get(args, "num_query_groups") != _get(args, "num_attention_heads"):
        diffs.append("--group-query-attention with fewer query groups than heads (GPT-2 has one key/value head "
                     "per query head)")
    kv, h, n = _get(args, "kv_channels"), _get(args, "hidden_size"), _get(args, "num_attention_heads")
    if kv is not None and kv * n != h:
        diffs.append(f"--kv-channels {kv} (GPT-2's head size is hidden size / heads = {h // n})")
    return diffs


# MoE flags whose values transformers' Mixtral computes (anything else is refused, by name): its router takes the
# softmax of the top-k logits (a softmax over all then the top k, renormalised: the same), every layer MoE.
MIXTRAL_MOE = {"--moe-router-score-function": ("moe_router_score_function", "softmax"),
               "--moe-router-pre-softmax": ("moe_router_pre_softmax", False),
               "--moe-shared-expert-intermediate-size": ("moe_shared_expert_intermediate_size", None),
               "--moe-router-enable-expert-bias (aux-loss-free balancing)": ("moe_router_enable_expert_bias", False),
               "--moe-router-num-groups": ("moe_router_num_groups", None),
               "--moe-router-group-topk": ("moe_router_group_topk", None),
               "--moe-router-topk-scaling-factor": ("moe_router_topk_scaling_factor", None),
               "--moe-expert-capacity-factor": ("moe_expert_capacity_factor", None),
               "--moe-input-jitter-eps": ("moe_input_jitter_eps", None),
               "--disable-bias-linear (Mixtral has no biases)": ("disable_bias_linear", True)}


def _mixtral_differences(args) -> list[str]:
    diffs = _llama_differences(args) + _differences(args, MIXTRAL_MOE)
    freq = _get(args, "moe_layer_freq", 1)
    if freq != 1 and not (isinstance(freq, list) and all(v == 1 for v in freq)):
        diffs.append(f"--moe-layer-freq is {freq!r} (Mixtral has experts in every layer: needs 1)")
    if _get(args, "moe_router_load_balancing_type") == "sinkhorn":
        diffs.append("--moe-router-load-balancing-type is 'sinkhorn' (it routes by Sinkhorn in training and by "
                     "sigmoid scores for top-1; Mixtral routes by the softmax of the top-k logits)")
    return diffs


def _refuse_unsupported(args, where: str) -> None:
    """Flags of features no exported architecture has (future flags of this trainer included)."""
    for flag, attr in (("--qk-layernorm", "qk_layernorm"), ("--rotary-base", "rotary_base")):
        value = _get(args, attr)
        if value not in (None, False) and not (attr == "rotary_base" and value == ROPE_BASE):
            raise HFError(f"{where}: {flag} {value!r} has no exact transformers equivalent in this converter "
                          f"(see docs/huggingface.md)")


def geometry_from_args(args, shapes: dict[str, tuple], where: str, drop_mtp: bool = False) -> Geometry:
    """The architecture of a checkpoint from its saved flags, checked against its tensors' shapes (`drop_mtp`:
    leave out the multi-token prediction layers of the run)."""
    if args is None:
        raise HFError(f"{where} has no saved `args` (a model-only checkpoint?): its architecture cannot be read "
                      f"from it; convert a checkpoint written by pretrain_gpt.py or by --from hf")
    mtp = _get(args, "mtp_num_layers")
    if mtp and not drop_mtp:
        raise HFError(f"{where}: --mtp-num-layers {mtp}: transformers has no multi-token prediction module "
                      f"(DeepseekV3's config counts MTP layers but builds none); export with --drop-mtp to leave "
                      f"those layers out (the main model's logits are exact without them)")
    if _get(args, "multi_latent_attention"):
        return _deepseek_geometry(args, shapes, where)
    _refuse_unsupported(args, where)
    if _get(args, "num_experts"):
        return _mixtral_geometry(args, shapes, where)
    llama, gpt2 = _llama_differences(args), _gpt2_differences(args)
    if llama and gpt2:
        raise HFError(f"{where}: no transformers architecture computes this model exactly.\n"
                      f"  Llama (LlamaForCausalLM) differs: {'; '.join(llama)}\n"
                      f"  GPT-2 (GPT2LMHeadModel) differs: {'; '.join(gpt2)}")
    return _geometry("llama" if not llama else "gpt2", args, shapes, "decoder.layers.mlp.linear_fc2.weight", where)


def _mixtral_geometry(args, shapes: dict, where: str) -> Geometry:
    diffs = _mixtral_differences(args)
    if diffs:
        raise HFError(f"{where}: this mixture-of-experts model has no exact transformers equivalent; Mixtral "
                      f"(MixtralForCausalLM) differs: {'; '.join(diffs)}")
    return _geometry("mixtral", args, shapes, "decoder.layers.mlp.experts.experts.linear_fc2.weight", where,
                     experts=_get(args, "num_experts"), topk=_get(args, "moe_router_topk"),
                     aux_loss=float(_get(args, "moe_aux_loss_coeff") or 0.0))


def _vocab(args, where: str) -> int:
    """The run's real vocabulary: --vocab-size, or its tokenizer's, which this trainer saves beside the flags."""
    vocab = _get(args, "vocab_size") or _get(args, "tokenizer_vocab_size")
    if not vocab:
        raise HFError(f"{where}: the saved flags hold no vocabulary size (--vocab-size unset with --tokenizer-type "
                      f"{_get(args, 'tokenizer_type')}, and no tokenizer_vocab_size, which this trainer saves): the "
                      f"padded rows of the embedding cannot be told from the real ones")
    return vocab


def _deepseek_geometry(args, shapes: dict, where: str) -> Geometry:
    ds = deepseek_from_args(args, where)
    heads = _get(args, "num_attention_heads")
    if "embedding.word_embeddings.weight" not in shapes:
        raise HFError(f"{where} lacks the model weight embedding.word_embeddings.weight")
    geo = Geometry(arch="deepseek_v3", layers=_get(args, "num_layers"), hidden=_get(args, "hidden_size"),
                   ffn=_get(args, "ffn_hidden_size"), heads=heads, groups=heads, head_dim=ds.v_head_dim,
                   vocab=_vocab(args, where), bias=False,
                   tied=not _get(args, "untie_embeddings_and_output_weights"),
                   max_positions=_get(args, "max_position_embeddings") or _get(args, "seq_length"),
                   norm_eps=_get(args, "norm_epsilon"), experts=_get(args, "num_experts"),
                   topk=_get(args, "moe_router_topk"), deepseek=ds)
    _check_embedding(geo, shapes, where)
    check_deepseek_shapes(geo, shapes, where)
    return geo


def _geometry(arch: str, args, shapes: dict, fc2_key: str, where: str, **moe) -> Geometry:
    """The sizes from the saved flags; the MLP's hidden size from the tensor `fc2_key` (its last axis)."""
    heads = _get(args, "num_attention_heads")
    groups = _get(args, "num_query_groups") if _get(args, "group_query_attention") else heads
    hidden = _get(args, "hidden_size")
    fc2 = shapes.get(fc2_key)
    if fc2 is None or "embedding.word_embeddings.weight" not in shapes:
        raise HFError(f"{where} lacks the model weights {fc2_key} / embedding.word_embeddings.weight (stacked over "
                      f"layers, as megatron-core saves them)")
    geo = Geometry(arch=arch, layers=_get(args, "num_layers"), hidden=hidden, ffn=fc2[-1], heads=heads,
                   groups=groups, head_dim=_get(args, "kv_channels") or hidden // heads,
                   vocab=_vocab(args, where), bias=not _get(args, "disable_bias_linear"),
                   tied=not _get(args, "untie_embeddings_and_output_weights"),
                   max_positions=_get(args, "max_position_embeddings") or _get(args, "seq_length"),
                   norm_eps=_get(args, "norm_epsilon"), **moe)
    _check_shapes(geo, shapes, where)
    return geo


def _check_shapes(geo: Geometry, shapes: dict, where: str) -> None:
    qkv = shapes.get("decoder.layers.self_attention.linear_qkv.weight")
    want = (geo.layers, (geo.heads + 2 * geo.groups) * geo.head_dim, geo.hidden)
    if qkv != want:
        raise HFError(f"{where}: decoder.layers.self_attention.linear_qkv.weight has shape {qkv}, but the saved "
                      f"flags (layers, heads, query groups, kv channels, hidden size) make it {want}")
    router = shapes.get("decoder.layers.mlp.router.weight")
    if geo.experts and router != (geo.layers, geo.experts, geo.hidden):
        raise HFError(f"{where}: decoder.layers.mlp.router.weight has shape {router}, but the saved flags (layers, "
                      f"--num-experts, hidden size) make it {(geo.layers, geo.experts, geo.hidden)}")
    _check_embedding(geo, shapes, where)


def _check_embedding(geo: Geometry, shapes: dict, where: str) -> None:
    if shapes["embedding.word_embeddings.weight"][0] < geo.vocab:
        raise HFError(f"{where}: the word embedding has fewer rows than --vocab-size {geo.vocab}")


# ----- export: geometry -> config.json -----

def hf_config(geo: Geometry, dtype: str) -> dict:
    """config.json of the transformers model that computes what megatron-core computed."""
    if geo.arch == "deepseek_v3":
        return deepseek_config(geo, dtype)
    common = {"vocab_size": geo.vocab, "tie_word_embeddings": geo.tied, "dtype": dtype, "torch_dtype": dtype}
    llama_family = {**common, "hidden_size": geo.hidden, "intermediate_size": geo.ffn,
                    "num_hidden_layers": geo.layers, "num_attention_heads": geo.heads,
                    "num_key_value_heads": geo.groups, "head_dim": geo.head_dim, "hidden_act": "silu",
                    "max_position_embeddings": geo.max_positions, "rms_norm_eps": geo.norm_eps,
                    "rope_theta": ROPE_BASE, "rope_scaling": None,  # transformers 4; 5 reads rope_parameters
                    "rope_parameters": {"rope_type": "default", "rope_theta": ROPE_BASE}, "attention_dropout": 0.0}
    if geo.arch == "llama":
        return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **llama_family,
                "attention_bias": geo.bias, "mlp_bias": geo.bias}
    if geo.arch == "mixtral":
        return {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", **llama_family,
                "num_local_experts": geo.experts, "num_experts_per_tok": geo.topk, "sliding_window": None,
                "router_jitter_noise": 0.0, "router_aux_loss_coef": geo.aux_loss, "output_router_logits": False}
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", **common,
            "n_embd": geo.hidden, "n_inner": geo.ffn, "n_layer": geo.layers, "n_head": geo.heads,
            "n_positions": geo.max_positions, "layer_norm_epsilon": geo.norm_eps, "activation_function": "gelu",
            "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "scale_attn_weights": True,
            "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False}


# ----- import: config.json -> geometry -----

def _require(config: dict, where: str, checks: dict) -> None:
    bad = [f"{key} is {config.get(key, default)!r} (needs {need!r})" for key, (default, need) in checks.items()
           if config.get(key, default) != need]
    if bad:
        raise HFError(f"{where}: this {config.get('model_type')} model has no exact equivalent in pretrain_gpt.py: "
                      + "; ".join(bad))


def _rope_theta(config: dict) -> float:
    params = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or {}
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    return float(params.get("rope_theta") or config.get("rope_theta") or ROPE_BASE) if kind == "default" else kind


def _llama_family_geometry(config: dict, where: str, checks: dict, **moe) -> Geometry:
    _require(config, where, {"hidden_act": ("silu", "silu"), "partial_rotary_factor": (1.0, 1.0), **checks})
    if _rope_theta(config) != ROPE_BASE:
        raise HFError(f"{where}: RoPE {_rope_theta(config)!r} (theta or scaling): pretrain_gpt.py only has "
                      f"megatron-core's default RoPE, theta {ROPE_BASE:g} without scaling (no --rotary-base)")
    if config.get("attention_bias", False) != config.get("mlp_bias", False):
        raise HFError(f"{where}: attention_bias {config.get('attention_bias')} and mlp_bias "
                      f"{config.get('mlp_bias')} differ; --disable-bias-linear sets both at once")
    h, n = config["hidden_size"], config["num_attention_heads"]
    return Geometry(config["model_type"], config["num_hidden_layers"], h, config["intermediate_size"], n,
                    config.get("num_key_value_heads") or n, config.get("head_dim") or h // n,
                    config["vocab_size"], bool(config.get("attention_bias", False)),
                    bool(config.get("tie_word_embeddings", False)), config["max_position_embeddings"],
                    float(config.get("rms_norm_eps", 1e-6)), **moe)


def _mixtral_geometry_from_config(config: dict, where: str) -> Geometry:
    if config.get("num_experts_per_tok", 2) == 1:
        raise HFError(f"{where}: num_experts_per_tok 1: Mixtral then weighs the chosen expert by 1, megatron-core's "
                      f"top-1 softmax router needs --moe-router-pre-softmax, which weighs it by its probability")
    return _llama_family_geometry(config, where, {"sliding_window": (None, None), "router_jitter_noise": (0.0, 0.0)},
                                  experts=config.get("num_local_experts", 8), topk=config.get("num_experts_per_tok", 2),
                                  aux_loss=float(config.get("router_aux_loss_coef", 0.001)))


def geometry_from_config(config: dict, where: str) -> Geometry:
    kind = config.get("model_type")
    if kind == "llama":
        return _llama_family_geometry(config, where, {"pretraining_tp": (1, 1)})
    if kind == "mixtral":
        return _mixtral_geometry_from_config(config, where)
    if kind == "gpt2":
        _require(config, where, {"activation_function": ("gelu_new", "gelu"),
                                 "scale_attn_by_inverse_layer_idx": (False, False),
                                 "scale_attn_weights": (True, True)})
        h = config["n_embd"]
        return Geometry("gpt2", config["n_layer"], h, config.get("n_inner") or 4 * h, config["n_head"],
                        config["n_head"], h // config["n_head"], config["vocab_size"], True,
                        bool(config.get("tie_word_embeddings", True)), config["n_positions"],
                        float(config.get("layer_norm_epsilon", 1e-5)))
    if kind == "deepseek_v3":
        return _deepseek_geometry_from_config(config, where)
    raise HFError(f"{where}: model_type {kind!r} is not supported (llama, mixtral, gpt2 and deepseek_v3 are; see "
                  f"docs/huggingface.md)")


def _deepseek_geometry_from_config(config: dict, where: str) -> Geometry:
    ds = deepseek_from_config(config, where)
    heads = config["num_attention_heads"]
    return Geometry("deepseek_v3", config["num_hidden_layers"], config["hidden_size"], config["intermediate_size"],
                    heads, heads, ds.v_head_dim, config["vocab_size"], False,
                    bool(config.get("tie_word_embeddings", False)), config["max_position_embeddings"],
                    float(config.get("rms_norm_eps", 1e-6)), experts=config.get("n_routed_experts", 256),
                    topk=config.get("num_experts_per_tok", 8), deepseek=ds)


def megatron_flags(geo: Geometry, divisible_by: int) -> list[str]:
    """The pretrain_gpt.py model flags of this architecture."""
    flags = ["--num-layers", geo.layers, "--hidden-size", geo.hidden, "--ffn-hidden-size", geo.ffn,
             "--num-attention-heads", geo.heads, "--max-position-embeddings", geo.max_positions,
             "--norm-epsilon", geo.norm_eps, "--vocab-size", geo.vocab, "--make-vocab-size-divisible-by",
             divisible_by]
    if geo.groups != geo.heads:
        flags += ["--group-query-attention", "--num-query-groups", geo.groups]
    if geo.head_dim * geo.heads != geo.hidden and geo.deepseek is None:  # MLA's is --v-head-dim
        flags += ["--kv-channels", geo.head_dim]
    if geo.arch in ("llama", "mixtral", "deepseek_v3"):
        flags += ["--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu"]
    if geo.deepseek is not None:
        flags += ["--num-experts", geo.experts, "--moe-router-topk", geo.topk, "--moe-ffn-hidden-size",
                  geo.deepseek.moe_ffn, *deepseek_flags(geo)]
    elif geo.experts:
        flags += ["--num-experts", geo.experts, "--moe-router-topk", geo.topk, "--moe-ffn-hidden-size", geo.ffn,
                  "--moe-aux-loss-coeff", geo.aux_loss]
    if not geo.bias:
        flags.append("--disable-bias-linear")
    if not geo.tied:
        flags.append("--untie-embeddings-and-output-weights")
    return [str(f) for f in flags]
