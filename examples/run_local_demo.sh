#!/usr/bin/env bash
# The README's main job: a tiny GPT trained on CPU with 4 ranks (TP2 x DP2, gloo) and lazy asynchronous
# checkpoints; stopped at iteration HALF, resumed to ITERS, the loss carrying on; then each checkpoint's training
# stall next to what a synchronous save of the same state costs (datastates sync, megatron-core torch_dist).
# It exits non-zero when the stopped-and-resumed run's losses are not bit-identical to the uninterrupted run's,
# or when an iteration's loss is missing from either (CI runs it: .ci/run).
#
#   bash examples/run_local_demo.sh [OUT_DIR]          (about 2-5 minutes on 2 CPU cores)
#   PYTHON=python3.12 bash examples/run_local_demo.sh  (the same on Python 3.12 + megatron-core 0.19)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh  # idempotent: the same venv as the test command (PYTHON=python3.12: the second environment)
. scripts/env.sh
OUT=${1:-/tmp/datastates_demo}
NPROC=${NPROC:-4}
ITERS=${ITERS:-20}
HALF=$((ITERS / 2))
INTERVAL=${INTERVAL:-5}
PY=$VENV/bin/python
export OMP_NUM_THREADS=1 PYTHONWARNINGS=ignore
rm -rf "$OUT" && mkdir -p "$OUT"

MODEL=(--tensor-model-parallel-size 2 --num-layers 4 --hidden-size 128 --num-attention-heads 4
       --seq-length 64 --vocab-size 512 --micro-batch-size 4 --global-batch-size 16
       --train-iters "$ITERS" --lr 3e-3 --lr-warmup-iters 2 --lr-decay-style cosine --mock-data --seed 1234)

# step TITLE LOG ARGS...: one torchrun job; its whole output goes to LOG, the iteration and checkpoint lines to
# the terminal as they come; on failure the end of LOG is shown and the demo stops. --standalone: torchrun's
# rendezvous on a free port of its own choosing, so two demos (or a demo and the tests) never collide.
step() {
  local title=$1 log=$2
  shift 2
  echo "== $title   (log: $log)"
  if ! "$PY" -m torch.distributed.run --standalone --nproc_per_node "$NPROC" pretrain_gpt.py "$@" \
      2>&1 | tee "$log" | awk '/lm loss|checkpoint|exiting|loaded|training done|Error|error:/ {print "   " $0; fflush()}'; then
    echo "!! '$title' failed; the last lines of $log:" >&2
    tail -n 40 "$log" >&2
    exit 1
  fi
}

step "1/4 lazy async checkpoints every $INTERVAL iterations, stop at iteration $HALF" "$OUT/lazy_part1.log" \
  "${MODEL[@]}" --save "$OUT/lazy" --load "$OUT/lazy" --save-interval "$INTERVAL" --async-ckpt --exit-interval "$HALF"
echo "   latest_checkpointed_iteration.txt: $(cat "$OUT/lazy/latest_checkpointed_iteration.txt")"
step "2/4 resume from $OUT/lazy and train to $ITERS" "$OUT/lazy_part2.log" \
  "${MODEL[@]}" --save "$OUT/lazy" --load "$OUT/lazy" --save-interval "$INTERVAL" --async-ckpt
step "3/4 the same state saved synchronously: datastates sync" "$OUT/sync.log" \
  "${MODEL[@]}" --save "$OUT/sync" --save-interval "$INTERVAL" --ckpt-format datastates
step "3/4 the same state saved synchronously: megatron-core torch_dist" "$OUT/torch_dist.log" \
  "${MODEL[@]}" --save "$OUT/torch_dist" --save-interval "$INTERVAL" --ckpt-format torch_dist

echo "== 4/4 training stall per checkpoint (max over ranks, ms)"
"$PY" - "$OUT" "$HALF" "$ITERS" <<'PYEOF'
import re, sys
out = sys.argv[1]
pat = re.compile(r"checkpoint summary iteration\s+(\d+) .*max stall ms over ranks: ([\d.]+) \| max time to durable ms: ([\d.]+) \| bytes all ranks: (\d+)")
def read(*names):
    rows = {}
    for n in names:
        for m in pat.finditer(open(f"{out}/{n}").read()):
            rows[int(m.group(1))] = (float(m.group(2)), float(m.group(3)), int(m.group(4)))
    return rows
lazy, sync, td = read("lazy_part1.log", "lazy_part2.log"), read("sync.log"), read("torch_dist.log")
print(f"{'iter':>6} {'bytes':>10} | {'lazy stall':>10} {'lazy durable':>12} | {'sync datastates':>15} | {'sync torch_dist':>15}")
for it in sorted(lazy):
    s = sync.get(it, (float('nan'),) * 3); t = td.get(it, (float('nan'),) * 3)
    print(f"{it:>6} {lazy[it][2]:>10} | {lazy[it][0]:>10.1f} {lazy[it][1]:>12.1f} | {s[0]:>15.1f} | {t[0]:>15.1f}")
PYEOF
# the resumed run against the uninterrupted synchronous one, loss by loss (exit 1 naming what differs)
if ! verdict=$("$PY" scripts/compare_losses.py --half "$HALF" --iters "$ITERS" \
    "$OUT/lazy_part1.log" "$OUT/lazy_part2.log" "$OUT/sync.log"); then
  echo "!! FAIL: the stopped-and-resumed run does not reproduce the uninterrupted run's losses: $verdict" >&2
  echo "   logs: $OUT/lazy_part1.log, lazy_part2.log, sync.log" >&2
  exit 1
fi
echo "stop+resume against the uninterrupted synchronous run: $verdict: OK"
