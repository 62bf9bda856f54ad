"""The state real Megatron runs checkpoint, on CPU ranks with gloo: bf16 parameters, megatron-core's
DistributedDataParallel and DistributedOptimizer (fp32 main params and Adam moments sharded over DP), sequence
parallelism, the word embedding tied across pipeline stages.

- bit-exact resume (8 iterations straight against 4, exit, resume) for TP2xDP2, PP2xDP2 (tied), TP2 + SP;
- fully_reshardable from TP2xDP2 into TP1xPP1 and TP1xPP2: main params and moments bit-equal after a save in the
  new layout, losses within bf16 rounding;
- dp_reshardable into another DP size, and its clear refusal into another TP;
- inspect_checkpoint names the optimizer layout;
- a round trip through stock megatron-core: converted to torch_dist, resumed by megatron-core's own
  `dist_checkpointing.load` (bit-exact), converted back with every byte unchanged.
"""
from __future__ import annotations

import os
import re
import sys

import pytest
import torch

from megatron_helpers import ROOT, TINY, iter_dir, losses, torchrun
from rank_launcher import run_python

sys.path.insert(0, os.path.join(ROOT, "tools"))
from convert_checkpoint import read_datastates  # noqa: E402
from inspect_checkpoint import main as inspect_main  # noqa: E402

# same padded vocabulary under TP1 and TP2 (128), dropout off: losses of different layouts are comparable
BASE = TINY + ["--train-iters", "8", "--global-batch-size", "8", "--hidden-dropout", "0", "--attention-dropout", "0",
               "--make-vocab-size-divisible-by", "64", "--bf16", "--use-distributed-optimizer"]
LAYOUTS = {
    "tp2_dp2": (4, ["--tensor-model-parallel-size", "2"]),
    "pp2_dp2_tied": (4, ["--pipeline-model-parallel-size", "2"]),
    "tp2_sp": (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
}
FULLY = ["--dist-ckpt-optim-fully-reshardable"]

def _run(nproc, args, **kw):
    return torchrun(nproc, BASE + args, **kw)

@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """Uninterrupted 8-iteration runs, per layout, saving lazily at iterations 4 and 8 (computed on first use):
    (losses, checkpoint root, log). Their `--load` names an empty directory: every rank warns of it."""
    cache = {}

    def get(name):
        if name not in cache:
            nproc, layout = LAYOUTS[name]
            root = str(tmp_path_factory.mktemp(name) / "straight")
            _, log = _run(nproc, layout + ["--save", root, "--load", root, "--save-interval", "4", "--async-ckpt"])
            cache[name] = losses(log), root, log
            assert sorted(cache[name][0]) == list(range(1, 9)), log[-3000:]
        return cache[name]
    return get


def _losses(straight, name):
    return straight(name)[0]


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_bit_exact_resume(tmp_path, straight, name):
    """Iterations 5-8 resumed from the straight run's own checkpoint of iteration 4 (the stop itself,
    --exit-interval, is tested by the runs that stop below) equal the straight run's, bit for bit."""
    nproc, layout = LAYOUTS[name]
    reference, root, log1 = straight(name)
    _, log = _run(nproc, layout + ["--load", iter_dir(root, 4), "--save", str(tmp_path / "ckpt"), "--save-interval",
                                   "4", "--async-ckpt", "--ckpt-read-mode", "parallel"])  # the others stream
    assert "at iteration 4" in log and "successfully loaded checkpoint" in log
    second = losses(log)
    assert sorted(second) == [5, 6, 7, 8]
    assert second == {i: reference[i] for i in range(5, 9)}
    if name == "tp2_dp2":  # what every run logs, checked once
        assert "checkpoint iteration" in log1 and "stall ms" in log1 and "(rank 0)" not in log1
        for rank in range(nproc):  # a warning is logged at WARNING: every rank shows it, not rank 0 alone
            assert re.search(rf"\[rank {rank}\] WARNING \S+: could not find a checkpoint at {re.escape(root)}",
                             log1), log1[-3000:]
        # the lazy save of the last iteration, usually still in flight when training ends, is waited for,
        # logged once and summed up over the ranks once
        assert len(re.findall(r"INFO \S+: checkpoint iteration\s+8 \|", log)) == 1, log[-3000:]
        assert len(re.findall(r"checkpoint summary iteration\s+8 \|", log)) == 1, log[-3000:]


def _saved_state(path, iteration=None) -> dict[str, torch.Tensor]:
    """Every global tensor of a datastates checkpoint, assembled from all ranks' shards (checksums verified)."""
    return read_datastates(path, iteration).tensors


@pytest.fixture(scope="module")
def sources(tmp_path_factory, straight):
    """TP2xDP2 runs stopped at iteration 4, one per distributed-optimizer layout: {layout: checkpoint dir}."""
    out = {}
    for name, extra in (("dp_reshardable", []), ("fully_reshardable", FULLY)):
        save = str(tmp_path_factory.mktemp(name) / "ckpt")
        first = losses(_run(4, LAYOUTS["tp2_dp2"][1] + extra + ["--save", save, "--save-interval", "4",
                                                                  "--exit-interval", "4"])[1])
        assert first == {i: _losses(straight, "tp2_dp2")[i] for i in range(1, 5)}
        out[name] = save
    return out


def _optimizer_state(path, iteration=None) -> dict[str, torch.Tensor]:
    """fp32 main params and Adam moments of a fully_reshardable checkpoint, in model space."""
    state = {k: t for k, t in _saved_state(path, iteration).items() if k.startswith("optimizer.state.")}
    assert {k.split(".")[2] for k in state} == {"param", "exp_avg", "exp_avg_sq"}
    assert all(t.dtype == torch.float32 for t in state.values())
    return state


def _reshard(tmp_path, src, nproc, layout, name):
    """Load `src` into another layout and save it there at once, fully_reshardable; (state, log)."""
    out = str(tmp_path / name)
    _, log = _run(nproc, layout + FULLY + ["--load", src, "--save", out, "--save-after-load", "--exit-interval", "5"])
    assert "resharded checkpoint" in log
    return _optimizer_state(out, 4), log


def test_fully_reshardable_into_other_layouts(tmp_path, straight, sources):
    saved = _optimizer_state(sources["fully_reshardable"])
    for nproc, layout, name in ((1, [], "tp1_pp1"), (2, ["--pipeline-model-parallel-size", "2"], "tp1_pp2")):
        resaved, log = _reshard(tmp_path, sources["fully_reshardable"], nproc, layout, name)
        assert sorted(resaved) == sorted(saved)
        for key, t in saved.items():  # bit for bit, the word embedding tied across the two stages included
            assert torch.equal(t, resaved[key]), f"{name}: {key} changed in the new layout"
        # bf16 rounding of another layout
        assert float(losses(log)[5]) == pytest.approx(float(_losses(straight, "tp2_dp2")[5]), rel=2e-3), name


def test_dp_reshardable_changes_dp_only(tmp_path, straight, sources):
    src = sources["dp_reshardable"]
    # into DP1 (same TP): megatron-core's dp_reshardable layout allows it; saved model-space, the state is the
    # one the fully_reshardable run of the same training saved
    resaved, log = _reshard(tmp_path, src, 2, ["--tensor-model-parallel-size", "2"], "tp2_dp1")
    reference = _optimizer_state(sources["fully_reshardable"])
    assert sorted(resaved) == sorted(reference)
    for key, t in reference.items():
        assert torch.equal(t, resaved[key]), key
    assert float(losses(log)[5]) == pytest.approx(float(_losses(straight, "tp2_dp2")[5]), rel=2e-3)
    # into TP1: refused before anything is read, naming the way out
    code, log = _run(1, ["--load", src, "--save", str(tmp_path / "tp1"), "--exit-interval", "5"], check=False)
    assert code != 0
    assert "dp_reshardable" in log and "--dist-ckpt-optim-fully-reshardable" in log and "--no-load-optim" in log


def _convert(src, dst, frm, to, *extra):
    rc, out = run_python("tools/convert_checkpoint.py", "--from", frm, "--to", to, "--input", src, "--output", dst,
                         *extra)
    assert rc == 0, out[-4000:]

def test_inspect_names_the_optimizer_layout(sources, capsys):
    for layout, expect in (("dp_reshardable", "distributed optimizer, dp_reshardable"),
                           ("fully_reshardable", "model-shaped (fully_reshardable")):
        assert inspect_main([os.path.join(sources[layout], "iter_0000004")]) == 0
        line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("optimizer state:"))
        assert expect in line and "exp_avg_sq" in line and "param" in line, line


def test_round_trip_through_stock_megatron_core(tmp_path, straight, sources):
    nproc, layout = LAYOUTS["tp2_dp2"]
    src = sources["dp_reshardable"]
    td = str(tmp_path / "td")
    _convert(src, td, "datastates", "torch_dist")
    # megatron-core's own dist_checkpointing.load, through DistributedOptimizer.sharded_state_dict, with upstream's
    # strategy flags (a fully parallel load exchanging replicas, the save plan cached across saves)
    _, log = _run(nproc, layout + ["--load", td, "--ckpt-format", "torch_dist", "--save", str(tmp_path / "td_out"),
                                   "--ckpt-fully-parallel-load", "--ckpt-assume-constant-structure",
                                   "--dist-ckpt-strictness", "log_all"])
    assert "(torch_dist) at iteration 4" in log
    reference = _losses(straight, "tp2_dp2")
    assert losses(log) == {i: reference[i] for i in range(5, 9)}
    back = str(tmp_path / "back")
    _convert(td, back, "torch_dist", "datastates")
    before, after = read_datastates(src, None), read_datastates(back, None)
    assert sorted(before.tensors) == sorted(after.tensors)
    assert any(k.startswith("optimizer.distributed.") for k in before.tensors)
    for k, t in before.tensors.items():  # bytes: the flat buckets' padding is never written, any bits (NaN) there
        assert torch.equal(t.contiguous().view(torch.uint8), after.tensors[k].contiguous().view(torch.uint8)), k
    assert {k: repr(v) for k, v in before.objects.items()} == {k: repr(v) for k, v in after.objects.items()}
