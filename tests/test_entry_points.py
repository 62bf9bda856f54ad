"""pretrain_gpt.py and the tools import this repository's trainer (`megatron.training` here) however they are
started, also where megatron-core 0.17+ installs upstream's own `megatron/training` beside `megatron/core`:
from another working directory, under torchrun, and with `python -P` / PYTHONSAFEPATH=1 (which leave the
script's directory off the path). No PYTHONPATH is set in any of these runs."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from megatron_helpers import ROOT

RUN = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
       "--vocab-size", "128", "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-3", "--mock-data",
       "--train-iters", "1", "--no-ckpt-fsync"]


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", **extra)
    return env


def _run(cmd: list[str], cwd, **env) -> str:
    p = subprocess.run(cmd, cwd=cwd, env=_env(**env), capture_output=True, text=True, timeout=300)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    return out


@pytest.fixture(scope="module")
def elsewhere(tmp_path_factory):
    return tmp_path_factory.mktemp("elsewhere")


def test_safe_path_from_another_directory(elsewhere):
    where = _run([sys.executable, "-P", "-c", "import importlib.util as u; s = u.find_spec('megatron.training'); "
                  "print(s and s.origin)"], elsewhere)
    from megatron.core.package_info import __version__
    if tuple(int(p) for p in __version__.split(".")[:2]) >= (0, 17):
        assert "site-packages" in where, where  # upstream's package is what a bare import finds
    else:
        assert where.strip() == "None", where
    save = str(elsewhere / "ckpt")
    out = _run([sys.executable, "-P", os.path.join(ROOT, "pretrain_gpt.py"), *RUN, "--save", save,
                "--save-interval", "1"], elsewhere)
    assert "training done at iteration 1" in out, out[-3000:]
    # a tool started the same way finds this repository's packages too (datastates, tools.checkpoint)
    out = _run([sys.executable, "-P", os.path.join(ROOT, "tools", "convert_checkpoint.py"), "--from", "datastates",
                "--to", "torch_dist", "--input", save, "--output", str(elsewhere / "td")], elsewhere)
    assert os.path.exists(os.path.join(elsewhere, "td", "iter_0000001", "metadata.json")), out


def test_torchrun_with_safe_path_from_another_directory(elsewhere):
    # --standalone: torchrun's own store binds port 0 and the workers meet there (no port probed, then released)
    out = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                os.path.join(ROOT, "pretrain_gpt.py"), *RUN], elsewhere, PYTHONSAFEPATH="1")
    assert "training done at iteration 1" in out and "data-parallel 2" in out, out[-3000:]
