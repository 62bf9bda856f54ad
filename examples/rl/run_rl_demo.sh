#!/usr/bin/env bash
# A tiny RL-shaped loop on CPU (docs/rl-weights.md): 2 trainer ranks (TP2, gloo) train a small Llama-shaped model
# and publish a policy version every step into shared memory, from the memory tier's snapshot; 2 rollout processes
# (examples/rl/rollout.py) take each new version as it comes (the first whole, then through the deltas) and
# generate a few tokens with it: `a` from the shared memory, `b` as a reader on another node would, over TCP from a
# relay (python -m datastates.weights.relay) beside the trainer. Neither side waits for the other.
#
#   bash examples/rl/run_rl_demo.sh [OUT_DIR]     (a minute or two on 2 CPU cores)
set -euo pipefail
cd "$(dirname "$0")/../.."
bash scripts/setup.sh
. scripts/env.sh
OUT=${1:-/tmp/datastates_rl_demo}
SHM=/dev/shm/datastates_rl_demo_$$
ITERS=${ITERS:-20}
PY=$VENV/bin/python
export OMP_NUM_THREADS=1 PYTHONWARNINGS=ignore PYTHONPATH=$PWD
rm -rf "$OUT" && mkdir -p "$OUT"
trap 'rm -rf "$SHM"; kill $(jobs -p) 2>/dev/null || true' EXIT

"$PY" -m datastates.weights.relay --dir "$SHM/policy" --host 127.0.0.1 --port 0 > "$OUT/relay.log" 2>&1 &
RELAY_PID=$!
until grep -q "relay: serving" "$OUT/relay.log"; do
  kill -0 "$RELAY_PID" 2>/dev/null || { cat "$OUT/relay.log"; exit 1; }
  sleep 0.2
done
RELAY=$(grep -o "127.0.0.1:[0-9]*" "$OUT/relay.log" | head -1)
"$PY" examples/rl/rollout.py "$SHM/policy" a "$ITERS" > "$OUT/rollout_a.log" 2>&1 &
ROLLOUTS=$!
"$PY" examples/rl/rollout.py --relay "$RELAY" b "$ITERS" > "$OUT/rollout_b.log" 2>&1 &
ROLLOUTS="$ROLLOUTS $!"
"$PY" -m torch.distributed.run --standalone --nproc_per_node 2 pretrain_gpt.py \
    --tensor-model-parallel-size 2 --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 \
    --vocab-size 128 --make-vocab-size-divisible-by 32 --position-embedding-type rope --normalization RMSNorm \
    --swiglu --ffn-hidden-size 96 --disable-bias-linear --untie-embeddings-and-output-weights \
    --micro-batch-size 2 --global-batch-size 4 --lr 1e-3 --mock-data --seed 1234 --train-iters "$ITERS" \
    --save "$OUT/ckpt" --save-interval "$ITERS" --async-ckpt \
    --non-persistent-save-interval 1 --non-persistent-local-ckpt-dir "$SHM/tier" \
    --publish-weights-dir "$SHM/policy" --publish-weights-interval 1 --publish-weights-deltas 8 \
    2>&1 | tee "$OUT/train.log" | awk '/lm loss|weights version|training done|Error/ {print "   " $0; fflush()}'
wait $ROLLOUTS
cat "$OUT"/rollout_*.log
grep -q "policy version $ITERS " "$OUT/rollout_a.log" && grep -q "policy version $ITERS " "$OUT/rollout_b.log"
