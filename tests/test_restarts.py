"""Restarts inside one job: real torchrun --max-restarts, 2 ranks (DP2, gloo), faults from tests/fault_launcher.py.

One job fails twice and finishes: rank 1 SIGKILLed in iteration 6 of the first attempt (before its optimizer step,
the memory save of iteration 5 possibly still copying), then rank 0 hung in iteration 9 of the second, which rank 1
turns into a failure past --distributed-timeout-minutes naming itself and its stage. Each restart resumes from the
memory tier (storage has nothing yet) and every loss the job prints equals the uninterrupted run's. A failure in
every attempt exhausts --max-restarts and the job ends with that rank's own error as torchrun's first failure.
"""
import re
import subprocess

import pytest

from megatron.training.arguments import ArgumentError, parse_args
from megatron_helpers import ROOT, TINY, losses, torchrun, torchrun_command
from trainer_kills import kill_tree

ITERS = 12
# how long a rank waits on the hung one: also the longest a collective may be slowed by a loaded machine without
# failing the attempt (0.2 min failed an attempt once with CI's two suites running side by side)
HANG_MINUTES = "0.4"
FLAGS = TINY + ["--global-batch-size", "8", "--train-iters", str(ITERS)]
RESUMED_RE = re.compile(r"\[rank 0\] INFO \S+: RESUMED from (.+?) at iteration (\d+), saved [\d.]+ s ago \((.*?)\); "
                        r"torchrun restart (\d) of (\d)")


def _torchrun(flags: list[str], restarts: int, env: dict, timeout: float = 300) -> tuple[int, str]:
    """(exit code, output) of a real torchrun --max-restarts of tests/fault_launcher.py; past `timeout` the
    launcher and every worker (in sessions of their own) are killed."""
    cmd, env = torchrun_command(2, flags, env=env, faults=True)
    cmd.insert(cmd.index("--nproc_per_node"), f"--max-restarts={restarts}")
    p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(p.pid)
        out, _ = p.communicate()
        raise AssertionError(f"the job did not end within {timeout} s:\n{out[-6000:]}") from None
    return p.returncode, out


def _attempts(log: str) -> int:
    """How many attempts of the job started (rank 0's start line, once per attempt)."""
    return len(re.findall(r"\[rank 0\] INFO \S+: > world size 2:", log))


@pytest.fixture(scope="module")
def reference():
    _, log = torchrun(2, FLAGS)
    ref = losses(log)
    assert sorted(ref) == list(range(1, ITERS + 1)), log[-3000:]
    return ref


def test_a_killed_then_a_hung_rank_restart_from_memory_with_the_same_losses(tmp_path, reference):
    ck, mem = str(tmp_path / "ck"), str(tmp_path / "mem")
    flags = FLAGS + ["--save", ck, "--load", ck, "--save-interval", "100", "--async-ckpt",
                     "--non-persistent-save-interval", "1", "--non-persistent-local-ckpt-dir", mem,
                     "--distributed-timeout-minutes", HANG_MINUTES, "--log-all-ranks"]
    rc, log = _torchrun(flags, 2, {"DATASTATES_JOB_ID": "restarts-test", "FAULT_KILL_IN_STEP": "1:6:0",
                                   "FAULT_HANG_IN_STEP": "0:9:1"})
    assert rc == 0 and _attempts(log) == 3, log[-6000:]  # three attempts
    # the two failures are the faults (not a collective slowed past the bound by a loaded machine)
    assert "FAULT-KILL-STEP rank 1 in iteration 6" in log and "FAULT-HANG-STEP rank 0 in iteration 9" in log, \
        "\n".join(line for line in log.splitlines() if "FAULT" in line or "Failure" in line or "Error" in line)
    # the rank waiting on the hung one fails naming itself, its stage and the bound
    assert re.search(r"RankFailure: rank 1: iteration (9|10) did not finish: a collective waited longer than "
                     rf"--distributed-timeout-minutes {HANG_MINUTES} \(another rank is hung\)", log), log[-6000:]
    resumes = [m.groups() for m in RESUMED_RE.finditer(log)]
    assert [(level, restart, of) for level, _, _, restart, of in resumes] == \
        [("the memory tier", "1", "2"), ("the memory tier", "2", "2")], log[-6000:]
    first, second = int(resumes[0][1]), int(resumes[1][1])
    assert first in (4, 5) and second in (7, 8), resumes  # at most the iteration in flight and the save copying
    assert all(other == "storage has nothing yet" for _, _, other, _, _ in resumes)
    # every iteration printed (those trained again after a restart too) has the uninterrupted run's loss
    printed = [(int(i), loss) for i, loss in re.findall(r"\[rank 1\] .*iteration\s+(\d+)/\s*\d+ \|.* lm loss: "
                                                        r"([^ ]+) \|", log)]
    assert {i for i, _ in printed} == set(range(1, ITERS + 1)), log[-6000:]
    assert all(loss == reference[i] for i, loss in printed), (printed, reference)
    assert "> training done at iteration 12" in log


def test_a_failure_in_every_attempt_ends_the_job_with_its_own_error(tmp_path):
    rc, log = _torchrun(FLAGS, 1, {"FAULT_FAIL_IN_STEP": "1:2:*"})
    assert rc == 1, log[-6000:]
    assert _attempts(log) == 2, log[-6000:]  # the first attempt and its one restart
    root = log[log.index("Root Cause (first observed failure):"):]
    assert re.search(r"rank\s*: 1 ", root) and "injected failure on rank 1 in iteration 2" in root, root


def test_upstream_fault_tolerance_flags_are_refused_naming_what_to_use():
    for flags in (["--inprocess-restart", "--inprocess-granularity", "rank"], ["--enable-ft-package"]):
        with pytest.raises(ArgumentError, match=r"(?s)not built here.*torchrun --max-restarts N.*restarts.md"):
            parse_args(argv=flags)
    args = parse_args(argv=["--exit-signal-handler", "--distributed-timeout-minutes", "0.5"])
    assert args.exit_signal_handler and args.distributed_timeout_minutes == 0.5
