"""--use-torch-fsdp2 end to end through pretrain_gpt.py: megatron-core's TorchFullyShardedDataParallel trains on CPU
ranks, its DTensor state is checkpointed lazily as each rank's own rows, resumes exactly, and loads into another
number of FSDP2 ranks, into PP with the distributed optimizer and TP x DP (DDP with megatron-core's non-distributed
optimizer) and back, model, fp32 main params and Adam moments bit for bit.

The model's sizes make the shards uneven: 33 position-embedding rows over 2 and 3 ranks, SwiGLU's fc1 of 148 rows
over 3 ranks (50, 50, 48) whose W/V halves (74 rows each) split inside rank 1's rows.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest

from megatron_helpers import ROOT, convert, iter_dir, losses, torchrun, torchrun_command
from megatron.training.arguments import ArgumentError, parse_args
from megatron.training.argument_checks import validate_args
from test_reshard import _comparable_objects, _plain, assert_same_tensors, read_full

N = 3
MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--max-position-embeddings", "33", "--ffn-hidden-size", "74", "--swiglu", "--vocab-size", "128",
         "--make-vocab-size-divisible-by", "64", "--untie-embeddings-and-output-weights", "--bf16",
         "--micro-batch-size", "2", "--global-batch-size", "12", "--lr", "1e-3", "--mock-data", "--seed", "1234",
         "--hidden-dropout", "0", "--attention-dropout", "0", "--train-iters", str(2 * N), "--no-ckpt-fsync"]
FSDP2 = MODEL + ["--use-torch-fsdp2"]


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """An uninterrupted FSDP2 run on 2 ranks, saving lazily at N and 2N: (its save root, its losses)."""
    root = str(tmp_path_factory.mktemp("fsdp2") / "run")
    _, log = torchrun(2, FSDP2 + ["--save", root, "--save-interval", str(N), "--async-ckpt"])
    got = losses(log)
    assert sorted(got) == list(range(1, 2 * N + 1)), log[-3000:]
    return root, got


def _root_at(tmp_path, root: str, iteration: int) -> str:
    """A save root holding only `root`'s checkpoint `iteration` (what a run stopped there would have left)."""
    out = str(tmp_path / f"at{iteration}")
    os.makedirs(out)
    shutil.copytree(iter_dir(root, iteration), iter_dir(out, iteration))
    with open(os.path.join(out, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(iteration))
    return out


def test_a_killed_rank_restarts_from_the_memory_tier_with_the_same_losses(source, tmp_path):
    """torchrun --max-restarts 1: rank 1 SIGKILLed in iteration 5, the restarted workers read the memory tier's
    FSDP2 shards back in place, and every loss the job prints equals the uninterrupted run's."""
    _, reference = source
    flags = FSDP2 + ["--save", str(tmp_path / "ck"), "--load", str(tmp_path / "ck"), "--save-interval", "100",
                     "--async-ckpt", "--non-persistent-save-interval", "1", "--non-persistent-local-ckpt-dir",
                     str(tmp_path / "mem"), "--log-all-ranks"]
    cmd, env = torchrun_command(2, flags, env={"DATASTATES_JOB_ID": "fsdp2-restart", "FAULT_KILL_IN_STEP": "1:5:0"},
                                faults=True)
    cmd.insert(cmd.index("--nproc_per_node"), "--max-restarts=1")
    done = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=300)
    log = done.stdout
    assert done.returncode == 0 and "FAULT-KILL-STEP rank 1 in iteration 5" in log, log[-6000:]
    assert re.search(r"RESUMED from the memory tier at iteration [34]", log), log[-6000:]
    printed = [(int(i), loss) for i, loss in re.findall(r"\[rank 1\] .*iteration\s+(\d+)/\s*\d+ \|.* lm loss: "
                                                        r"([^ ]+) \|", log)]
    assert {i for i, _ in printed} == set(reference), log[-6000:]
    assert all(loss == reference[i] for i, loss in printed), (printed, reference)


def assert_same_state(src: str, dst: str) -> None:
    """Every full tensor (model, fp32 main params, Adam moments) and common object of `dst` equals `src`'s."""
    st, so = read_full(src)
    dt, do = read_full(dst)
    assert_same_tensors(st, dt, src, dst)
    assert any(k.startswith("optimizer.state.fp32_param.") for k in st), sorted(st)
    sc, dc = _comparable_objects(so), _comparable_objects(do)
    assert sorted(sc) == sorted(dc), sorted(set(sc) ^ set(dc))
    assert "common:optimizer/optimizer/state/common_step" in sc, sorted(sc)
    for name in sc:
        assert _plain(sc[name]) == _plain(dc[name]), (name, sc[name], dc[name])


def test_resume_is_exact(source, tmp_path):
    root, reference = source
    _, log = torchrun(2, FSDP2 + ["--load", _root_at(tmp_path, root, N), "--save", str(tmp_path / "again"),
                                  "--save-interval", str(N), "--async-ckpt"])
    assert f"at iteration {N}" in log, log[-3000:]
    assert losses(log) == {i: reference[i] for i in range(N + 1, 2 * N + 1)}, log[-3000:]


def test_reshards_across_fsdp2_ranks_and_into_tp_pp_and_the_distributed_optimizer_and_back(source, tmp_path):
    """FSDP2 DP2 -> FSDP2 DP3 -> PP2 with the distributed optimizer -> TP2 (DDP) -> FSDP2 DP2: each checkpoint
    written after the load equals the source's, every full tensor (the distributed optimizer's main parameters
    under its own name) and the optimizer's values."""
    root, _ = source
    start = _root_at(tmp_path, root, N)
    src = iter_dir(start, N)
    dp3 = convert(3, FSDP2, start, str(tmp_path / "dp3"), N)
    assert_same_state(src, dp3)
    distopt = convert(2, MODEL + ["--pipeline-model-parallel-size", "2", "--use-distributed-optimizer",
                                  "--dist-ckpt-optim-fully-reshardable"], os.path.dirname(dp3),
                      str(tmp_path / "distopt"), N)
    assert_same_as_distributed(src, distopt)
    tp2 = convert(2, MODEL + ["--tensor-model-parallel-size", "2"], os.path.dirname(distopt), str(tmp_path / "tp2"),
                  N)
    assert_same_state(src, tp2)
    back = convert(2, FSDP2, os.path.dirname(tp2), str(tmp_path / "back"), N)
    assert_same_state(src, back)


def assert_same_as_distributed(src: str, dst: str) -> None:
    """`dst`, a distributed optimizer's checkpoint, holds `src`'s model, main parameters and moments bit for bit,
    and its Adam step in every param group."""
    st, so = read_full(src)
    dt, do = read_full(dst)
    renamed = {k.replace("optimizer.state.fp32_param.", "optimizer.state.param."): v for k, v in st.items()}
    assert any(k.startswith("optimizer.state.param.") for k in renamed), sorted(renamed)
    assert_same_tensors(renamed, dt, src, dst)
    step = so["common:optimizer/optimizer/state/common_step"]
    groups = do["common:optimizer/optimizer"]["param_groups"]
    assert step > 0 and [g["step"] for g in groups] == [step] * len(groups), (step, groups)


BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--micro-batch-size", "2", "--train-iters", "4", "--lr", "1e-3", "--mock-data", "--use-torch-fsdp2",
        "--untie-embeddings-and-output-weights"]


@pytest.mark.parametrize("extra,named", [
    (["--use-distributed-optimizer"], "--use-distributed-optimizer"),
    (["--pipeline-model-parallel-size", "2"], "--pipeline-model-parallel-size"),
    (["--ckpt-format", "torch_dist"], "--ckpt-format torch_dist"),
    (["--ckpt-format", "torch"], "--ckpt-format torch"),
    (["--fp16"], "--fp16"),
])
def test_refused_beside_fsdp2_before_any_work(extra, named):
    with pytest.raises(ArgumentError, match=f"--use-torch-fsdp2 with {named}"):
        validate_args(parse_args(argv=BASE + extra), 4, cuda=False)


def test_tied_embeddings_refused_naming_the_flag_to_pass():
    argv = [a for a in BASE if a != "--untie-embeddings-and-output-weights"]
    with pytest.raises(ArgumentError, match="--untie-embeddings-and-output-weights"):
        validate_args(parse_args(argv=argv), 2, cuda=False)
