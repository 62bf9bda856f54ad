"""The GPU check's set-up path, rehearsed as the offline GPU machines will run it (docs/gpu-check.md).

The bundle is prepared from the registry, a venv is made like the GPU machines' python3 (their packages, none of
megatron-core, boto3 or this project), and the there-step's set-up runs in a copy of the files the device tool
copies, with pip allowed no index: it must install megatron-core from the bundle and import this tree's trainer
and engine. Python 3.12 only: the GPU machines' Python, and the test venv the rehearsal's packages come from.
"""
import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.skipif(sys.version_info[:2] != (3, 12), reason="the GPU machines run Python 3.12")


def _run(args, env, timeout):
    return subprocess.run(["bash", *args], cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=timeout)


def test_the_there_step_sets_up_from_the_bundle_alone(tmp_path):
    bundle, venv, out = tmp_path / "gpu_bundle", tmp_path / "machine-venv", tmp_path / "out"
    env = {"GPU_BUNDLE": str(bundle), "SOURCE_VENV": sys.prefix, "MACHINE_VENV": str(venv), "OUT": str(out)}
    r = _run(["scripts/gpu_check.sh", "--prepare"], env, 600)
    assert r.returncode == 0, r.stdout + r.stderr
    manifest = (bundle / "MANIFEST").read_text()
    assert "wheels/megatron_core-0.19.2-cp312" in manifest and "native/_native.cpython-312" in manifest, manifest
    size = sum(p.stat().st_size for p in bundle.rglob("*") if p.is_file())
    assert size < 48 << 20, f"the bundle is {size} bytes"

    r = _run(["scripts/gpu_rehearsal.sh", "--setup-only"], env, 600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    machine_python = str(venv / "bin" / "python")
    for module in ("megatron.core", "datastates", "boto3"):  # outside this tree, as the GPU machines have them
        lacks = subprocess.run([machine_python, "-c", f"import {module}"], cwd=tmp_path, capture_output=True, text=True)
        assert f"No module named '{module.split('.')[0]}" in lacks.stderr, f"the machine venv has {module}"
    figures = json.loads((out / "figures.json").read_text())
    assert figures["device"]["torch"] == torch.__version__ and figures["device"]["megatron_core"] == "0.19.2"
    assert figures["summary"] == [line for line in figures["summary"] if line.startswith("set-up PASS")] != []
    assert sorted(os.listdir(out)) == ["check.log", "figures.json"]

    r = _run(["scripts/gpu_check.sh", "--setup-only"], {"GPU_BUNDLE": str(tmp_path / "none"), "OUT": str(out),
                                                       "GPU_CHECK_DEVICE": "cpu", "PYTHON": machine_python,
                                                       "WORK": str(tmp_path / "work")}, 120)
    assert r.returncode == 1 and "set-up FAIL: no gpu_bundle/ here: run 'bash scripts/gpu_check.sh --prepare'" in r.stdout
