#!/usr/bin/env bash
# Idempotent set-up on a fresh machine: a venv in .venv with this project installed in place from
# pyproject.toml (the engine, the trainer's and tools' extras, the test tools), the native module compiled from
# csrc/ (a build failure stops everything). Later runs do nothing unless pyproject.toml, setup.py or csrc/
# changed. EXTRAS picks the extras (default megatron,tools,test; add bench for benchmarks/). PYTHON picks the
# interpreter (PYTHON=python3.12 builds .venv-python3.12 with megatron-core 0.19; see scripts/env.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/env.sh
EXTRAS=${EXTRAS:-megatron,tools,test}
# torch, pinned in every environment: pip must never resolve a plain or newer torch. On Python 3.11 this pin is
# the CPU wheel on local disk; on 3.12 it is torch's CUDA build from the registry (~2 GB), which runs on CPU.
TORCH_PIN=${TORCH_PIN:-torch==2.13.0}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
stamp="$VENV/.installed"  # line 1: what the install was built from; line 2: the extras it has
sources="$TORCH_PIN $(cat pyproject.toml setup.py csrc/* | cksum)"
if [ -f "$stamp" ] && [ "$(sed -n 1p "$stamp")" = "$sources" ] && "$VENV/bin/python" -c "import datastates._native" 2>/dev/null; then
  have=",$(sed -n 2p "$stamp"),"
  missing=$(echo "$EXTRAS" | tr ',' '\n' | while read -r x; do [[ "$have" == *",$x,"* ]] || echo "$x"; done)
  [ -z "$missing" ] && exit 0
  EXTRAS="$(sed -n 2p "$stamp"),$EXTRAS"
fi
echo "setting up $VENV ($("$PY" --version); extras: $EXTRAS; $TORCH_PIN)..." >&2
# build requirements first (no build isolation: the native module builds against this venv's pybind11); no
# pip cache: on 3.12 it would keep a second copy of torch's CUDA wheels (GBs) on the disk the tests write to
pip=("$VENV/bin/python" -m pip install --quiet --no-cache-dir)
"${pip[@]}" "$TORCH_PIN" "pybind11>=2.12" "setuptools>=64" wheel
"${pip[@]}" --no-build-isolation "$TORCH_PIN" -e ".[$EXTRAS]"
printf '%s\n%s\n' "$sources" "$EXTRAS" > "$stamp"
