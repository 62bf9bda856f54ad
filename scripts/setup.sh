#!/usr/bin/env bash
# Idempotent set-up on a fresh machine: a venv in .venv with this project installed in place from
# pyproject.toml (the engine, the trainer's and tools' extras, the test tools), the native module compiled from
# csrc/ (a build failure stops everything). Later runs do nothing unless pyproject.toml, setup.py or csrc/
# changed. EXTRAS picks the extras (default megatron,tools,test; add bench for benchmarks/).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
EXTRAS=${EXTRAS:-megatron,tools,test}
# CPU torch, pinned: pip must never resolve a plain or newer torch (that is a multi-GB CUDA build).
TORCH_PIN=${TORCH_PIN:-torch==2.13.0}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
stamp=".venv/.installed"  # line 1: what the install was built from; line 2: the extras it has
sources="$TORCH_PIN $(cat pyproject.toml setup.py csrc/* | cksum)"
if [ -f "$stamp" ] && [ "$(sed -n 1p "$stamp")" = "$sources" ] && .venv/bin/python -c "import datastates._native" 2>/dev/null; then
  have=",$(sed -n 2p "$stamp"),"
  missing=$(echo "$EXTRAS" | tr ',' '\n' | while read -r x; do [[ "$have" == *",$x,"* ]] || echo "$x"; done)
  [ -z "$missing" ] && exit 0
  EXTRAS="$(sed -n 2p "$stamp"),$EXTRAS"
fi
echo "setting up .venv (extras: $EXTRAS; $TORCH_PIN)..." >&2
# build requirements first (no build isolation: the native module builds against this venv's pybind11)
.venv/bin/python -m pip install --quiet "$TORCH_PIN" "pybind11>=2.12" "setuptools>=64" wheel
.venv/bin/python -m pip install --quiet --no-build-isolation "$TORCH_PIN" -e ".[$EXTRAS]"
printf '%s\n%s\n' "$sources" "$EXTRAS" > "$stamp"
