"""Crash safety of the Megatron trainer, 4 ranks TP2 x DP2 on CPU (gloo). (Exact resume in every layout:
test_megatron_state.py.)

1. SIGKILL while a later checkpoint is still flushing (its objects pickle slowly on the engine's background
   thread): the run resumes from the last *published* checkpoint and matches the uninterrupted losses bit for
   bit (the printed loss is the repr of the float), also with --deterministic-mode on the resumed run.
2. --ckpt-on-failure stop with a save that fails on one rank only: every rank stops at the same iteration.
3. A save refused at its call on one rank (2 ranks, with --save-hf): every rank learns it at once, no wait.
"""
import re
import os

import pytest

from megatron_helpers import TINY, losses, torchrun

N = 3
TP2DP2 = TINY + ["--tensor-model-parallel-size", "2", "--global-batch-size", "8", "--train-iters", str(2 * N)]


@pytest.fixture(scope="module")
def reference():
    _, log = torchrun(4, TP2DP2)
    ref = losses(log)
    assert sorted(ref) == list(range(1, 2 * N + 1)), log[-3000:]
    return ref


def test_sigkill_while_flushing_resumes_from_last_published(tmp_path, reference):
    ck = str(tmp_path / "ck")
    flags = TP2DP2 + ["--save", ck, "--load", ck, "--save-interval", "2", "--async-ckpt"]
    rc, log1 = torchrun(4, flags, check=False, faults=True,
                        env={"FAULT_SLOW_SAVE": "4:20", "FAULT_KILL_AFTER_SAVE": "4"})
    assert rc != 0, log1[-3000:]
    assert "FAULT-KILL rank 0 after the save call of iteration 4" in log1
    # iteration 2 was published; iteration 4 was still flushing when every rank died
    assert open(os.path.join(ck, "latest_checkpointed_iteration.txt")).read().strip() == "2"
    assert not os.path.isdir(os.path.join(ck, "iter_0000004"))
    _, log2 = torchrun(4, flags + ["--deterministic-mode"])  # deterministic kernels: the same losses on CPU
    assert "at iteration 2" in log2
    resumed = losses(log2)
    assert sorted(resumed) == list(range(3, 2 * N + 1))
    assert resumed == {i: reference[i] for i in resumed}


def test_failure_on_one_rank_stops_every_rank_at_the_same_iteration(tmp_path):
    """Rank 3's save of iteration 2 fails; the ranks learn it at different moments, yet all stop together at
    one point every rank reaches (a later save: that of iteration 4, or a later one when rank 3's writer reports
    the failure after save 4's agreement, as on loaded cores), and iteration 2 is never published."""
    ck = str(tmp_path / "ck")
    flags = TP2DP2 + ["--save", ck, "--save-interval", "2", "--async-ckpt", "--ckpt-on-failure", "stop",
                      "--log-all-ranks"]
    rc, log = torchrun(4, flags, check=False, faults=True, env={"FAULT_FAIL_SAVE": "3:2"})
    assert rc != 0, log[-3000:]
    stops = re.findall(r"rank (\d): stopping at iteration (\d+): a checkpoint failed", log)
    assert sorted(r for r, _ in stops) == ["0", "1", "2", "3"], log[-4000:]
    stopped_at = {int(it) for _, it in stops}
    assert len(stopped_at) == 1, stops  # one iteration for every rank
    assert min(stopped_at) >= 4 and min(stopped_at) % 2 == 0, stops  # a save point after the failed one
    assert not os.path.isdir(os.path.join(ck, "iter_0000002"))
    assert not os.path.isdir(os.path.join(ck, "iter_0000002.partial"))


FAILED = (r"rank (\d): checkpoint of iteration {it} failed, training goes on \(--ckpt-on-failure warn\); the last "
          r"published checkpoint is still \S+: (.*)")


def test_a_save_refused_on_one_rank_is_known_to_every_rank_at_once(tmp_path):
    """Making the checkpoint's directory fails on one rank at the save call (rank 1's of iteration 2, rank 0's of
    4): that rank's report says so at once, so the others fail the save naming it and its cause, not at the
    publication timeout (600 s, the default: past this job's 240 s), and training goes on under warn. (What rank 1
    wrote of iteration 4 stays as a `.partial` directory that the next start removes: rank 0, which removes a
    failed save's files, could not make that directory.) With --save-hf, the models of exactly the published
    checkpoints."""
    ck, hf = str(tmp_path / "ck"), str(tmp_path / "hf")
    flags = TINY + ["--global-batch-size", "4", "--train-iters", "5", "--save", ck, "--save-interval", "1",
                    "--async-ckpt", "--ckpt-on-failure", "warn", "--log-all-ranks", "--save-hf", hf]
    _, log = torchrun(2, flags, faults=True, env={"FAULT_FAIL_PREPARE": "1:2,0:4"})
    failed = dict(re.findall(FAILED.format(it=2), log))
    assert sorted(failed) == ["0", "1"], log[-4000:]
    assert "rank 1: cannot prepare checkpoint" in failed["0"] and "injected refusal" in failed["0"], failed
    failed = dict(re.findall(FAILED.format(it=4), log))
    assert sorted(failed) == ["0", "1"], log[-4000:]
    assert "rank 0: cannot prepare checkpoint" in failed["1"] and "injected refusal" in failed["1"], failed
    published = sorted(n for n in os.listdir(ck) if n.startswith("iter_") and not n.endswith(".partial"))
    assert published == ["iter_0000001", "iter_0000003", "iter_0000005"], os.listdir(ck)
    assert not os.path.exists(os.path.join(ck, "iter_0000002.partial"))  # rank 0 removed what rank 0 wrote
    # --save-hf: the refusing rank takes its part in dropping the export its peers queued (else their exports
    # would pair with its next one and wait): a model of every published checkpoint, and of no other
    assert sorted(os.listdir(hf)) == ["iter_0000001", "iter_0000003", "iter_0000005", "latest"], log[-4000:]
