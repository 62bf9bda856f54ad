"""--log-throughput's FLOPs against PyTorch's own count.

Each model is the trainer's real megatron-core model (pretrain_gpt.model_provider) on one CPU rank (a gloo world
of 1). One forward of a micro-batch of mock data, as the trainer runs it (labels and loss mask), is counted by
torch.utils.flop_counter.FlopCounterMode, which sees every matrix multiply really run: the experts' on the
tokens really routed to them. Forward and backward is three forwards, so 3x its count must equal
flops_per_iteration for one micro-batch exactly.
"""
from __future__ import annotations

import pytest

from megatron_helpers import TINY
from test_deepseek import DEEPSEEK
from test_moe import MIXTRAL

ONE_RANK = TINY + ["--global-batch-size", "2", "--train-iters", "1", "--make-vocab-size-divisible-by", "64",
                   "--position-embedding-type", "rope", "--disable-bias-linear"]
LLAMA = ONE_RANK + ["--normalization", "RMSNorm", "--swiglu", "--untie-embeddings-and-output-weights",
                    "--ffn-hidden-size", "96", "--group-query-attention", "--num-query-groups", "2"]
# the other branches: GELU, an MoE layer every 2nd (an int), MLA with one full query projection, two MTP layers
# over a dense last layer
OTHER = ONE_RANK + ["--num-experts", "4", "--moe-layer-freq", "2", "--multi-latent-attention", "--kv-lora-rank", "16",
                    "--qk-head-dim", "16", "--qk-pos-emb-head-dim", "8", "--v-head-dim", "16", "--mtp-num-layers", "2"]
MODELS = {"dense_gqa_swiglu": LLAMA, "mixtral_top2_of_4": MIXTRAL, "deepseek_mla_shared_expert_mtp": DEEPSEEK,
          "gelu_moe_every_2nd_mla_full_queries_2_mtp": OTHER}


@pytest.fixture
def model_and_batch(gloo, request):
    """(args, the model in train mode, its first micro-batch) for the flags of `request.param`."""
    import pretrain_gpt
    from megatron.training import get_tokenizer
    from megatron.training.data import MicroBatches, build_train_valid_test_datasets
    from megatron.training.initialize import initialize_megatron, shutdown_distributed
    args = initialize_megatron(argv=MODELS[request.param])
    try:
        model = pretrain_gpt.model_provider()
        batch = next(MicroBatches(build_train_valid_test_datasets(args)[0], 0, args.micro_batch_size, 0, 1,
                                  vocab_size=get_tokenizer().vocab_size))
        yield args, model, batch
    finally:
        shutdown_distributed(args)
        forget_mtp_losses()


def forget_mtp_losses() -> None:
    """megatron-core's MTP loss tracker is process-wide, sized by the first model's MTP depth: emptied for the next."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper
    MTPLossLoggingHelper.tracker.clear()


def counted_forward_flops(model, batch) -> int:
    from torch.utils.flop_counter import FlopCounterMode
    with FlopCounterMode(display=False) as counter:
        model(batch["tokens"], batch["position_ids"], batch.get("attention_mask"), labels=batch["labels"],
              loss_mask=batch["loss_mask"])
    return counter.get_total_flops()


@pytest.mark.parametrize("model_and_batch", sorted(MODELS), indirect=True)
def test_flops_per_iteration_is_three_times_what_pytorch_counts_in_a_forward(model_and_batch):
    from megatron.training.measures import flops_per_iteration
    args, model, batch = model_and_batch
    assert batch["tokens"].shape == (args.micro_batch_size, args.seq_length)
    counted = counted_forward_flops(model, batch)
    assert counted > 0
    assert flops_per_iteration(args, args.micro_batch_size) == 3 * counted
