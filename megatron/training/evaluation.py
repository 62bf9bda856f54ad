"""--eval-interval / --eval-iters: the loss on the validation (and, at the end, test) split, forward only.

As upstream, each evaluation runs --eval-iters iterations of the full --global-batch-size, and successive
evaluations read successive validation samples. Where they start is a function of the iteration (the k-th
evaluation reads from sample (k - 1) x eval-iters x global batch size), so a resumed run evaluates exactly the
samples an uninterrupted one does without any state in the checkpoint. Evaluation runs in eval mode under
`torch.no_grad()`: no dropout, no RNG drawn, nothing the checkpoint holds is touched.
"""
from __future__ import annotations

import math

import torch

from megatron.core import parallel_state as ps

from .data import MicroBatches
from .virtual_pipeline import data_iterators


def evaluations_before(args, iteration: int) -> int:
    """How many periodic evaluations an uninterrupted run did before the one at `iteration`."""
    return (iteration - 1) // args.eval_interval if args.eval_interval else 0


def evaluate(args, model, forward_step_func, dataset, first_sample: int, *, vocab_size: int, what: str) -> list:
    """The losses each micro-batch of --eval-iters forward-only iterations over `dataset` from `first_sample`
    reports (on the last pipeline stage; [] on the others)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func
    dp = ps.get_data_parallel_world_size()
    num_microbatches = args.global_batch_size // (args.micro_batch_size * dp)
    batches = MicroBatches(dataset, first_sample, args.micro_batch_size, ps.get_data_parallel_rank(), dp,
                           vocab_size=vocab_size, device=args.device, what=what,
                           causal_mask=args.create_attention_mask_in_dataloader)
    reported = []
    for chunk in model:
        chunk.eval()
    try:
        with torch.no_grad():
            for _ in range(args.eval_iters):
                data = data_iterators([next(batches) for _ in range(num_microbatches)], model)
                reported += get_forward_backward_func()(
                    forward_step_func=forward_step_func, data_iterator=data, model=model,
                    num_microbatches=num_microbatches, seq_length=args.seq_length,
                    micro_batch_size=args.micro_batch_size, forward_only=True)
    finally:
        for chunk in model:
            chunk.train()
    return reported if ps.is_pipeline_last_stage() else []


def describe(losses: dict, where: str) -> str:
    """Upstream's validation line: each loss and its perplexity."""
    line = f" validation loss at {where} |"
    for k, v in losses.items():
        line += f" {k} value: {v!r} | {k} PPL: {math.exp(min(20.0, v)):.6E} |"
    return line
