#!/usr/bin/env bash
# The GPU check rehearsed on this CPU machine, as the GPU machine will run it, so its minutes are not spent on
# set-up bugs:
#
#   bash scripts/gpu_rehearsal.sh [--setup-only]
#
# 1. gpu_bundle/ (GPU_BUNDLE) is prepared (scripts/gpu_check.sh --prepare) unless it is there already.
# 2. .venv-gpu-machine is made like the GPU machines' python3 (scripts/gpu_machine_env.py): Python 3.12 with their
#    packages, linked from the Python 3.12 test venv (SOURCE_VENV, default .venv-python3.12, set up if missing), and
#    none they lack (megatron-core, boto3, multi-storage-client, this project); MACHINE_VENV names it. REHEARSAL_TORCH=2.11.0 puts that torch
#    in it instead (the GPU machines' own; one download of ~530 MB, kept in the venv for later rehearsals).
# 3. The files the device tool would copy (tracked, and untracked ones git does not ignore) and gpu_bundle/ are
#    copied to a temporary directory, and the there-step runs in it with that venv's python, pip allowed no index
#    and no configuration (GPU_CHECK_DEVICE=cpu: every part on the CPU, smaller). Its files land in
#    OUT (default bench_out/gpu_rehearsal).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
SOURCE_VENV=${SOURCE_VENV:-.venv-python3.12}
MACHINE_VENV=$(realpath -m "${MACHINE_VENV:-.venv-gpu-machine}")
export GPU_BUNDLE=$(realpath -m "${GPU_BUNDLE:-gpu_bundle}")
if [ ! -x "$SOURCE_VENV/bin/python" ]; then
  PYTHON=python3.12 VENV=$SOURCE_VENV bash scripts/setup.sh
fi
[ -d "$GPU_BUNDLE/wheels" ] || bash scripts/gpu_check.sh --prepare
torch_wheel=()
if [ -n "${REHEARSAL_TORCH:-}" ]; then
  mkdir -p "$MACHINE_VENV.wheels"
  ls "$MACHINE_VENV.wheels"/torch-"$REHEARSAL_TORCH"-*.whl >/dev/null 2>&1 ||
    python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 -d "$MACHINE_VENV.wheels" "torch==$REHEARSAL_TORCH"
  torch_wheel=(--torch "$(ls "$MACHINE_VENV.wheels"/torch-"$REHEARSAL_TORCH"-*.whl | head -n 1)")
fi
want="${torch_wheel[*]:-linked torch} $(cksum <scripts/gpu_machine_env.py)"
if [ "$(cat "$MACHINE_VENV/.made-from" 2>/dev/null)" != "$want" ]; then
  rm -rf "$MACHINE_VENV"
  python3 scripts/gpu_machine_env.py "$SOURCE_VENV" "$MACHINE_VENV" "${torch_wheel[@]}"
  echo "$want" >"$MACHINE_VENV/.made-from"
fi
tree=$(mktemp -d)
trap 'rm -rf "$tree"' EXIT
git ls-files -z --cached --others --exclude-standard | while IFS= read -r -d '' f; do
  [ -e "$f" ] && { mkdir -p "$tree/$(dirname "$f")"; cp -p "$f" "$tree/$f"; }
done
cp -r "$GPU_BUNDLE" "$tree/gpu_bundle"
OUT=${OUT:-$ROOT/bench_out/gpu_rehearsal}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$tree"
env -u VIRTUAL_ENV -u PYTHONPATH -u GPU_BUNDLE GPU_CHECK_DEVICE=cpu PYTHON="$MACHINE_VENV/bin/python" OUT="$OUT" \
  bash scripts/gpu_check.sh "$@"
