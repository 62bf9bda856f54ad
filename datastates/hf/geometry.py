"""The sizes and choices of a model that every architecture's names, splits and config need, and the checks of
saved flags and config.json keys the architectures share (datastates/hf/architectures/)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from . import HFError, saved_flag

if TYPE_CHECKING:
    from .architectures.deepseek_v3.flags import DeepSeek

ROPE_BASE = 10000.0  # megatron-core's RotaryEmbedding default (pretrain_gpt.py's --rotary-base default)


@dataclass(frozen=True)
class Geometry:
    """The sizes every name mapping and tensor split needs."""
    arch: str  # the registered architecture: transformers' model_type
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
    experts: int = 0  # routed experts per layer; 0: dense MLPs
    topk: int = 0  # experts per token
    aux_loss: float = 0.0  # weight of the load-balancing loss (a training choice both sides carry)
    deepseek: DeepSeek | None = None  # multi-latent attention, dense then MoE layers, shared experts (architectures/deepseek_v3/)
    rope_base: float = ROPE_BASE  # the rotary base (transformers' rope_theta)
    qkv_bias: bool = False  # biases on the query/key/value projections alone (--add-qkv-bias, Qwen2)
    qk_norm: bool = False  # per-head RMSNorm of queries and keys (--qk-layernorm, Qwen3)
    pre_softmax: bool = False  # top-k of the softmax over all experts, not renormalised (--moe-router-pre-softmax)


_get = saved_flag


def differences(args, wanted: dict) -> list[str]:
    """`flag is X (needs Y)` for each `flag: (attribute, Y)` the saved flags do not have (an unsaved boolean is
    off: checkpoints of older versions of this trainer lack the newer flags)."""
    out = []
    for flag, (attr, need) in wanted.items():
        value = _get(args, attr)
        if isinstance(need, bool):
            value = bool(value)
        if value != need:
            out.append(f"{flag} is {value!r} (needs {need!r})")
    return out


def require(config: dict, where: str, checks: dict) -> None:
    """Refuse a config.json whose `key` is not `need`, for each `key: (transformers' default, need)`, by key."""
    bad = [f"{key} is {config.get(key, default)!r} (needs {need!r})" for key, (default, need) in checks.items()
           if config.get(key, default) != need]
    if bad:
        raise HFError(f"{where}: this {config.get('model_type')} model has no exact equivalent in pretrain_gpt.py: "
                      + "; ".join(bad))


def vocab(args, where: str) -> int:
    """The run's real vocabulary: --vocab-size, or its tokenizer's, which this trainer saves beside the flags."""
    size = _get(args, "vocab_size") or _get(args, "tokenizer_vocab_size")
    if not size:
        raise HFError(f"{where}: the saved flags hold no vocabulary size (--vocab-size unset with --tokenizer-type "
                      f"{_get(args, 'tokenizer_type')}, and no tokenizer_vocab_size, which this trainer saves): the "
                      f"padded rows of the embedding cannot be told from the real ones")
    return size


def max_positions(args) -> int:
    return _get(args, "max_position_embeddings") or _get(args, "seq_length")


def check_embedding(geo: Geometry, shapes: dict, where: str) -> None:
    if shapes["embedding.word_embeddings.weight"][0] < geo.vocab:
        raise HFError(f"{where}: the word embedding has fewer rows than --vocab-size {geo.vocab}")


def rope_base(args) -> float:
    """The run's rotary base (--rotary-base; megatron-core's default where a run saved none)."""
    return float(_get(args, "rotary_base") or ROPE_BASE)


def has_bias(args) -> bool:
    """Biases on the linear layers: this trainer saves --disable-bias-linear as itself, upstream's parser as
    `add_bias_linear` (its checkpoints' args, read by tools/convert_checkpoint.py)."""
    return not _get(args, "disable_bias_linear") and _get(args, "add_bias_linear") is not False


def stacked_geometry(arch: str, args, shapes: dict, fc2_key: str, where: str, **more) -> Geometry:
    """The sizes of a model whose layers megatron-core stacks, from the saved flags; the MLP's hidden size from
    the tensor `fc2_key` (its last axis); checked against the tensors' shapes."""
    heads = _get(args, "num_attention_heads")
    groups = _get(args, "num_query_groups") if _get(args, "group_query_attention") else heads
    hidden = _get(args, "hidden_size")
    fc2 = shapes.get(fc2_key)
    if fc2 is None or "embedding.word_embeddings.weight" not in shapes:
        raise HFError(f"{where} lacks the model weights {fc2_key} / embedding.word_embeddings.weight (stacked over "
                      f"layers, as megatron-core saves them)")
    geo = Geometry(arch=arch, layers=_get(args, "num_layers"), hidden=hidden, ffn=fc2[-1], heads=heads,
                   groups=groups, head_dim=_get(args, "kv_channels") or hidden // heads,
                   vocab=vocab(args, where), bias=has_bias(args),
                   tied=not _get(args, "untie_embeddings_and_output_weights"), max_positions=max_positions(args),
                   norm_eps=_get(args, "norm_epsilon"), **more)
    _check_stacked_shapes(geo, shapes, where)
    return geo


def _check_stacked_shapes(geo: Geometry, shapes: dict, where: str) -> None:
    qkv = shapes.get("decoder.layers.self_attention.linear_qkv.weight")
    want = (geo.layers, (geo.heads + 2 * geo.groups) * geo.head_dim, geo.hidden)
    if qkv != want:
        raise HFError(f"{where}: decoder.layers.self_attention.linear_qkv.weight has shape {qkv}, but the saved "
                      f"flags (layers, heads, query groups, kv channels, hidden size) make it {want}")
    router = shapes.get("decoder.layers.mlp.router.weight")
    if geo.experts and router != (geo.layers, geo.experts, geo.hidden):
        raise HFError(f"{where}: decoder.layers.mlp.router.weight has shape {router}, but the saved flags (layers, "
                      f"--num-experts, hidden size) make it {(geo.layers, geo.experts, geo.hidden)}")
    check_embedding(geo, shapes, where)
