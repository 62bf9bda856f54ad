"""A run that stops before --train-iters saves, publishes and exits 0, and resumes exactly (2 ranks, torchrun):
--exit-duration-in-mins, then SIGTERM to torchrun (what Slurm sends before a time limit or a preemption) with
--exit-signal-handler, then a resume to the end; the three runs' losses are the uninterrupted run's."""
import os
import re
import signal
import subprocess
import threading

import pytest

from megatron_helpers import ROOT, TINY, losses, torchrun, torchrun_command

ITERS = 30
FLAGS = TINY + ["--global-batch-size", "8", "--train-iters", str(ITERS)]
EXIT_RE = re.compile(r"exiting program at iteration (\d+): (.*)")


def tracked(ck: str) -> str:
    return open(os.path.join(ck, "latest_checkpointed_iteration.txt")).read().strip()


def sigterm_when(flags: list[str], pattern: str) -> tuple[int, str]:
    """Run torchrun, send it SIGTERM once a line matches `pattern`; (its exit code, its output)."""
    cmd, env = torchrun_command(2, flags)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    watchdog = threading.Timer(240, proc.kill)
    watchdog.start()
    try:
        seen = []
        for line in proc.stdout:
            seen.append(line)
            if re.search(pattern, line):
                proc.send_signal(signal.SIGTERM)
                break
        rest, _ = proc.communicate()
    finally:
        watchdog.cancel()
    return proc.returncode, "".join(seen) + rest


def test_exit_duration_then_sigterm_then_resume(tmp_path):
    _, log = torchrun(2, FLAGS)
    reference = losses(log)
    assert sorted(reference) == list(range(1, ITERS + 1))
    ck = str(tmp_path / "ck")
    flags = FLAGS + ["--save", ck, "--load", ck, "--async-ckpt", "--save-interval", "100"]
    # past its duration after the first iteration: saves it, waits until published, exits 0
    _, log1 = torchrun(2, flags + ["--exit-duration-in-mins", "1e-6"])
    assert sorted(losses(log1)) == [1] and tracked(ck) == "1", log1[-3000:]
    assert EXIT_RE.search(log1).groups() == ("1", "the run is past --exit-duration-in-mins 1e-06")
    # SIGTERM once iteration 3 is logged: every rank stops at the same next iteration, saved and published
    _, log2 = sigterm_when(flags + ["--exit-signal-handler", "--log-all-ranks"], r"iteration\s+3/")
    stop = EXIT_RE.search(log2)
    assert stop and stop.group(2) == "SIGTERM received (--exit-signal-handler)", log2[-3000:]
    k = int(stop.group(1))
    assert 3 <= k < ITERS and tracked(ck) == str(k)
    # each worker ends its run normally (torchrun itself exits 1 on the signal it was sent, as it always does)
    assert sorted(re.findall(rf"\[rank (\d)\] INFO \S+: > training done at iteration {k}$", log2, re.M)) == ["0", "1"]
    assert sorted(losses(log2)) == list(range(2, k + 1))
    # the resume takes the model's shape from the checkpoint (--use-checkpoint-args), as upstream's flag does
    shape = {"--num-layers", "--hidden-size", "--num-attention-heads", "--seq-length", "--vocab-size"}
    unshaped = [f for i, f in enumerate(flags) if f not in shape and (i == 0 or flags[i - 1] not in shape)]
    _, log3 = torchrun(2, unshaped + ["--use-checkpoint-args"])
    assert f"at iteration {k}" in log3
    assert {**losses(log1), **losses(log2), **losses(log3)} == reference
    # a shape flag that contradicts the checkpoint is refused before any work, naming both values
    from megatron.training.arguments import ArgumentError, parse_args
    from megatron.training.args_from_checkpoint import apply_checkpoint_args
    args = parse_args(argv=["--load", ck, "--use-checkpoint-args", "--hidden-size", "32"])
    with pytest.raises(ArgumentError, match=r"--hidden-size is 32 on the command line but 64 in .*iter_0000030"):
        apply_checkpoint_args(args)
    args = parse_args(argv=["--load", ck, "--use-checkpoint-args", "--hidden-size", "64"])
    apply_checkpoint_args(args)
    assert (args.num_layers, args.ffn_hidden_size, args.vocab_size) == (2, 256, 128)
