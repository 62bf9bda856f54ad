"""Multi-latent attention (DeepSeek's MLA, Megatron-LM's flags): megatron-core's `MLATransformerConfig` and the MLA
layer spec of its GPT layer specs (`MLASelfAttention`: low-rank query and key/value projections, each head's
rotary part kept apart). Imports neither torch nor megatron-core: argument validation uses it.
"""
from __future__ import annotations

ROPE_TYPES = ("rope", "yarn")
# The flags that shape the weights or the function of the model (--use-checkpoint-args takes them).
ARCHITECTURE = ("multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim",
                "v_head_dim", "rope_type", "rotary_scaling_factor", "mscale", "mscale_all_dim")
# The flags that only mean something with --multi-latent-attention: (name, value when unset).
_MLA_ONLY = (("q_lora_rank", None), ("kv_lora_rank", 32), ("qk_head_dim", 128), ("qk_pos_emb_head_dim", 64),
             ("v_head_dim", 128), ("rope_type", None), ("rotary_scaling_factor", 1.0), ("mscale", 1.0),
             ("mscale_all_dim", 0.0))


def add_mla_args(parser) -> None:
    g = parser.add_argument_group("multi-latent attention")
    g.add_argument("--multi-latent-attention", action="store_true",
                   help="DeepSeek's multi-latent attention (megatron-core's MLASelfAttention)")
    g.add_argument("--q-lora-rank", type=int, default=None, help="the queries' low rank [none: a full projection]")
    g.add_argument("--kv-lora-rank", type=int, default=32, help="the keys' and values' low rank")
    g.add_argument("--qk-head-dim", type=int, default=128, help="each query/key head's part without positions")
    g.add_argument("--qk-pos-emb-head-dim", type=int, default=64, help="each query/key head's rotary part")
    g.add_argument("--v-head-dim", type=int, default=128, help="each value head's width")
    g.add_argument("--rope-type", choices=ROPE_TYPES, default=None,
                   help="the rotary embedding of multi-latent attention [yarn]; standard attention runs rope")
    g.add_argument("--rotary-scaling-factor", type=float, default=1.0, help="YaRN's scaling factor (MLA)")
    g.add_argument("--mscale", type=float, default=1.0, help="YaRN's mscale (MLA)")
    g.add_argument("--mscale-all-dim", type=float, default=0.0, help="YaRN's mscale_all_dim (MLA)")


def validate_mla(args, cuda: bool) -> None:
    """The MLA flags against each other and the device; raises ValueError naming the flag first."""
    if not args.multi_latent_attention:
        for name, unset in _MLA_ONLY:
            value = getattr(args, name)
            if value != unset and not (name == "rope_type" and value == "rope"):  # rope: what standard attention runs
                raise ValueError(f"--{name.replace('_', '-')} applies to multi-latent attention: it needs "
                                 "--multi-latent-attention (YaRN for standard attention is not built here)")
        return
    for name in ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "q_lora_rank"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {value}")
    if args.group_query_attention:
        raise ValueError("--group-query-attention and --multi-latent-attention exclude each other: MLA shares its "
                         "keys and values through the --kv-lora-rank latent instead")
    if args.kv_channels is not None and args.kv_channels != args.v_head_dim:
        raise ValueError(f"--kv-channels {args.kv_channels}: with --multi-latent-attention each head's output is "
                         f"--v-head-dim {args.v_head_dim} wide (megatron-core's local attention shapes it by "
                         "kv_channels): give the same value or drop it")
    if cuda and args.transformer_impl != "transformer_engine":
        raise ValueError("--multi-latent-attention with --transformer-impl local on CUDA ranks: megatron-core's MLA "
                         "passes its head widths to the core attention, which only Transformer Engine's takes (CPU "
                         "ranks adapt the local one); use --transformer-impl transformer_engine")
    if args.sequence_parallel and not cuda:
        raise ValueError("--sequence-parallel with --multi-latent-attention on CPU ranks: megatron-core's torch norms "
                         "of the query and key/value latents refuse sequence parallelism (they need apex or "
                         "Transformer Engine); use tensor parallelism 1 there")
    args.kv_channels = args.v_head_dim
    if args.rope_type is None:
        args.rope_type = "yarn"  # upstream's default for MLA


def mla_config_kwargs(args) -> dict:
    """MLATransformerConfig's MLA fields from the flags (nothing without multi-latent attention)."""
    if not args.multi_latent_attention:
        return {}
    return dict(multi_latent_attention=True, q_lora_rank=args.q_lora_rank, kv_lora_rank=args.kv_lora_rank,
                qk_head_dim=args.qk_head_dim, qk_pos_emb_head_dim=args.qk_pos_emb_head_dim,
                v_head_dim=args.v_head_dim, rope_type=args.rope_type, rotary_base=args.rotary_base,
                rotary_percent=args.rotary_percent, rotary_scaling_factor=args.rotary_scaling_factor,
                mscale=args.mscale, mscale_all_dim=args.mscale_all_dim)


def mark_missing_te() -> None:
    """megatron-core 0.16.1 without Transformer Engine: `multi_latent_attention` sets HAVE_TE from an import that
    succeeds without TE (its TE names are placeholders, not classes), so building MLA fails in `isinstance(...,
    TELinear)`. 0.19 takes HAVE_TE from its TE extension; this sets it False where TELinear is no class (nothing
    changes where TE is installed)."""
    from megatron.core.transformer import multi_latent_attention as mla
    if not isinstance(getattr(mla, "TELinear", None), type):
        mla.HAVE_TE = False
