#!/usr/bin/env bash
# The CUDA check, for the GPU machines this project is checked on: one H100 80 GB or H200 141 GB, offline, with
# their own python3 (3.12) and torch (2.11), and no megatron-core. Two steps:
#
#   here:   bash scripts/gpu_check.sh --prepare
#           puts what such a machine lacks into gpu_bundle/ (ignored by git, about 37 MiB; at most 48 MiB): the
#           megatron-core 0.19.2 wheel for CPython 3.12 x86-64, datastates._native built for CPython 3.12,
#           nvCOMP's wheels (nvidia-nvcomp-cu13, nvidia-libnvcomp-cu13) for part (d)'s GPU codecs, and psutil's
#           for part (e).
#   there:  bash scripts/gpu_check.sh          (the device tool: carry gpu_bundle, timeout_s=600)
#           uses the machine's python3 and torch as they are (PYTHON, default python3): installs gpu_bundle/'s
#           wheels with pip --no-index into gpu_bundle/site, puts the native module into datastates/, sets
#           PYTHONPATH to this tree then gpu_bundle/site, and runs the parts below on one CUDA device (the first
#           of CUDA_VISIBLE_DEVICES). Nothing is downloaded, nothing else installed, no venv made.
#   --setup-only: the there-step's set-up and an import check of everything the parts import, then exit.
#   GPU_CHECK_PARTS="c d": only those parts after the set-up (default "a b c d"), to rerun what failed; (d)'s
#                codecs need (b)'s checkpoint and are skipped without it.
#
# The parts, each under its own cap (seconds on a GPU; the caps sum to 585 s; on an H200 the set-up, (a) and (b)
# took 126 s; (c)'s large state is 8 GB again, two saves and one restore, and (d)'s profile 4 GB to make room):
#   set-up  70   install from the bundle, check that torch sees the GPU, import the trainer and megatron-core
#   (a)     45   pytest tests/test_cuda.py: the ordering of the side-stream copy after queued work, the lazy
#                snapshot and the fence, pinned staging within its budget, a load straight into device tensors
#   (b)    130   pretrain_gpt.py on 1 GPU, --bf16 --use-distributed-optimizer --async-ckpt --deterministic-mode,
#                stopped at 10, resumed to 20, every loss compared with an uninterrupted run's for equality; on a
#                difference the uninterrupted run is repeated: if the two differ, the GPU is not deterministic run
#                to run, the line says so, and the resumed run passes within twice their largest difference
#                (scripts/compare_losses.py --again); if they agree, the resume is wrong and the part fails
#   (c)    240   benchmarks/run_all.py --device cuda: every system on a 1 GB state on the GPU (stall, durable,
#                restore, the snapshot's device-to-host GB/s beside a plain pinned copy's) and a loop of bf16
#                matrix products (~0.5 s a step) with a checkpoint every iteration against the same loop
#                without, for this engine and the async peers, each restore twice (each engine mode once first:
#                a first load's set-up is then visible); then this engine alone on an 8 GB state
#                (GPU_CHECK_LARGE_GB) with a staging budget of 1.1 times it, its first save timed too; then
#                issue 58's targets, one TARGET line each (the snapshot against the plain copy at both sizes,
#                first and later saves; blocking; pinned staging the same at every save; the loop against its
#                floor), figures, never a failure
#   (d)    100   diagnostics, never a failure of the check: benchmarks/snapshot_profile.py on a 4 GB state
#                (GPU_CHECK_PROFILE_GB; where the snapshot's time goes: plain copy, per tensor, into slots cold and
#                warm, the engine's first and second save, a fresh engine's first and second load) and
#                benchmarks/gpu_codecs.py (nvCOMP's codecs on (b)'s trained state: ratio, GB/s, and what
#                compressing before the copy would cost)
#   total  585
#   (e)    270   only with GPU_CHECK_PARTS naming it (its own device call: set-up and (e) fit in 340 s): issue 44's
#                --save-hf benchmark on the machine's CPUs, a core per rank (benchmarks/hf_export.py --ranks 4, the
#                110 MB model, then --large --shard-mb 50, one round each; GPU_CHECK_HF_SIZES="gigabyte" runs
#                --gigabyte --shard-mb 100 instead); figures, never a failure; in a rehearsal
#                (GPU_CHECK_DEVICE=cpu) the --quick model at 2 ranks
#   (f)    200   only with GPU_CHECK_PARTS naming it (its own device call: set-up and (f) fit in 270 s): issue 65's
#                fully sharded runs of (b)'s model (--untie-embeddings-and-output-weights): --use-torch-fsdp2 --bf16
#                --async-ckpt stopped at 10, resumed to 20, every loss against an uninterrupted run's as (b) compares
#                them (the largest per-save stall on its line); then --use-megatron-fsdp --bf16 for 20 iterations
#                (CUDA only; its trainer checkpoints are refused until wired, so no stop/resume yet); in a
#                rehearsal the FSDP2 half runs and the Megatron-FSDP half is its refusal on CPU ranks, reported as
#                "needs CUDA" (not a failure)
#   (g)    240   only with GPU_CHECK_PARTS naming it (its own device call: set-up and (g) fit in 310 s): issue 68's
#                policy hand-off with the trainer on the card (benchmarks/rl_weights.py --quick --rl: bf16 at lr
#                1e-6, a version every step; no publication, versions to 2 readers on this node, their deltas, a
#                relay over TCP): the loop against no publication, each version's latency from the optimizer
#                step to every reader holding it and its bytes, then on the card the last version's plain pinned
#                copy, a reader's load onto the device and (two devices only) a NCCL broadcast of the same bytes
#                (benchmarks/rl_device.py); figures, never a failure unless the run fails; in a rehearsal 4
#                iterations, 1 reader, without the relay
# One PASS/FAIL line per part with its key figure; exit 1 if any part fails. Under OUT (default
# bench_out/gpu_check; the device tool's $OUT when it sets one), at most 8 files in one call (the default parts
# write 6, each of (e), (f) and (g) 3 in its own call), all of which come back:
#   check.log (everything printed), figures.json, a_test_cuda.log, b_trainer.log, c_bench.log, d_diagnostics.log,
#   e_hf_export.log, f_fsdp.log, g_rl_weights.log
# Checkpoints go to WORK (default bench_out/gpu_check_work), which is removed at the end.
#
# GPU_CHECK_DEVICE=cpu: the same steps and parts on the CPU, smaller (a rehearsal; scripts/gpu_rehearsal.sh runs it
# in a venv shaped like the GPU machines'); (a) then skips, and the caps are CAP_SCALE (default 8) times longer.
set -uo pipefail  # no -e: every part runs and reports
cd "$(dirname "$0")/.."
ROOT=$PWD
BUNDLE=${GPU_BUNDLE:-$ROOT/gpu_bundle}  # where --prepare puts it and the there-step takes it
MEGATRON_CORE=megatron-core==0.19.2
NVCOMP="nvidia-nvcomp-cu13==6.0.0.12 nvidia-libnvcomp-cu13==6.0.0.12"  # (d) only: the GPU codecs measured
PSUTIL="psutil==7.2.2"  # (e) only: the benchmark's peak host memory
say() { echo "gpu_check: $*"; }

prepare() {  # here: the bundle, from the package registry and this tree's csrc/
  local py312=${PYTHON312:-python3.12} tmp
  if ! "$py312" -c pass 2>/dev/null; then
    for cand in "$(pyenv root 2>/dev/null)"/versions/3.12*/bin/python3.12; do [ -x "$cand" ] && py312=$cand; done
  fi
  "$py312" -c 'import sys; assert sys.version_info[:2] == (3, 12)' || { say "--prepare needs python3.12 (PYTHON312)"; return 1; }
  rm -rf "$BUNDLE" && mkdir -p "$BUNDLE/wheels" "$BUNDLE/native"
  tmp=$(mktemp -d)
  # the wheels the GPU machines lack (their requirements, torch, numpy and packaging, are there)
  python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d "$BUNDLE/wheels" "$MEGATRON_CORE" $NVCOMP $PSUTIL \
    || return 1
  # the native module for CPython 3.12 (it links no torch: any torch runs it); built in a copy of csrc/
  "$py312" -m pip wheel --quiet --no-deps -w "$tmp/wheel" "$ROOT" || return 1
  python3 -m zipfile -e "$tmp"/wheel/datastates_llm-*.whl "$tmp/unpacked" || return 1
  cp "$tmp"/unpacked/datastates/_native.cpython-312-*.so "$BUNDLE/native/" || return 1
  rm -rf "$tmp"
  (cd "$BUNDLE" && { date -u +"made %Y-%m-%dT%H:%M:%SZ on $(hostname) from $(git -C "$ROOT" rev-parse --short HEAD)"
                     find wheels native -type f -printf '%s %p\n'; } >MANIFEST)
  local size
  size=$(du -sm "$BUNDLE" | cut -f1)
  [ "$size" -le 48 ] || { say "gpu_bundle/ is ${size} MiB, over the 48 MiB it may carry"; return 1; }
  say "gpu_bundle/ ready (${size} MiB):"; sed 's/^/  /' "$BUNDLE/MANIFEST"
}

case "${1:-}" in
  --prepare) prepare; exit $? ;;
  --setup-only|"") ;;
  *) echo "usage: bash scripts/gpu_check.sh [--prepare | --setup-only]" >&2; exit 2 ;;
esac

DEVICE=${GPU_CHECK_DEVICE:-cuda}
case "$DEVICE" in
  cuda) SCALE=1; export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}; CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES%%,*}
        SIDE_GB=1 LARGE_GB=${GPU_CHECK_LARGE_GB:-8} PROFILE_GB=${GPU_CHECK_PROFILE_GB:-4} LOOP_S=0.5 HIDDEN=256 SEQ=256 ;;
  cpu)  SCALE=${CAP_SCALE:-8}; export CUDA_VISIBLE_DEVICES=
        SIDE_GB=0.1 LARGE_GB=0.3 PROFILE_GB=0.3 LOOP_S=0.2 HIDDEN=64 SEQ=64 ;;  # bf16 is slow on CPUs
  *) echo "GPU_CHECK_DEVICE must be cuda or cpu, not '$DEVICE'" >&2; exit 2 ;;
esac
PY=${PYTHON:-python3}
OUT=${OUT:-bench_out/gpu_check}
WORK=${WORK:-bench_out/gpu_check_work}
mkdir -p "$OUT" && rm -f "$OUT"/{check.log,figures.json,a_test_cuda.log,b_trainer.log,c_bench.log,d_diagnostics.log,e_hf_export.log,f_fsdp.log,g_rl_weights.log}
rm -rf "$WORK" && mkdir -p "$WORK"
OUT=$(cd "$OUT" && pwd) WORK=$(cd "$WORK" && pwd)
exec > >(tee "$OUT/check.log") 2>&1
START=$SECONDS
export FIGURES=$WORK/figures  # one JSON per part, merged into $OUT/figures.json at the end
mkdir -p "$FIGURES"
SUMMARY=()
FAILED=0
result() {  # result PART PASS|FAIL|SKIP TEXT
  SUMMARY+=("$1 $2: $3")
  [ "$2" = FAIL ] && FAILED=1
  say "$1 $2: $3 [$((SECONDS - START)) s in]"
}
finish() {
  "$PY" - "$FIGURES" "$OUT/figures.json" "${SUMMARY[@]}" <<'PYEOF'
import glob, json, os, sys
figures = {os.path.basename(p)[:-5]: json.load(open(p)) for p in sorted(glob.glob(os.path.join(sys.argv[1], "*.json")))}
figures["summary"] = sys.argv[3:]
json.dump(figures, open(sys.argv[2], "w"), indent=1)
PYEOF
  rm -rf "$WORK"
  echo
  say "summary (${INFO:-no device information}; $((SECONDS - START)) s)"
  for l in "${SUMMARY[@]}"; do echo "  $l"; done
  if [ "$FAILED" = 0 ]; then say "PASS"; else say "FAIL"; fi
  exit "$FAILED"
}
cap() { echo $(($1 * SCALE)); }

# ---------------------------------------------------------------- set-up: from the bundle only
say "set-up: $PY ($("$PY" --version 2>&1)), bundle $BUNDLE, device $DEVICE"
if [ ! -d "$BUNDLE/wheels" ]; then
  result "set-up" FAIL "no gpu_bundle/ here: run 'bash scripts/gpu_check.sh --prepare' on a machine with the package registry and carry gpu_bundle"
  finish
fi
export PIP_NO_INDEX=1 PIP_CONFIG_FILE=/dev/null PIP_DISABLE_PIP_VERSION_CHECK=1
if "$PY" -m pip --version >/dev/null 2>&1; then
  install=("$PY" -m pip install --quiet --no-deps --target "$BUNDLE/site" --upgrade "$BUNDLE"/wheels/*.whl)
else  # no pip in that python: a wheel is a zip of what goes on the path
  install=(sh -c 'for w in "$0"/wheels/*.whl; do "$1" -m zipfile -e "$w" "$0/site" || exit 1; done' "$BUNDLE" "$PY")
fi
if ! timeout "$(cap 30)" "${install[@]}"; then
  result "set-up" FAIL "could not install gpu_bundle/wheels into gpu_bundle/site (${install[*]:0:3})"
  finish
fi
cp "$BUNDLE"/native/_native.cpython-*.so datastates/
export PYTHONPATH=$ROOT:$BUNDLE/site${PYTHONPATH:+:$PYTHONPATH}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4} PYTHONWARNINGS=ignore CUBLAS_WORKSPACE_CONFIG=:4096:8
INFO=$(timeout "$(cap 40)" "$PY" - "$DEVICE" 2>&1 <<'PYEOF'
import json, os, subprocess, sys
import torch
device = sys.argv[1]
import datastates, datastates._native  # noqa: F401  this tree's engine with the bundle's native module
import megatron.core, megatron.training  # noqa: F401
from megatron.training import cpu_shim  # noqa: F401  this tree's trainer, not megatron-core 0.17+'s own
assert megatron.core.__file__.startswith(os.environ["PYTHONPATH"].split(":")[1]), megatron.core.__file__
info = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": sys.version.split()[0],
        "megatron_core": megatron.core.__version__}
if device == "cuda":
    assert torch.cuda.is_available(), f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA device"
    info["card"] = torch.cuda.get_device_name(0)
    info["memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                         text=True)
    info["driver"] = smi.stdout.strip() or "?"
json.dump(info, open(os.path.join(os.environ["FIGURES"], "device.json"), "w"), indent=1)
print(", ".join(f"{k} {v}" for k, v in info.items()))
PYEOF
)
rc=$?
if [ "$rc" != 0 ]; then
  echo "$INFO"
  INFO=$(echo "$INFO" | tail -n 1)
  [ "$rc" = 124 ] && INFO="over its cap of $(cap 40) s (the imports and the first CUDA call); last line: $INFO"
  result "set-up" FAIL "exit $rc: $INFO"
  finish
fi
INFO=$(echo "$INFO" | tail -n 1)
result "set-up" PASS "$INFO"
[ "${1:-}" = --setup-only ] && finish
PARTS=" ${GPU_CHECK_PARTS:-a b c d} "
part() { [[ "$PARTS" == *" $1 "* ]]; }

# ---------------------------------------------------------------- (a) the engine's CUDA tests
if part a; then
say "(a) pytest tests/test_cuda.py   (log: $OUT/a_test_cuda.log)"
timeout "$(cap 45)" "$PY" -m pytest -q -rs -p no:cacheprovider tests/test_cuda.py >"$OUT/a_test_cuda.log" 2>&1
rc=$?
last=$(grep -E '[0-9]+ (passed|failed|skipped|error)' "$OUT/a_test_cuda.log" | tail -n 1 | tr -d '=' | xargs)
passed=$(echo "$last" | sed -n 's/.*\b\([0-9]\+\) passed.*/\1/p')
if [ "$rc" = 124 ]; then
  result "(a) tests/test_cuda.py" FAIL "over its cap of $(cap 45) s"
elif [ "$rc" != 0 ]; then
  result "(a) tests/test_cuda.py" FAIL "exit $rc: ${last:-no pytest summary}"; tail -n 30 "$OUT/a_test_cuda.log"
elif [ "$DEVICE" = cpu ]; then
  result "(a) tests/test_cuda.py" SKIP "$last (no CUDA device in a rehearsal)"
elif [ "${passed:-0}" -ge 5 ]; then
  result "(a) tests/test_cuda.py" PASS "$last"
else
  result "(a) tests/test_cuda.py" FAIL "fewer than the 5 single-device tests ran: $last"
fi
echo "{\"exit\": $rc, \"pytest\": \"$last\"}" >"$FIGURES/a_test_cuda.json"
fi

# ---------------------------------------------------------------- (b) bf16 trainer: stop, resume, compare
ITERS=20 HALF=10 INTERVAL=5
TINY=(--num-layers 4 --hidden-size "$HIDDEN" --num-attention-heads 8 --seq-length "$SEQ" --max-position-embeddings "$SEQ"
      --vocab-size 1024 --micro-batch-size 4 --global-batch-size 8 --train-iters "$ITERS" --lr 3e-3
      --lr-warmup-iters 2 --lr-decay-style cosine --mock-data --seed 1234 --log-interval 1 --deterministic-mode --bf16)
LAZY=(--ckpt-format datastates --async-ckpt --save-interval "$INTERVAL")
MODEL=("${TINY[@]}" --use-distributed-optimizer "${LAZY[@]}")
B_LOG=$OUT/b_trainer.log
B_END=$((SECONDS + $(cap 130)))
trainer() {  # trainer PART END LOG NAME ARGS...: one 1-process torchrun job of pretrain_gpt.py until END (what is
  local part=$1 end=$2 log=$3 name=$4 left=$(($2 - SECONDS))  # left of PART's cap), its log appended to LOG
  shift 4
  [ "$left" -gt 5 ] || { say "($part) no time left for $name"; return 1; }
  say "($part) $name (at most $left s)"
  echo "======== $name" >>"$log"
  timeout "$left" "$PY" -m torch.distributed.run --standalone --nproc_per_node 1 pretrain_gpt.py "$@" \
    >"$WORK/${part}_$name.log" 2>&1
  local rc=$?
  cat "$WORK/${part}_$name.log" >>"$log"
  [ "$rc" = 0 ] || { say "($part) $name failed (exit $rc); the end of its log:"; tail -n 20 "$WORK/${part}_$name.log"; }
  return "$rc"
}
compare() { "$PY" scripts/compare_losses.py --iters "$ITERS" "$@"; }
stop_resume() {  # stop_resume PART END LOG DIR ARGS...: stopped at HALF and resumed to ITERS, every loss against an
  local part=$1 end=$2 log=$3 dir=$4  # uninterrupted run's; on a difference that run is repeated: if the two differ,
  shift 4                             # the GPU is not deterministic run to run and the resume passes within twice
  local logs=("$WORK/${part}_1-stop-at-$HALF.log" "$WORK/${part}_2-resume-to-$ITERS.log" "$WORK/${part}_3-uninterrupted.log")
  # their largest difference (compare_losses.py --again). Sets VERDICT and DETAIL; returns 1 unless it passed.
  if ! { trainer "$part" "$end" "$log" "1-stop-at-$HALF" "$@" --save "$dir/resumed" --load "$dir/resumed" \
           --exit-interval "$HALF" &&
         trainer "$part" "$end" "$log" "2-resume-to-$ITERS" "$@" --save "$dir/resumed" --load "$dir/resumed" &&
         trainer "$part" "$end" "$log" "3-uninterrupted" "$@" --save "$dir/straight"; }; then
    VERDICT=failed DETAIL="a training run failed or ran over the part's cap (log $log)"; return 1
  fi
  if DETAIL=$(compare --half "$HALF" "${logs[@]}"); then VERDICT=exact; return 0; fi
  say "($part) the losses differ: $DETAIL; repeating the uninterrupted run to tell a resume bug from a non-deterministic GPU"
  if ! trainer "$part" "$end" "$log" "4-uninterrupted-again" "$@" --save "$dir/straight2"; then
    VERDICT=failed DETAIL="the losses differ ($DETAIL), and the repeated uninterrupted run failed"; return 1
  fi
  if DETAIL=$(compare --half "$HALF" "${logs[@]}" --again "$WORK/${part}_4-uninterrupted-again.log"); then
    VERDICT=within-run-to-run-spread; return 0
  fi
  VERDICT=resume-differs; return 1
}
B=$WORK/b_ckpt  # kept for (d)'s codecs: the trained state
b_json() { echo "{\"verdict\": \"$1\", \"detail\": $(printf '%s' "$2" | "$PY" -c 'import json,sys; print(json.dumps(sys.stdin.read()))')}" >"$FIGURES/b_trainer.json"; }
if part b; then
  if stop_resume b "$B_END" "$B_LOG" "$B" "${MODEL[@]}"; then
    result "(b) bf16 stop/resume" PASS "$DETAIL"
  else
    result "(b) bf16 stop/resume" FAIL "$DETAIL"
  fi
  b_json "$VERDICT" "$DETAIL"
fi

# ---------------------------------------------------------------- (c) side by side on the device, then the large state
if part c; then
say "(c) benchmarks/run_all.py --device $DEVICE: ${SIDE_GB} GB side by side with the loop, then ${LARGE_GB} GB (log: $OUT/c_bench.log)"
C_END=$((SECONDS + $(cap 240)))
run_all() {  # run_all OUT ARGS...: within what is left of (c)'s cap
  local out=$1 left=$((C_END - SECONDS))
  shift
  [ "$left" -gt 5 ] || return 124
  timeout "$left" "$PY" benchmarks/run_all.py --device "$DEVICE" --out "$out" --ckpt-dir "$WORK/c_ckpt" \
    --mem-config "" --trainer off --no-publish --restore-reps 1 "$@" >>"$OUT/c_bench.log" 2>&1
}
run_all "$WORK/c_side" --grid "${SIDE_GB}x1" --reps 2 --loop-config "${SIDE_GB}x1" --loop-iters 10 \
  --loop-compute-s "$LOOP_S" --loop-intervals 1 --loop-systems engine_lazy,dcp_async,torch_dist_async --restore-reps 2
rc_side=$?
# a staging budget that holds the whole state, so the snapshot runs at the copy's speed, not the disk's; two
# timed saves, the first one included (staging pinned at start: the first save as fast as the later ones)
run_all "$WORK/c_large" --grid "${LARGE_GB}x1" --systems engine_lazy --reps 2 --warmup 0 --raw-reads stream \
  --engine-buffer-gb "$(awk "BEGIN {print $LARGE_GB * 1.1}")" --loop-config ""
rc_large=$?
"$PY" benchmarks/gpu_figures.py "$WORK/c_side" "$WORK/c_large" --json "$FIGURES/c_bench.json" >"$WORK/c_figures.txt" 2>&1
grep '^TARGET ' "$WORK/c_figures.txt" | sed 's/^/  /'  # issue 58's targets, met or not: figures, never a failure
line=$(tail -n 1 "$WORK/c_figures.txt")
if [ "$rc_side" = 124 ] || [ "$rc_large" = 124 ]; then
  result "(c) side by side" FAIL "over its cap of $(cap 240) s; so far: ${line#SUMMARY * }"
elif [[ "$line" == "SUMMARY PASS "* ]] && [ "$rc_side" = 0 ] && [ "$rc_large" = 0 ]; then
  result "(c) side by side" PASS "${line#SUMMARY PASS }"
else
  result "(c) side by side" FAIL "exit $rc_side/$rc_large: ${line#SUMMARY FAIL }"
  tail -n 30 "$OUT/c_bench.log"
fi
fi

# ---------------------------------------------------------------- (d) diagnostics: figures, never a failure
if part d; then
say "(d) benchmarks/snapshot_profile.py on ${PROFILE_GB} GB, benchmarks/gpu_codecs.py on (b)'s state (log: $OUT/d_diagnostics.log)"
D_END=$((SECONDS + $(cap 100)))
timeout "$(cap 75)" "$PY" benchmarks/snapshot_profile.py --gb "$PROFILE_GB" --dir "$WORK/d_snap" --device "$DEVICE" \
  --json "$FIGURES/d_snapshot_profile.json" >>"$OUT/d_diagnostics.log" 2>&1
rc_profile=$?
trained=$(ls -d "$B"/straight/iter_* 2>/dev/null | tail -n 1)
if [ "$DEVICE" != cuda ]; then
  rc_codecs="skipped (no CUDA device)"
elif [ -z "$trained" ]; then
  rc_codecs="skipped (no checkpoint of (b))"
elif ! "$PY" -c 'from nvidia import nvcomp' 2>>"$OUT/d_diagnostics.log"; then
  rc_codecs="skipped (nvCOMP does not import: its wheels are not in the bundle)"
else
  left=$((D_END - SECONDS)); [ "$left" -gt 5 ] || left=5
  timeout "$left" "$PY" benchmarks/gpu_codecs.py "$trained" --json "$FIGURES/d_gpu_codecs.json" \
    >>"$OUT/d_diagnostics.log" 2>&1
  rc_codecs="exit $?"
fi
grep -E "^snapshot_profile: (plain|slots_warm|engine_2)" "$OUT/d_diagnostics.log" | sed 's/^/  /'
result "(d) diagnostics" INFO "snapshot_profile exit $rc_profile, gpu_codecs $rc_codecs (figures in figures.json)"
fi
# ---------------------------------------------------------------- (e) --save-hf at a core per rank (only when asked)
if part e; then
read -ra sizes <<<"${GPU_CHECK_HF_SIZES:-full large}"  # full: 110 MB, large: 425 MB, gigabyte: 1.08 GB
[ "$DEVICE" = cpu ] && sizes=(quick)  # a rehearsal: the smallest model, the plumbing only
say "(e) benchmarks/hf_export.py on the CPUs: ${sizes[*]} (log: $OUT/e_hf_export.log)"
E_END=$((SECONDS + $(cap 270)))
e_rc=()
for size in "${sizes[@]}"; do
  left=$((E_END - SECONDS)); [ "$left" -gt 5 ] || { e_rc+=("$size: no time left"); continue; }
  flags=(--ranks 4 --rounds 1 --out "$WORK/e_$size")
  case $size in
    large) flags+=(--large --shard-mb 50) ;;
    gigabyte) flags+=(--gigabyte --shard-mb 100) ;;
    quick) flags=(--quick --ranks 2 --out "$WORK/e_$size") ;;
  esac
  echo "======== $size: ${flags[*]}" >>"$OUT/e_hf_export.log"
  CUDA_VISIBLE_DEVICES= timeout "$left" "$PY" benchmarks/hf_export.py "${flags[@]}" >>"$OUT/e_hf_export.log" 2>&1
  e_rc+=("$size: exit $?")
  rm -rf "$WORK/e_$size"
done
grep -E "^(loop|exports|offline|storage floor|bytes passed)" "$OUT/e_hf_export.log" | sed 's/^/  /'
result "(e) --save-hf, a core per rank" INFO "${e_rc[*]} (figures in e_hf_export.log)"
fi
# ---------------------------------------------------------------- (f) fully sharded: FSDP2 and Megatron-FSDP (only when asked)
if part f; then
say "(f) the tiny model fully sharded: --use-torch-fsdp2, then --use-megatron-fsdp (log: $OUT/f_fsdp.log)"
F_LOG=$OUT/f_fsdp.log F_END=$((SECONDS + $(cap 200))) F=$WORK/f_ckpt
SHARDED=("${TINY[@]}" --untie-embeddings-and-output-weights)  # FSDP2 refuses tied output weights
ftrain() { trainer f "$F_END" "$F_LOG" "$@"; }
f_fail=0
stop_resume f "$F_END" "$F_LOG" "$F" "${SHARDED[@]}" --use-torch-fsdp2 "${LAZY[@]}" || f_fail=1
fsdp2="$VERDICT: $DETAIL"
# Megatron-FSDP: CUDA only. The trainer refuses its checkpoints until they are wired (docs/fsdp.md), so on a card
# it trains the same model without them; on CPU ranks the refusal itself is what runs.
if [ "$DEVICE" != cuda ]; then  # the run must stop at its start, naming the flag and the reason
  echo "======== mfsdp-refused" >>"$F_LOG"
  timeout "$(cap 30)" "$PY" -m torch.distributed.run --standalone --nproc_per_node 1 pretrain_gpt.py "${SHARDED[@]}" \
    --use-megatron-fsdp >"$WORK/f_mfsdp-refused.log" 2>&1
  cat "$WORK/f_mfsdp-refused.log" >>"$F_LOG"
  refusal=$(grep -o -m 1 -- "--use-megatron-fsdp: Megatron-FSDP is a CUDA-only implementation" "$WORK/f_mfsdp-refused.log")
  if [ -n "$refusal" ]; then mfsdp="needs CUDA (refused on CPU ranks: '$refusal ...')"; else
    mfsdp="not refused on CPU ranks as a CUDA-only implementation (log $F_LOG)"; f_fail=1; fi
elif ftrain mfsdp-train "${SHARDED[@]}" --use-megatron-fsdp; then
  last=$(grep -o "iteration *$ITERS/.*lm loss: [^ ]*" "$WORK/f_mfsdp-train.log" | grep -o "lm loss: [^ ]*")
  mfsdp="trains $ITERS iterations (${last:-no loss logged}); stop/resume pending: its trainer checkpoints are not wired"
  [ -n "$last" ] || f_fail=1
else
  mfsdp="the run failed (log $F_LOG)"; f_fail=1
fi
"$PY" - "$FIGURES/f_fsdp.json" "$fsdp2" "$mfsdp" <<'PYEOF'
import json, sys
json.dump({"fsdp2": sys.argv[2], "megatron_fsdp": sys.argv[3]}, open(sys.argv[1], "w"), indent=1)
PYEOF
if [ "$f_fail" = 0 ]; then
  result "(f) fully sharded stop/resume" PASS "FSDP2 $fsdp2 | Megatron-FSDP $mfsdp"
else
  result "(f) fully sharded stop/resume" FAIL "FSDP2 $fsdp2 | Megatron-FSDP $mfsdp"
fi
fi
# ---------------------------------------------------------------- (g) the policy hand-off from the card (only when asked)
if part g; then
say "(g) benchmarks/rl_weights.py, the trainer on the $DEVICE (log: $OUT/g_rl_weights.log)"
g_flags=(--quick --rl --iters 10 --modes none,publish,publish-deltas,remote --out "$WORK/g")
[ "$DEVICE" = cpu ] && g_flags=(--quick --rl --iters 4 --readers 1 --modes none,publish --out "$WORK/g")
timeout "$(cap 240)" "$PY" benchmarks/rl_weights.py "${g_flags[@]}" >"$OUT/g_rl_weights.log" 2>&1
rc=$?
grep -E "^(\| |device |the trainer on|CPU figures)" "$OUT/g_rl_weights.log" | sed 's/^/  /'
[ -f "$WORK/g/results.json" ] && cp "$WORK/g/results.json" "$FIGURES/g_rl_weights.json"
publish=$(grep -E "^\| publish \|" "$OUT/g_rl_weights.log" | head -n 1)
if [ "$rc" = 0 ] && [ -n "$publish" ]; then
  result "(g) policy hand-off" INFO "$publish (figures in g_rl_weights.log)"
else
  result "(g) policy hand-off" FAIL "exit $rc$([ "$rc" = 124 ] && echo ": over its cap of $(cap 240) s") (log g_rl_weights.log)"
  tail -n 20 "$OUT/g_rl_weights.log"
fi
fi
rm -rf "$B"
finish
