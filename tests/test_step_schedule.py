"""--step-batch-size-schedule, upstream's spelling: parsed to sample thresholds as megatron-core 0.17+ parse it,
its batch size looked up as their calculator does (0.16 gets StepBatchSizeCalculator through the same
init_microbatches), bad schedules refused before any work naming the flag. In-process; the GPT-3 script's run,
stopped and resumed with the flag, is tests/test_upstream_runs.py's."""
import random

import pytest

from megatron.training.arguments import ArgumentError, parse_args
from megatron.training.schedules import (StepBatchSizeCalculator, batch_at, init_microbatches, parse_step_schedule,
                                         train_iters_for_samples)
from megatron.training.argument_checks import validate_args

GPT3 = "0:16 2.4B:320 4.8B:624 7.2B:928 9.6B:1232 12B:1536"  # upstream's GPT-3 175B script, seq length 2048
BASE = ["--num-layers", "2", "--hidden-size", "8", "--num-attention-heads", "2", "--seq-length", "64",
        "--micro-batch-size", "1", "--lr", "1e-3", "--mock-data"]


@pytest.fixture(autouse=True)
def no_calculator_left():
    """megatron-core's calculator is a process global: none is left to the next test module."""
    yield
    from megatron.core import num_microbatches_calculator as nmc
    nmc.destroy_num_microbatches_calculator()


def args_of(extra, world=2):
    return validate_args(parse_args(argv=BASE + extra), world, cuda=False)


def test_upstreams_spelling_in_tokens_and_in_samples():
    assert parse_step_schedule(GPT3, 2048) == [(0, 16), (1171875, 320), (2343750, 624), (3515625, 928),
                                               (4687500, 1232), (5859375, 1536)]
    assert parse_step_schedule("0:8, 1.5k:16,2M:1K 3e3T:2k", None) == [(0, 8), (1500, 16), (2_000_000, 1000),
                                                                        (3 * 10**15, 2000)]
    assert parse_step_schedule("0:8 127:16 128:32", 64) == [(0, 8), (1, 16), (2, 32)]  # tokens floored to samples


def _random_schedule(r: random.Random, seq_length: int) -> str:
    """Thresholds in tokens with and without suffixes, batch sizes multiples of 4."""
    tokens, entries = 0, ["0:" + str(4 * r.randint(1, 8))]
    for _ in range(r.randint(0, 5)):
        tokens += seq_length * r.randint(1, 40) + r.randint(0, seq_length - 1)
        written = f"{tokens / 1000:g}K" if tokens % 100 == 0 and r.random() < 0.5 else str(tokens)
        entries.append(f"{written}:{4 * r.randint(1, 8)}")
    return " ".join(entries)


def test_batch_sizes_are_megatron_cores_on_every_version():
    """Every consumed-sample count gets the batch size megatron-core 0.17+'s calculator gives for the schedule as
    written (in tokens); on 0.16 the calculator init_microbatches installs is StepBatchSizeCalculator."""
    from megatron.core import num_microbatches_calculator as nmc
    upstream = getattr(nmc, "StepBatchsizeNumMicroBatchesCalculator", None)
    for trial in range(30):
        r = random.Random(trial)
        seq_length = r.choice([16, 64, 2048])
        text = _random_schedule(r, seq_length)
        args = args_of(["--train-samples", "200", "--seq-length", str(seq_length),
                        "--max-position-embeddings", str(seq_length), "--step-batch-size-schedule", text], world=4)
        init_microbatches(args, rank=1)
        ours = StepBatchSizeCalculator(parse_step_schedule(text, seq_length), 1, 4)
        reference = upstream and upstream(1, 4, False, 1, text, seq_length)
        last = parse_step_schedule(text, seq_length)[-1][0]
        for consumed in range(last + 10):
            ours.update(consumed, consistency_check=True)
            assert batch_at(consumed) == (ours.get_current_global_batch_size(), ours.get()), (text, consumed)
            if reference:
                reference.update(consumed, consistency_check=True)
                assert ours.get_current_global_batch_size() == reference.get_current_global_batch_size()
                assert ours.get() == reference.get()


def test_a_sample_based_run_counts_iterations_until_its_samples_are_consumed():
    """As upstream: the last batch may pass --train-samples. 0-1 sample: 2 a step; 2-14: 4; from 15: 8."""
    args = args_of(["--train-samples", "30", "--step-batch-size-schedule", "0:2 128:4 1K:8"])
    assert (args.global_batch_size, args.num_microbatches) == (8, 4)  # the final batch size
    init_microbatches(args, rank=1)
    assert train_iters_for_samples(args) == 7  # consumed 2, 6, 10, 14, 18, 26, 34
    assert batch_at(0) == (2, 1)  # the count leaves the calculator at the start


def test_an_iteration_based_run_takes_a_schedule_and_a_consistent_global_batch_size():
    args = args_of(["--train-iters", "8", "--global-batch-size", "8", "--step-batch-size-schedule", "0:2 1K:8"])
    assert args.global_batch_size == 8


@pytest.mark.parametrize("extra, message", [
    (["0:4 1K:8 512:16"], "thresholds must increase, got 512 after 1000"),
    (["0:4 1K:8 1000:16"], "thresholds must increase, got 1000 after 1000"),
    (["0:4 100:8 120:16"], "thresholds 100 and 120 tokens are the same number of samples, 1, at --seq-length 64"),
    (["0:4 1K:6"], r"batch size\(s\) \[6\] are not multiples of micro-batch-size x data-parallel size = 4"),
    (["1K:4 2K:8"], "the first threshold must be 0"),
    (["0:4 2.4G:8"], "unknown suffix 'G' in '2.4G'"),
    (["0:4 1.5:8"], "'1.5' is 1.5, not a whole number"),
    (["0:4 1K-8"], "entry '1K-8' is not THRESHOLD:BATCH_SIZE"),
    (["0:4 1K:x"], "'x' is not a number"),
    (["0:0"], "every batch size must be positive"),
    (["0:4 1K:8", "--global-batch-size", "16"],
     "--global-batch-size 16 differs from the final batch size of --step-batch-size-schedule, 8"),
    (["0:4 1K:8", "--rampup-batch-size", "4", "4", "20"],
     "--rampup-batch-size and --step-batch-size-schedule both set the batch size"),
])
def test_bad_schedules_are_refused_before_any_work(extra, message):
    with pytest.raises(ArgumentError, match=message) as e:
        args_of(["--train-samples", "64", "--step-batch-size-schedule", *extra], world=4)
    assert str(e.value).startswith("--")  # names its flag first


def test_virtual_pipeline_stages_check_every_batch_size_of_the_schedule():
    with pytest.raises(ArgumentError, match=r"1 micro-batches per iteration \(global batch 2\)"):
        args_of(["--train-samples", "64", "--num-layers", "4", "--pipeline-model-parallel-size", "2",
                 "--num-virtual-stages-per-pipeline-rank", "2", "--step-batch-size-schedule", "0:2 1K:4"], world=4)
