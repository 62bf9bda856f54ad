"""Checkpoints cross megatron-core versions: one written by the trainer under megatron-core 0.16.1 (Python 3.11)
resumes under 0.19.x (Python 3.12), and one written under 0.19.x resumes under 0.16.1, also into another layout.

bf16, the distributed optimizer in its fully_reshardable layout, TP2xDP2 sources. Each resume runs with
`--save-after-load`, so the state it loaded is written straight back: every full tensor of that checkpoint (model,
fp32 main params, both Adam moments) equals the source's bit for bit, and so does the training state
(iteration, consumed samples, scheduler, each parameter group's learning rate and step). The rest of the common
state is each version's own vocabulary (0.19 adds `content_metadata` keys and parameter-group fields).

The losses of a run that crosses versions are compared with an uninterrupted run of the version that wrote the
checkpoint; the two versions' own uninterrupted runs measure how far their numerics differ (`NUMERICS_REL`), and
the resumed losses must agree within that.

The test drives both environments, so it runs from the Python 3.12 one (`PYTHON=python3.12 bash scripts/test.sh`)
when the Python 3.11 one (`.venv`) exists beside it; `.ci/run` sets up both.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

from megatron_helpers import ROOT, TINY, losses, torchrun
from rank_launcher import run_python
from test_reshard import assert_same_tensors, iter_dir, read_full

N = 3
FLAGS = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--vocab-size", "128", "--make-vocab-size-divisible-by", "64", "--micro-batch-size", "2",
         "--global-batch-size", "8", "--lr", "1e-3", "--mock-data", "--seed", "1234", "--hidden-dropout", "0",
         "--attention-dropout", "0", "--train-iters", str(2 * N), "--no-ckpt-fsync", "--bf16",
         "--use-distributed-optimizer", "--dist-ckpt-optim-fully-reshardable"]
TP2_DP2 = (4, ["--tensor-model-parallel-size", "2"])
TP1_PP2 = (2, ["--pipeline-model-parallel-size", "2"])
# How far the two versions' uninterrupted runs may differ, relatively. Measured on CPU (`test_numerics`):
# 0.16.1 and 0.19.2 give bit-identical losses for this model, so any difference is a finding.
NUMERICS_REL = 0.0
# bf16 rounding of another layout (the fully_reshardable tests of test_megatron_state use the same bound).
LAYOUT_REL = 2e-3

PY311 = os.path.join(ROOT, ".venv", "bin", "python")


def _megatron_core_version() -> tuple:
    from megatron.core.package_info import __version__
    return tuple(int(p) for p in __version__.split(".")[:2])


pytestmark = [
    pytest.mark.skipif(_megatron_core_version() < (0, 17),
                       reason="driven from the Python 3.12 / megatron-core 0.19 environment, which runs both"),
    pytest.mark.skipif(not os.path.exists(PY311), reason=f"the Python 3.11 environment ({PY311}) is not set up"),
]
VERSIONS = {"0.16": PY311, "0.19": sys.executable}


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Per version: (save root of an uninterrupted TP2xDP2 run of 2N iterations saved at N, its losses)."""
    out = {}
    for version, python in VERSIONS.items():
        root = str(tmp_path_factory.mktemp(f"mcore{version}") / "ckpt")
        nproc, layout = TP2_DP2
        _, log = torchrun(nproc, FLAGS + layout + ["--save", root, "--save-interval", str(N), "--async-ckpt"],
                          python=python)
        ref = losses(log)
        assert sorted(ref) == list(range(1, 2 * N + 1)), log[-3000:]
        out[version] = root, ref
    return out


def _training_state(objects: dict) -> dict:
    groups = objects["common:optimizer/optimizer"]["param_groups"]
    return {"iteration": objects["common:iteration"], "train_state": objects["common:train_state"],
            "scheduler": objects["common:opt_param_scheduler"],
            "groups": [(g["lr"], g["step"], g["weight_decay"]) for g in groups]}


def assert_same_state_across_versions(src: str, dst: str) -> int:
    (st, so), (dt, do) = read_full(src), read_full(dst)
    assert _training_state(so) == _training_state(do)
    return assert_same_tensors(st, dt, src, dst)


def _relative_gap(a: dict, b: dict) -> float:
    return max(abs(float(a[i]) - float(b[i])) / abs(float(b[i])) for i in b)


def test_numerics(sources):
    """How far the two versions' uninterrupted runs are apart (printed with -s; bounded by NUMERICS_REL)."""
    gap = _relative_gap(sources["0.16"][1], sources["0.19"][1])
    print(f"\nmegatron-core 0.16.1 vs 0.19: largest relative loss difference over {2 * N} iterations: {gap:.3g}")
    assert gap <= NUMERICS_REL


@pytest.mark.parametrize("written,resumed,target", [("0.16", "0.19", TP2_DP2), ("0.16", "0.19", TP1_PP2),
                                                    ("0.19", "0.16", TP1_PP2)],
                         ids=["0.16-to-0.19-same-layout", "0.16-to-0.19-tp1pp2", "0.19-to-0.16-tp1pp2"])
def test_resume_across_versions(tmp_path, sources, written, resumed, target):
    root, ref = sources[written]
    nproc, layout = target
    dst = str(tmp_path / "resaved")
    _, log = torchrun(nproc, FLAGS + layout + ["--load", iter_dir(root, N), "--save", dst, "--save-after-load"],
                      python=VERSIONS[resumed])
    assert f"at iteration {N}" in log, log[-3000:]
    assert assert_same_state_across_versions(iter_dir(root, N), iter_dir(dst, N)) > 20
    got = losses(log)
    assert sorted(got) == list(range(N + 1, 2 * N + 1)), log[-3000:]
    bound = NUMERICS_REL if target is TP2_DP2 else LAYOUT_REL
    assert _relative_gap(got, {i: ref[i] for i in got}) <= bound, (got, ref)


@pytest.mark.parametrize("written,read", [("0.16", "0.19"), ("0.19", "0.16")])
def test_torch_dist_of_one_version_converts_under_the_other(tmp_path, sources, written, read):
    """tools/convert_checkpoint.py writes torch_dist's common state as `common.pt`, which both versions read:
    datastates -> torch_dist under one version, back under the other, every tensor and the training state
    unchanged."""
    root, _ = sources[written]
    td, back = str(tmp_path / "td"), str(tmp_path / "back")
    _convert(VERSIONS[written], "datastates", "torch_dist", root, td, "--iteration", str(2 * N))
    _convert(VERSIONS[read], "torch_dist", "datastates", td, back)
    assert os.path.exists(os.path.join(iter_dir(td, 2 * N), "common.pt"))
    assert assert_same_state_across_versions(iter_dir(root, 2 * N), iter_dir(back, 2 * N)) > 20


def test_stock_torch_dist_of_0_19_converts_under_0_16(tmp_path):
    """megatron-core 0.19 saves torch_dist's common state as a `common_state` ShardedObject inside the DCP files
    (0.16: `common.pt`): a model saved by stock megatron-core 0.19 converts under 0.16 to the same tensors as
    under 0.19."""
    stock = str(tmp_path / "stock" / "iter_0000000")
    rc, out = run_python("tests/stock_gpt.py", stock, "--init-seed", "7", *TINY, "--global-batch-size", "2",
                         "--train-iters", "1")
    assert rc == 0, out[-4000:]
    assert not os.path.exists(os.path.join(stock, "common.pt"))
    converted = {}
    for version, python in VERSIONS.items():
        _convert(python, "torch_dist", "datastates", stock, str(tmp_path / version))
        converted[version] = read_full(iter_dir(str(tmp_path / version), 0))[0]
    assert sorted(converted["0.16"]) == sorted(converted["0.19"]) and len(converted["0.16"]) > 10
    for name, tensor in converted["0.19"].items():
        assert torch.equal(converted["0.16"][name], tensor), name


def _convert(python: str, frm: str, to: str, src: str, dst: str, *more: str) -> None:
    rc, out = run_python("tools/convert_checkpoint.py", "--from", frm, "--to", to, "--input", src, "--output", dst,
                         *more, python=python)
    assert rc == 0, out[-4000:]
