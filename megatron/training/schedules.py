"""Training length, learning-rate schedule lengths and the batch size over a run, counted as upstream Megatron-LM does.

Iteration-based runs (`--train-iters`) count the LR schedule in iterations x global batch size; sample-based runs
(`--train-samples`) in samples, with `--lr-decay-samples`, `--lr-warmup-samples` or `--lr-warmup-fraction`. The
batch size may change over a run: a ramp (`--rampup-batch-size START INCREMENT SAMPLES`, sample-based runs) or
upstream's step schedule (`--step-batch-size-schedule "0:16 2.4B:320 ..."`, either kind of run). Either is
megatron-core's num-microbatches calculator: the batch size of an iteration is a function of the samples consumed
before it, which the checkpoint saves, so a resume continues exactly. Both reach megatron-core as a step schedule
in samples where it takes one (0.17+, which ignore `rampup_batch_size`); 0.16 has its own ramp, and for a step
schedule `StepBatchSizeCalculator` here, of the same semantics, stands in as its global calculator.
`scheduler_steps` and `validate_schedule` import nothing heavy (argument validation uses them).
"""
from __future__ import annotations

import bisect
import inspect
import re
from decimal import Decimal


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
    if args.step_batch_size_schedule is not None:
        _validate_step_schedule(args)
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


_SUFFIXES = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}
_COUNT_RE = re.compile(r"((?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)([A-Za-z]*)")


def _count(word: str, entry: str) -> int:
    """A whole number written with an optional K/M/B/T suffix (upstream's 1e3/1e6/1e9/1e12), e.g. 2.4B."""
    where = f"--step-batch-size-schedule entry {entry!r}"
    match = _COUNT_RE.fullmatch(word)
    if match is None:
        raise ValueError(f"{where}: {word!r} is not a number (a count like 320, 2.4B or 250K)")
    suffix = match.group(2).upper()
    if suffix not in _SUFFIXES:
        raise ValueError(f"{where}: unknown suffix {match.group(2)!r} in {word!r}; the suffixes are K, M, B and T "
                         "(1e3, 1e6, 1e9, 1e12)")
    value = Decimal(match.group(1)) * _SUFFIXES[suffix]
    if value != value.to_integral_value():
        raise ValueError(f"{where}: {word!r} is {value}, not a whole number")
    return int(value)


def parse_step_schedule(text: str, seq_length: int | None) -> list[tuple[int, int]]:
    """Upstream's `--step-batch-size-schedule` spelling, "THRESHOLD:BATCH ..." (entries split by spaces or
    commas), as (first consumed sample, global batch size) pairs. Thresholds count tokens when `seq_length` is
    given (floored to whole samples, as upstream), else samples; they start at 0 and increase strictly as
    written (upstream would sort them: a misordered schedule is more likely a typo than a wish)."""
    steps, tokens = [], []
    for entry in text.replace(",", " ").split():
        threshold, colon, batch = entry.partition(":")
        if not colon:
            raise ValueError(f"--step-batch-size-schedule entry {entry!r} is not THRESHOLD:BATCH_SIZE")
        tokens.append(_count(threshold, entry))
        steps.append((tokens[-1] // (seq_length or 1), _count(batch, entry)))
    unit = "tokens" if seq_length else "samples"
    if not steps or tokens[0] != 0:
        raise ValueError(f"--step-batch-size-schedule {text!r}: the first threshold must be 0 (the batch size a "
                         "run starts with)")
    for (before, _), (after, _), t0, t1 in zip(steps, steps[1:], tokens, tokens[1:]):
        if t1 <= t0:
            raise ValueError(f"--step-batch-size-schedule {text!r}: thresholds must increase, got {t1} after {t0}")
        if after == before:
            raise ValueError(f"--step-batch-size-schedule {text!r}: thresholds {t0} and {t1} {unit} are the same "
                             f"number of samples, {after}, at --seq-length {seq_length}")
    if any(batch <= 0 for _, batch in steps):
        raise ValueError(f"--step-batch-size-schedule {text!r}: every batch size must be positive")
    return steps


def _validate_step_schedule(args) -> None:
    """The schedule's batch sizes split into micro-batches on every DP rank; its last one is the global batch size
    (the LR schedule lengths of an iteration-based run and the evaluation batches use it), which
    --global-batch-size, when given, must equal (upstream refuses the two together; its GPT-3 script passes
    both, consistently)."""
    if args.rampup_batch_size is not None:
        raise ValueError("--rampup-batch-size and --step-batch-size-schedule both set the batch size over the run: "
                         "give one (a ramp is a step schedule whose steps are its increments)")
    steps = parse_step_schedule(args.step_batch_size_schedule, args.seq_length)
    unit = args.micro_batch_size * args.data_parallel_size
    uneven = [batch for _, batch in steps if batch % unit]
    if uneven:
        raise ValueError(f"--step-batch-size-schedule: batch size(s) {uneven} are not multiples of "
                         f"micro-batch-size x data-parallel size = {unit}")
    final = steps[-1][1]
    if args.global_batch_size not in (None, final):
        raise ValueError(f"--global-batch-size {args.global_batch_size} differs from the final batch size of "
                         f"--step-batch-size-schedule, {final}: make them equal or leave --global-batch-size out")
    args.global_batch_size = final
    args.num_microbatches = final // unit


def batch_sizes(args) -> list[int]:
    """The global batch sizes a run goes through, in order: the schedule's steps, or the ramp's start and each
    increment, then the final one."""
    if args.step_batch_size_schedule is not None:
        return [batch for _, batch in parse_step_schedule(args.step_batch_size_schedule, args.seq_length)]
    if not args.rampup_batch_size:
        return [args.global_batch_size]
    start, increment, _ = (int(v) for v in args.rampup_batch_size)
    return list(range(start, args.global_batch_size + 1, increment))


def samples_schedule(args) -> str | None:
    """The run's batch sizes as a step schedule in samples, "SAMPLES:BATCH ...", as megatron-core 0.17+ take it
    (None for a constant batch size)."""
    if args.step_batch_size_schedule is not None:
        return " ".join(f"{t}:{b}" for t, b in parse_step_schedule(args.step_batch_size_schedule, args.seq_length))
    if args.rampup_batch_size:
        return rampup_as_steps(*args.rampup_batch_size, args.global_batch_size)
    return None


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


class StepBatchSizeCalculator:
    """megatron-core 0.17+'s step-schedule calculator for 0.16, which has none: the batch size of the last step
    whose threshold the consumed samples reached. It has the interface of megatron-core's calculators and is
    installed as 0.16's global one, so every reader of the batch size (batch_at, megatron-core) gets it."""

    def __init__(self, steps: list[tuple[int, int]], micro_batch_size: int, data_parallel_size: int):
        self.thresholds = [threshold for threshold, _ in steps]
        self.sizes = [batch for _, batch in steps]
        self.micro_batch_size, self.unit = micro_batch_size, micro_batch_size * data_parallel_size
        self.update(0, consistency_check=False)

    def update(self, consumed_samples: int, consistency_check: bool, verbose: bool = False) -> None:
        self.current_global_batch_size = self.sizes[bisect.bisect_right(self.thresholds, consumed_samples) - 1]
        if consistency_check and self.current_global_batch_size % self.unit:
            raise ValueError(f"global batch size {self.current_global_batch_size} is not a multiple of "
                             f"micro-batch-size x data-parallel size = {self.unit}")
        self.num_micro_batches = self.current_global_batch_size // self.unit

    def get(self) -> int:
        return self.num_micro_batches

    def get_current_global_batch_size(self) -> int:
        return self.current_global_batch_size

    get_current_running_global_batch_size = get_current_global_batch_size

    def get_micro_batch_size(self) -> int:
        return self.micro_batch_size


def init_microbatches(args, rank: int) -> None:
    """Set up megatron-core's global num-microbatches calculator for this run: constant, 0.16's own ramp, or a
    step schedule in samples (megatron-core's own where it takes one, else StepBatchSizeCalculator)."""
    from megatron.core import num_microbatches_calculator as nmc
    nmc.destroy_num_microbatches_calculator()
    kwargs = dict(rank=rank, rampup_batch_size=None, global_batch_size=args.global_batch_size,
                  micro_batch_size=args.micro_batch_size, data_parallel_size=args.data_parallel_size,
                  decrease_batch_size_if_needed=False)
    takes_steps = "step_batch_size_schedule" in inspect.signature(nmc.init_num_microbatches_calculator).parameters
    steps, stand_in = samples_schedule(args), None
    if steps and takes_steps:
        kwargs["step_batch_size_schedule"] = steps
    elif args.rampup_batch_size:
        kwargs["rampup_batch_size"] = list(args.rampup_batch_size)
    elif steps:
        stand_in = StepBatchSizeCalculator(parse_step_schedule(steps, None), args.micro_batch_size,
                                           args.data_parallel_size)
    nmc.init_num_microbatches_calculator(**kwargs)
    if stand_in is not None:  # 0.16 has no way to register a calculator but its module's global
        nmc._GLOBAL_NUM_MICROBATCHES_CALCULATOR = stand_in


def batch_at(consumed_samples: int) -> tuple[int, int]:
    """(global batch size, micro-batches per DP rank) of the iteration that starts after `consumed_samples`."""
    from megatron.core import num_microbatches_calculator as nmc
    nmc.update_num_microbatches(consumed_samples, consistency_check=True)
    return nmc.get_current_global_batch_size(), nmc.get_num_microbatches()


def train_iters_for_samples(args) -> int:
    """Iterations of a sample-based run, as upstream counts them: with a step schedule, until --train-samples are
    consumed; with a ramp, the ramp's iterations, then whole global batches (a partial last batch is dropped).
    Either way the ramp's or schedule's last batch may pass --train-samples."""
    if args.rampup_batch_size is None and args.step_batch_size_schedule is None:
        return args.train_samples // args.global_batch_size
    from megatron.core import num_microbatches_calculator as nmc
    if args.step_batch_size_schedule is None:
        last_start = min(args.rampup_batch_size[2], args.train_samples)
    else:
        last_start = args.train_samples - 1
    iterations = consumed = 0
    while consumed <= last_start:
        nmc.update_num_microbatches(consumed, consistency_check=False)
        consumed += nmc.get_current_global_batch_size()
        iterations += 1
    nmc.update_num_microbatches(0, consistency_check=False)
    return iterations + max(0, args.train_samples - consumed) // args.global_batch_size
