"""The checkpoint flags of the README's table through pretrain_gpt.py, with as few trainer launches as possible.

One uninterrupted 2-rank run (`reference`) is the reference for every exact comparison here. It saves every
iteration lazily with --async-save (the alias of --async-ckpt), --ckpt-direct-io on, --ckpt-writer-threads 2,
--ckpt-publish-timeout-s 120, --no-ckpt-fsync and --ckpt-on-failure warn, and its save of iteration 2 fails on
rank 1 (tests/fault_launcher.py, FAULT_FAIL_SAVE): it must warn and go on. Its checkpoint of iteration 3 is
resumed, picked with upstream's --ckpt-step 3 among the newer ones, with --ckpt-direct-io off and --no-save-optim
(`resumed`); that checkpoint, which has no optimizer state, and the reference's (saved without
--use-distributed-optimizer) are resumed once more each, to be refused (the latter also resumed into the distributed
optimizer). torch and torch_dist runs stop at iteration 3 and resume in their own format. Nine launches in all.
"""
from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from datastates import paths, tracker
from megatron.training.arguments import ArgumentError, parse_args
from megatron.training.argument_checks import validate_args
from megatron_helpers import ROOT, TINY, iter_dir, losses, torchrun

sys.path.insert(0, os.path.join(ROOT, "tools"))
from convert_checkpoint import read_datastates  # noqa: E402

N, K = 6, 3  # iterations of every run; where the interrupted runs stop
FLAGS = TINY + ["--train-iters", str(N), "--global-batch-size", "4"]
FLAGGED = ["--async-save", "--ckpt-direct-io", "on", "--ckpt-writer-threads", "2", "--ckpt-publish-timeout-s", "120",
           "--no-ckpt-fsync", "--ckpt-on-failure", "warn"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """(save root, log, losses) of the uninterrupted run, saving every iteration; its save of 2 fails on rank 1."""
    root = str(tmp_path_factory.mktemp("reference") / "ck")
    _, log = torchrun(2, FLAGS + FLAGGED + ["--save", root, "--save-interval", "1"], faults=True,
                      env={"FAULT_FAIL_SAVE": "1:2"})
    ref = losses(log)
    assert sorted(ref) == list(range(1, N + 1)), log[-3000:]
    return root, log, ref


@pytest.fixture(scope="module")
def resumed(tmp_path_factory, reference):
    """(save root, log) of a resume from the reference's iteration 3 (--ckpt-step 3; its tracker names 6), saving
    iteration 6 with --ckpt-direct-io off and without optimizer state."""
    root = str(tmp_path_factory.mktemp("resumed") / "ck")
    _, log = torchrun(2, FLAGS + ["--load", reference[0], "--ckpt-step", str(K), "--save", root,
                                  "--save-interval", str(N), "--async-save", "--ckpt-direct-io", "off",
                                  "--no-save-optim"])
    return root, log


def _manifests(ckpt_dir: str) -> list[dict]:
    return [json.load(open(os.path.join(ckpt_dir, paths.manifest_file(r)))) for r in range(2)]


def test_failed_save_warns_and_training_goes_on(reference):
    """--ckpt-on-failure warn: the failed save is logged with the last published checkpoint, the run goes on
    and exits 0 (torchrun's check), the next saves publish, and the tracker names the last one."""
    root, log, _ = reference
    assert ("rank 1: checkpoint of iteration 2 failed, training goes on (--ckpt-on-failure warn); the last "
            "published checkpoint is still 1") in log, log[-4000:]
    assert "stopping at iteration" not in log
    assert tracker.published_iterations(root) == [1, 3, 4, 5, 6]
    assert not os.path.exists(iter_dir(root, 2)) and not os.path.exists(paths.partial_dir(iter_dir(root, 2)))
    assert open(os.path.join(root, paths.TRACKER)).read().strip() == str(N)


def test_checkpoint_flags_take_effect(reference):
    """--async-save saves lazily, --ckpt-direct-io on wrote every rank's data with O_DIRECT (tmp_path is on a
    disk that takes it), and the saved args hold the flags; every byte of the last checkpoint verifies."""
    root, log, _ = reference
    assert f"saving checkpoint at iteration {N:8d} to {root} in datastates format (lazy async)" in log
    for it in tracker.published_iterations(root):
        assert [m["direct_io"] for m in _manifests(iter_dir(root, it))] == [True, True], it
    saved = read_datastates(root, None)  # the latest; reads every tensor, checking every checksum
    assert saved.iteration == N and saved.tensors
    args = saved.common["args"]
    assert (args.async_ckpt, args.ckpt_direct_io, args.ckpt_writer_threads, args.ckpt_publish_timeout_s,
            args.ckpt_fsync, args.ckpt_on_failure) == (True, "on", 2, 120.0, False, "warn")


def test_resume_of_a_flagged_checkpoint_is_exact(reference, resumed):
    """The reference's iteration 3 resumes to the reference's losses; the resumed run's checkpoint, written
    without O_DIRECT (--ckpt-direct-io off), holds the reference's iteration-6 model bit for bit."""
    ref_root, _, ref = reference
    root, log = resumed
    assert f"(datastates) at iteration {K}" in log, log[-3000:]
    assert losses(log) == {i: ref[i] for i in range(K + 1, N + 1)}
    assert [m["direct_io"] for m in _manifests(iter_dir(root, N))] == [False, False]
    mine, theirs = read_datastates(root, N).tensors, read_datastates(ref_root, N).tensors
    assert mine and not any(k.startswith("optimizer") for k in mine)  # --no-save-optim
    for key, t in mine.items():
        assert torch.equal(t, theirs[key]), key


def test_resume_without_optimizer_state_names_no_load_optim(resumed):
    root, _ = resumed
    rc, log = torchrun(1, FLAGS + ["--load", root], check=False)
    assert rc != 0
    assert (f"checkpoint {iter_dir(root, N)!r} has no optimizer state (no opt_param_scheduler); pass "
            "--no-load-optim to resume with a fresh optimizer, or --finetune") in log, log[-3000:]
    assert losses(log) == {}


def test_the_other_optimizer_kind_loads_and_another_precision_is_refused(reference):
    """The reference (saved without --use-distributed-optimizer, fp32) resumes into the distributed optimizer (its
    main parameters from the saved fp32 weights: optimizer_kinds); into a --bf16 one it is refused before reading,
    naming why and the way out."""
    root = reference[0]
    _, log = torchrun(1, FLAGS + ["--load", root, "--use-distributed-optimizer"])
    assert f"(datastates) at iteration {N}" in log, log[-3000:]
    rc, log = torchrun(1, FLAGS + ["--load", root, "--use-distributed-optimizer", "--bf16"], check=False)
    assert rc != 0
    assert (f"checkpoint {iter_dir(root, N)!r} was saved without --use-distributed-optimizer and this run is with "
            "it, and its main parameters were kept for another precision (--bf16 differs); match the flag, or pass "
            "--no-load-optim") in log, log[-3000:]
    assert losses(log) == {}


@pytest.mark.parametrize("ckpt_format", ["torch", "torch_dist"])
def test_resume_from_own_format_is_exact(tmp_path, reference, ckpt_format):
    """Stop at iteration 3 (--exit-interval), resume in the same format to 6: the reference's losses."""
    ref = reference[2]
    ck = str(tmp_path / "ck")
    flags = FLAGS + ["--ckpt-format", ckpt_format, "--save", ck, "--load", ck, "--save-interval", str(K)]
    _, log1 = torchrun(2, flags + ["--exit-interval", str(K)])
    assert losses(log1) == {i: ref[i] for i in range(1, K + 1)}, log1[-3000:]
    assert tracker.read_latest(ck) == K
    if ckpt_format == "torch":  # one file per (tp, pp) rank, from DP rank 0
        assert os.listdir(iter_dir(ck, K)) == ["mp_rank_00"]
    else:
        assert "sharded_backend" in json.load(open(os.path.join(iter_dir(ck, K), paths.METADATA)))
    _, log2 = torchrun(2, flags)
    assert f"({ckpt_format}) at iteration {K}" in log2, log2[-3000:]
    assert losses(log2) == {i: ref[i] for i in range(K + 1, N + 1)}


# ----- in process: argument validation -----

def _validate(extra):
    return validate_args(parse_args(argv=FLAGS + extra), 2, cuda=False)


def test_exit_on_missing_checkpoint(tmp_path):
    """--load equal to --save with nothing saved yet starts from scratch, unless --exit-on-missing-checkpoint:
    then it fails before any work, saying why nothing is loadable."""
    d = str(tmp_path / "ck")
    assert _validate(["--load", d, "--save", d, "--save-interval", "1"]).load_exists is False
    with pytest.raises(ArgumentError, match=r"does not exist or is not a directory"):
        _validate(["--load", d, "--save", d, "--save-interval", "1", "--exit-on-missing-checkpoint"])
    os.makedirs(os.path.join(d, "iter_0000004.partial"))  # a save killed before publication: nothing loadable
    with pytest.raises(ArgumentError, match=r"holds no checkpoint: neither latest_checkpointed_iteration.txt nor "
                                            r"a published iter_XXXXXXX directory"):
        _validate(["--load", d, "--save", d, "--save-interval", "1", "--exit-on-missing-checkpoint"])
