"""Training length, learning-rate schedule lengths and the batch-size ramp, counted as upstream Megatron-LM does.

Iteration-based runs (`--train-iters`) count the LR schedule in iterations x global batch size; sample-based runs
(`--train-samples`) in samples, with `--lr-decay-samples`, `--lr-warmup-samples` or `--lr-warmup-fraction`, and
may ramp the batch size up (`--rampup-batch-size START INCREMENT SAMPLES`). The ramp is megatron-core's
num-microbatches calculator: the batch size of an iteration is a function of the samples consumed before it,
which the checkpoint saves, so a resume continues the ramp exactly. megatron-core 0.16 takes the ramp as
`rampup_batch_size`; 0.17+ ignore that argument and take the same ramp as a `step_batch_size_schedule`.
`scheduler_steps` imports nothing heavy (argument validation uses it).
"""
from __future__ import annotations

import inspect


def scheduler_steps(args) -> tuple[float, int, int]:
    """(warmup, decay, weight-decay increment) lengths in samples, for megatron-core's OptimizerParamScheduler."""
    if args.train_samples is None:
        gbs = args.global_batch_size
        decay = args.lr_decay_iters * gbs
        warmup = args.lr_warmup_iters * gbs
        total = args.train_iters * gbs
    else:
        decay = args.lr_decay_samples
        warmup = args.lr_warmup_samples
        total = args.train_samples
    if args.lr_warmup_fraction is not None:
        warmup = args.lr_warmup_fraction * decay
    return warmup, decay, total


def _refuse(args, flags: tuple[str, ...], why: str) -> None:
    """Refuse the first of `flags` that is set (not None, not 0), saying why and what to use."""
    for flag in flags:
        if getattr(args, flag.lstrip("-").replace("-", "_")) not in (None, 0):
            raise ValueError(f"{flag} {why}")


def validate_schedule(args) -> None:
    """Iteration- or sample-based, never a mix (as upstream); the ramp and the LR schedule lengths."""
    if (args.train_iters is None) == (args.train_samples is None):
        raise ValueError("give exactly one of --train-iters (iteration-based) and --train-samples (sample-based)")
    if args.train_samples is None:
        _refuse(args, ("--lr-decay-samples", "--lr-warmup-samples", "--rampup-batch-size"),
                "counts samples: with --train-iters use --lr-decay-iters / --lr-warmup-iters (a batch-size ramp "
                "needs --train-samples)")
        args.lr_decay_iters = args.lr_decay_iters or args.train_iters
        _refuse(args, ("--lr-warmup-iters",) if args.lr_warmup_fraction is not None else (),
                "and --lr-warmup-fraction both set the warmup: give one")
    else:
        _refuse(args, ("--lr-decay-iters", "--lr-warmup-iters"),
                "counts iterations: with --train-samples use --lr-decay-samples / --lr-warmup-samples")
        args.lr_decay_samples = args.lr_decay_samples or args.train_samples
        _refuse(args, ("--lr-warmup-samples",) if args.lr_warmup_fraction is not None else (),
                "and --lr-warmup-fraction both set the warmup: give one")
    if args.lr_warmup_fraction is not None and not 0 <= args.lr_warmup_fraction < 1:
        raise ValueError(f"--lr-warmup-fraction must be in [0, 1), got {args.lr_warmup_fraction}")
    warmup, decay, _ = scheduler_steps(args)
    if decay <= 0 or warmup >= decay:
        raise ValueError(f"the LR warmup ({warmup} samples) must be shorter than the decay ({decay} samples): "
                            "check --lr-warmup-* and --lr-decay-*")
    if args.rampup_batch_size is not None:
        _validate_rampup(args)


def _validate_rampup(args) -> None:
    try:
        start, increment, samples = (int(v) for v in args.rampup_batch_size)
    except ValueError:
        raise ValueError(f"--rampup-batch-size takes three integers START INCREMENT SAMPLES, got "
                            f"{' '.join(args.rampup_batch_size)}") from None
    unit = args.micro_batch_size * args.data_parallel_size
    gbs = args.global_batch_size
    if min(start, increment, samples) <= 0 or start >= gbs or (gbs - start) % increment:
        raise ValueError(f"--rampup-batch-size {start} {increment} {samples}: needs positive values and "
                            f"START below --global-batch-size {gbs} by a multiple of INCREMENT")
    if start % unit or increment % unit:
        raise ValueError(f"--rampup-batch-size {start} {increment} {samples}: START and INCREMENT must be "
                            f"multiples of micro-batch-size x data-parallel size = {unit}")
    args.rampup_batch_size = [start, increment, samples]


def rampup_as_steps(start: int, increment: int, ramp_samples: int, global_batch_size: int) -> str:
    """megatron-core 0.16's ramp as a 0.17+ step schedule "SAMPLES:BATCH ...": the same batch size for every
    number of consumed samples c (start + int(c / (ramp_samples / n)) * increment up to ramp_samples, then the
    global batch size; n increments)."""
    n = (global_batch_size - start) // increment
    per_increment = ramp_samples / n
    steps = {0: start}
    for k in range(1, n + 1):
        c = int(k * per_increment)  # the first c with int(c / per_increment) >= k, by the same float division
        while int(c / per_increment) < k:
            c += 1
        while c > 0 and int((c - 1) / per_increment) >= k:
            c -= 1
        steps[min(c, ramp_samples + 1)] = start + k * increment
    return " ".join(f"{c}:{b}" for c, b in sorted(steps.items()))


def init_microbatches(args, rank: int) -> None:
    """Set up megatron-core's global num-microbatches calculator for this run (constant or ramped)."""
    from megatron.core import num_microbatches_calculator as nmc
    nmc.destroy_num_microbatches_calculator()
    kwargs = dict(rank=rank, rampup_batch_size=None, global_batch_size=args.global_batch_size,
                  micro_batch_size=args.micro_batch_size, data_parallel_size=args.data_parallel_size,
                  decrease_batch_size_if_needed=False)
    if args.rampup_batch_size:
        start, increment, ramp_samples = args.rampup_batch_size
        if "step_batch_size_schedule" in inspect.signature(nmc.init_num_microbatches_calculator).parameters:
            kwargs["step_batch_size_schedule"] = rampup_as_steps(start, increment, ramp_samples,
                                                                 args.global_batch_size)
        else:
            kwargs["rampup_batch_size"] = [start, increment, ramp_samples]
    nmc.init_num_microbatches_calculator(**kwargs)


def batch_at(consumed_samples: int) -> tuple[int, int]:
    """(global batch size, micro-batches per DP rank) of the iteration that starts after `consumed_samples`."""
    from megatron.core import num_microbatches_calculator as nmc
    nmc.update_num_microbatches(consumed_samples, consistency_check=True)
    return nmc.get_current_global_batch_size(), nmc.get_num_microbatches()


def train_iters_for_samples(args) -> int:
    """Iterations of a sample-based run, as upstream counts them: the ramp's iterations (its last batch may
    pass --train-samples), then whole global batches; a partial last batch is dropped."""
    if args.rampup_batch_size is None:
        return args.train_samples // args.global_batch_size
    from megatron.core import num_microbatches_calculator as nmc
    iterations = consumed = 0
    ramp_samples = args.rampup_batch_size[2]
    while consumed <= ramp_samples and consumed <= args.train_samples:
        nmc.update_num_microbatches(consumed, consistency_check=False)
        consumed += nmc.get_current_global_batch_size()
        iterations += 1
    nmc.update_num_microbatches(0, consistency_check=False)
    return iterations + max(0, args.train_samples - consumed) // args.global_batch_size
