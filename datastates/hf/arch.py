"""Which transformers architecture a run is, read from its saved flags (export) or a config.json (import), and
what the converter asks of it: the registered architectures (datastates/hf/architectures/) do the rest.

A model is exported only when a transformers class computes exactly what megatron-core computed: every flag
that changes the computation is checked, and anything else is refused with what differs for each candidate.
The same checks run the other way for a config.json, which becomes the pretrain_gpt.py flags of that
architecture.
"""
from __future__ import annotations

from . import HFError, saved_flag
from .architectures import REGISTERED
from .geometry import Geometry
from .mapping import Rule


def architecture_of(args, where: str, drop_mtp: bool = False):
    """The registered architecture that computes exactly what a run with these flags computes, from the flags
    alone (the trainer's --save-hf asks this at start-up, before any work); HFError naming what differs."""
    if args is None:
        raise HFError(f"{where} has no saved `args` (a model-only checkpoint?): its architecture cannot be read "
                      f"from it; convert a checkpoint written by pretrain_gpt.py or by --from hf")
    mtp = saved_flag(args, "mtp_num_layers")
    if mtp and not drop_mtp:
        raise HFError(f"{where}: --mtp-num-layers {mtp}: transformers has no multi-token prediction module "
                      f"(DeepseekV3's config counts MTP layers but builds none); export with --drop-mtp to leave "
                      f"those layers out (the main model's logits are exact without them)")
    if saved_flag(args, "apply_layernorm_1p"):
        raise HFError(f"{where}: --apply-layernorm-1p: its norms scale by 1 + weight (a zero-centred gamma), and no "
                      f"transformers architecture here does (theirs scale by the weight; adding 1 would round the "
                      f"weights in bf16)")
    kind = ("mla" if saved_flag(args, "multi_latent_attention") else
            "moe" if saved_flag(args, "num_experts") else "dense")
    found = {arch: arch.differences(args) for arch in REGISTERED.values() if arch.kind == kind}
    for arch, diffs in found.items():
        if not diffs:
            return arch
    raise HFError(f"{where}: no transformers architecture computes this model exactly.\n" + "\n".join(
        f"  {arch.label} ({arch.hf_class}) differs: {'; '.join(diffs)}" for arch, diffs in found.items()))


def geometry_from_args(args, shapes: dict[str, tuple], where: str, drop_mtp: bool = False) -> Geometry:
    """The architecture of a checkpoint from its saved flags, checked against its tensors' shapes (`drop_mtp`:
    leave out the multi-token prediction layers of the run)."""
    return architecture_of(args, where, drop_mtp).geometry(args, shapes, where)


def geometry_from_config(config: dict, where: str) -> Geometry:
    kind = config.get("model_type")
    if kind not in REGISTERED:
        raise HFError(f"{where}: model_type {kind!r} is not supported ({', '.join(REGISTERED)} are; see "
                      f"docs/huggingface.md)")
    return REGISTERED[kind].from_config(config, where)


def hf_config(geo: Geometry, dtype: str) -> dict:
    """config.json of the transformers model that computes what megatron-core computed."""
    return REGISTERED[geo.arch].config(geo, dtype)


def rules_for(geo: Geometry, present=()) -> list[Rule]:
    """The name mapping of `geo`'s architecture (`present`: the checkpoint's tensor names, where it depends on how
    megatron-core laid the layers out)."""
    return REGISTERED[geo.arch].rules(geo, present)


def extra_state_objects(geo: Geometry) -> dict[str, tuple[int, ...]]:
    """The `_extra_state` objects of megatron-core's linear layers (None for the local implementation), which its
    model state dict holds and a load into the model expects: key -> its grid."""
    return REGISTERED[geo.arch].extra_state(geo)


def megatron_flags(geo: Geometry, divisible_by: int) -> list[str]:
    """The pretrain_gpt.py model flags of this architecture."""
    flags = ["--num-layers", geo.layers, "--hidden-size", geo.hidden, "--ffn-hidden-size", geo.ffn,
             "--num-attention-heads", geo.heads, "--max-position-embeddings", geo.max_positions,
             "--norm-epsilon", geo.norm_eps, "--vocab-size", geo.vocab, "--make-vocab-size-divisible-by",
             divisible_by]
    if geo.groups != geo.heads:
        flags += ["--group-query-attention", "--num-query-groups", geo.groups]
    flags += REGISTERED[geo.arch].flags(geo)
    if not geo.bias:
        flags.append("--disable-bias-linear")
    if not geo.tied:
        flags.append("--untie-embeddings-and-output-weights")
    return [str(f) for f in flags]
