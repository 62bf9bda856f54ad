"""Multi-token prediction (DeepSeek's MTP, Megatron-LM's flags): megatron-core's MTP block on the last pipeline
stage, built from its `get_gpt_mtp_block_spec` over the decoder's last layer spec.

The MTP loss is megatron-core's: `GPTModel` computes it from the labels and the loss mask (passed into the
model) and adds its gradient through `MTPLossAutoScaler`, whose scale megatron-core's schedules set; the main
loss function stays the language model's. `take_mtp_losses` reads the per-depth losses megatron-core tracked for
the log line and clears them. Flag handling imports neither torch nor megatron-core.
"""
from __future__ import annotations

ARCHITECTURE = ("mtp_num_layers",)
_UNSET_SCALING = 0.1


def add_mtp_args(parser) -> None:
    g = parser.add_argument_group("multi-token prediction")
    g.add_argument("--mtp-num-layers", type=int, default=None,
                   help="predict this many more future tokens, one MTP layer each (megatron-core's MTP block)")
    g.add_argument("--mtp-loss-scaling-factor", type=float, default=_UNSET_SCALING,
                   help="weight of the MTP losses (their mean over the depths) beside the main loss")


def validate_mtp(args, cuda: bool) -> None:
    """Raises ValueError naming the flag first."""
    if args.mtp_num_layers is None:
        if args.mtp_loss_scaling_factor != _UNSET_SCALING:
            raise ValueError("--mtp-loss-scaling-factor applies to multi-token prediction: it needs --mtp-num-layers")
        return
    if args.mtp_num_layers <= 0:
        raise ValueError(f"--mtp-num-layers must be positive, got {args.mtp_num_layers}")
    if args.sequence_parallel and not cuda:
        raise ValueError("--sequence-parallel with --mtp-num-layers on CPU ranks: the MTP layer's torch norms refuse "
                         "sequence parallelism (they need apex or Transformer Engine); use tensor parallelism 1 "
                         "there")


def mtp_config_kwargs(args) -> dict:
    if args.mtp_num_layers is None:
        return {}
    return dict(mtp_num_layers=args.mtp_num_layers, mtp_loss_scaling_factor=args.mtp_loss_scaling_factor)


def mtp_block_spec(args, config, decoder_spec, vp_stage):
    """megatron-core's MTP block spec for this chunk (None off the last stage, or without MTP)."""
    if args.mtp_num_layers is None:
        return None
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec
    return get_gpt_mtp_block_spec(config, decoder_spec,
                                  use_transformer_engine=args.transformer_impl == "transformer_engine",
                                  vp_stage=vp_stage)


# megatron-core 0.16 tracks the per-depth losses as "values", 0.19 as "loss_values" (beside its accuracy counts).
_TRACKED = ("values", "loss_values", "correct_values", "total_values")


def take_mtp_losses(num_microbatches: int, dp_group, dp_size: int) -> dict:
    """{"mtp_<d> loss": the iteration's mean MTP loss at depth d} over the data-parallel ranks, from megatron-core's
    tracker (last pipeline stage), which is cleared for the next iteration. gloo has no averaging all-reduce:
    a sum, divided."""
    import torch.distributed as dist
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper
    tracker = MTPLossLoggingHelper.tracker
    key = "loss_values" if "loss_values" in tracker else "values"
    if key not in tracker:
        return {}
    values = tracker[key].detach().float().clone() / num_microbatches
    if dp_size > 1:
        dist.all_reduce(values, group=dp_group)
        values /= dp_size
    for name in _TRACKED:
        if name in tracker:
            tracker[name].zero_()
    return {f"mtp_{depth + 1} loss": value.item() for depth, value in enumerate(values)}
