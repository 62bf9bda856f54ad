#!/usr/bin/env bash
# Idempotent set-up on a fresh machine: a venv in .venv with CPU torch pinned, megatron-core, and this
# project built in place (the native writer module is compiled here; a build failure stops everything).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
if ! python -c "import torch, megatron.core, pybind11, pytest, hypothesis, psutil, safetensors" 2>/dev/null; then
  # torch is pinned so pip never resolves a CUDA build; megatron-core 0.16.1 is the newest for Python 3.11.
  pip install --quiet "torch==2.13.0" "megatron-core>=0.16.1,<0.20" psutil "pybind11>=2.12" pytest hypothesis safetensors numpy setuptools wheel
fi
if ! python -c "import datastates._native" 2>/dev/null || [ csrc -nt .venv/.native-built ] || [ -n "$(find csrc setup.py -newer .venv/.native-built 2>/dev/null)" ]; then
  pip install --quiet --no-build-isolation --no-deps -e .
  touch .venv/.native-built
fi
