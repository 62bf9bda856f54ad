# Sourced by the examples/slurm/*.sbatch scripts: model configurations, the parallel layout, and run_train(),
# which launches pretrain_gpt.py on every node of the allocation with srun (one task per node) + torchrun.
#
# Environment (all optional):
#   REPO            repository root on a shared file system           [$SLURM_SUBMIT_DIR]
#   VENV            virtual environment to activate on every node      [$REPO/.venv if it exists]
#   MODEL           tiny | 3B | 7B | 13B | 30B | 70B                    [per script]
#   GPUS_PER_NODE   processes per node                                 [4]
#   TP              tensor-parallel size                               [4]
#   PP              pipeline-parallel size                             [number of nodes]
#   TRAIN_ITERS     iterations per run                                 [per script]
#   SEQ_LENGTH, MICRO_BATCH, GLOBAL_BATCH                              [2048, 1, DP*PP*MICRO_BATCH]
#   PRECISION       extra precision flags                              [--bf16 with GPUs, none without]
#   CKPT_ROOT       where checkpoints go (the parallel file system)    [$REPO/checkpoints/slurm]
#   LOG_DIR         where run logs go (read by plot.py)                [$REPO/logs/slurm]
#   HOST_BUFFER_GB  datastates host staging budget per rank            [trainer default]
#   EXTRA_ARGS      appended to the trainer's command line
#   RDZV            static (node rank = SLURM_NODEID) | c10d (its store in the first node's agent) | etcd (a
#                   service no training node hosts: start_etcd below)   [static]
#   ETCD_ENDPOINT   RDZV=etcd: HOST:PORT of the site's etcd (v2 API enabled); unset: this script starts one
#   MAX_RESTARTS    torchrun --max-restarts: a failed or hung rank restarts the job in place   [0]
#   MIN_NODES       elastic: the job goes on down to this many nodes (torchrun --nnodes MIN_NODES:NNODES, c10d or
#                   etcd; a lost node does not end the step, but under c10d the first must survive; set PP to fit
#                   the nodes left; docs/restarts.md says what must divide)   [NNODES]
set -euo pipefail

REPO=${REPO:-${SLURM_SUBMIT_DIR:-$(pwd)}}
cd "$REPO"
if [ -n "${VENV:-}" ]; then . "$VENV/bin/activate"; elif [ -f "$REPO/.venv/bin/activate" ]; then . "$REPO/.venv/bin/activate"; fi

NNODES=${SLURM_NNODES:-1}
CKPT_ROOT=${CKPT_ROOT:-$REPO/checkpoints/slurm}
LOG_DIR=${LOG_DIR:-$REPO/logs/slurm}
RDZV=${RDZV:-static}
HOSTS=($(scontrol show hostnames "$SLURM_JOB_NODELIST"))
TRAIN_NODES=()  # srun's options that keep training off the service's node
# RDZV=etcd without ETCD_ENDPOINT: one etcd for the whole batch script (each run a rendezvous id of its own), as a
# job step of its own on the allocation's last node, which then trains not (submit one node more); on a one-node
# allocation it shares the node, and is lost with it. Its data in a fresh directory: a requeued job starts anew.
# Without etcd (the elastic extra: pip install -e ".[elastic]"), today's c10d, whose first node must survive.
start_etcd() {
  if ! command -v etcd >/dev/null; then
    echo "NOTICE: RDZV=etcd but no etcd here (pip install -e \".[elastic]\"): c10d instead, its store in the first node's agent; that node must survive" >&2
    RDZV=c10d; return
  fi
  local host=${HOSTS[-1]} port=$((30000 + ${SLURM_JOB_ID:-0} % 20000)) dir=/tmp/etcd-${SLURM_JOB_ID:-0}-$$
  if [ "${#HOSTS[@]}" -gt 1 ]; then
    NNODES=$((NNODES - 1)); TRAIN_NODES=(--exclude "$host")
  else
    echo "NOTICE: RDZV=etcd on a one-node allocation: etcd shares the training node (submit one node more to keep it apart)" >&2
  fi
  ETCD_ENDPOINT=$host:$port
  srun --overlap --nodes 1 --ntasks 1 --nodelist "$host" --kill-on-bad-exit=0 bash -c "rm -rf $dir; exec etcd \
    --enable-v2 --name rdzv --data-dir $dir --listen-client-urls http://0.0.0.0:$port \
    --advertise-client-urls http://$ETCD_ENDPOINT --listen-peer-urls http://127.0.0.1:$((port + 1)) \
    --initial-advertise-peer-urls http://127.0.0.1:$((port + 1)) --initial-cluster rdzv=http://127.0.0.1:$((port + 1))" \
    >"$LOG_DIR/etcd-${SLURM_JOB_ID:-0}.out" 2>&1 &
  ETCD_STEP=$!
  trap 'kill $ETCD_STEP 2>/dev/null || true' EXIT
  for _ in $(seq 120); do
    etcdctl --endpoints "http://$ETCD_ENDPOINT" endpoint health >/dev/null 2>&1 && return
    kill -0 $ETCD_STEP 2>/dev/null || break
    sleep 0.5
  done
  echo "etcd did not answer on $ETCD_ENDPOINT: $LOG_DIR/etcd-${SLURM_JOB_ID:-0}.out" >&2; exit 1
}
if [ "$RDZV" = etcd ] && [ -z "${ETCD_ENDPOINT:-}" ]; then mkdir -p "$LOG_DIR"; start_etcd; fi
GPUS_PER_NODE=${GPUS_PER_NODE:-4}
TP=${TP:-4}
PP=${PP:-$NNODES}
WORLD=$((NNODES * GPUS_PER_NODE))
if [ $((WORLD % (TP * PP))) -ne 0 ]; then
  echo "world size $WORLD is not a multiple of TP*PP=$((TP * PP))" >&2; exit 2
fi
DP=$((WORLD / (TP * PP)))
MASTER_ADDR=${HOSTS[0]}
MASTER_PORT=${MASTER_PORT:-$((20000 + ${SLURM_JOB_ID:-0} % 20000))}
export MASTER_ADDR MASTER_PORT OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# torchrun's c10d rendezvous otherwise shares its store with the workers across restarts, and the nodes' agents
# can count restarts differently: each attempt then gets a fresh store of its own (docs/restarts.md)
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
MAX_RESTARTS=${MAX_RESTARTS:-0}
MIN_NODES=${MIN_NODES:-$NNODES}
if [ "$MIN_NODES" -lt "$NNODES" ] && { [ "$RDZV" = static ] || [ "$MAX_RESTARTS" = 0 ]; }; then
  echo "MIN_NODES=$MIN_NODES < $NNODES nodes needs RDZV=c10d or etcd and MAX_RESTARTS > 0 (the survivors restart)" >&2; exit 2
fi

# GPT configurations of the paper's model sizes (Llama-like shapes; parameters ~= 12 * L * h^2 + embedding).
model_config() {
  case "$1" in
    tiny) NUM_LAYERS=4;  HIDDEN=128;  HEADS=4;  SEQ_DEFAULT=64;   VOCAB=1024 ;;
    3B)   NUM_LAYERS=32; HIDDEN=2560; HEADS=32; SEQ_DEFAULT=2048; VOCAB=32000 ;;
    7B)   NUM_LAYERS=32; HIDDEN=4096; HEADS=32; SEQ_DEFAULT=2048; VOCAB=32000 ;;
    13B)  NUM_LAYERS=40; HIDDEN=5120; HEADS=40; SEQ_DEFAULT=2048; VOCAB=32000 ;;
    30B)  NUM_LAYERS=64; HIDDEN=6144; HEADS=48; SEQ_DEFAULT=2048; VOCAB=32000 ;;
    70B)  NUM_LAYERS=80; HIDDEN=8192; HEADS=64; SEQ_DEFAULT=2048; VOCAB=32000 ;;
    *) echo "unknown MODEL=$1 (tiny|3B|7B|13B|30B|70B)" >&2; exit 2 ;;
  esac
  if [ $((NUM_LAYERS % PP)) -ne 0 ]; then
    echo "MODEL=$1 has $NUM_LAYERS layers, not divisible by PP=$PP" >&2; exit 2
  fi
  SEQ=${SEQ_LENGTH:-$SEQ_DEFAULT}
  MBS=${MICRO_BATCH:-1}
  GBS=${GLOBAL_BATCH:-$((DP * PP * MBS))}
}

if [ -z "${PRECISION+x}" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then PRECISION=--bf16; else PRECISION=; fi
fi

# Prefix every line with the wall-clock time (seconds since the epoch, microseconds), for plot.py.
timestamp_lines() { while IFS= read -r line; do printf '%s %s\n' "$EPOCHREALTIME" "$line"; done; }

# run_train FIGURE FORMAT[:async] INTERVAL ITERS
#   INTERVAL 0 = no checkpoint. Writes $LOG_DIR/FIGURE/<model>_n<nodes>_tp<tp>_pp<pp>_dp<dp>_<format>[-async]_k<interval>.log
run_train() {
  local figure=$1 fmtspec=$2 interval=$3 iters=$4
  local fmt=${fmtspec%%:*} mode=sync
  [ "$fmtspec" != "$fmt" ] && mode=${fmtspec#*:}
  local name="${MODEL}_n${NNODES}_tp${TP}_pp${PP}_dp${DP}_${fmt}$([ "$mode" = async ] && echo -async)_k${interval}"
  [ "$interval" = 0 ] && name="${MODEL}_n${NNODES}_tp${TP}_pp${PP}_dp${DP}_none_k0"
  mkdir -p "$LOG_DIR/$figure"
  local log="$LOG_DIR/$figure/$name.log" ckpt="$CKPT_ROOT/$SLURM_JOB_ID/$name"
  local args=(
    --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP"
    --num-layers "$NUM_LAYERS" --hidden-size "$HIDDEN" --num-attention-heads "$HEADS"
    --seq-length "$SEQ" --max-position-embeddings "$SEQ" --vocab-size "$VOCAB"
    --micro-batch-size "$MBS" --global-batch-size "$GBS" --train-iters "$iters"
    --lr 1e-4 --lr-decay-style constant --mock-data --log-interval 1 $PRECISION
  )
  if [ "$interval" != 0 ]; then
    args+=(--save "$ckpt" --save-interval "$interval" --ckpt-format "$fmt" --ckpt-keep-last 2)
    [ "$mode" = async ] && args+=(--async-ckpt)
    [ "$MAX_RESTARTS" != 0 ] && args+=(--load "$ckpt")  # a restarted attempt resumes where the failed one was
    [ -n "${HOST_BUFFER_GB:-}" ] && args+=(--ckpt-host-buffer-gb "$HOST_BUFFER_GB")
  fi
  # shellcheck disable=SC2206
  args+=(${EXTRA_ARGS:-})
  local launcher
  if [ "$RDZV" = etcd ]; then  # its state outlives this run: an id per run, and per requeue of the job
    launcher="torchrun --nnodes $MIN_NODES:$NNODES --nproc_per_node $GPUS_PER_NODE --rdzv_id $SLURM_JOB_ID.${SLURM_RESTART_COUNT:-0}.$name --rdzv_backend etcd-v2 --rdzv_endpoint $ETCD_ENDPOINT"
  elif [ "$RDZV" = c10d ]; then
    launcher="torchrun --nnodes $MIN_NODES:$NNODES --nproc_per_node $GPUS_PER_NODE --rdzv_id $SLURM_JOB_ID --rdzv_backend c10d --rdzv_endpoint $MASTER_ADDR:$MASTER_PORT"
  else
    launcher="torchrun --nnodes $NNODES --nproc_per_node $GPUS_PER_NODE --rdzv_id $SLURM_JOB_ID --master_addr $MASTER_ADDR --master_port $MASTER_PORT"
  fi
  launcher+=" --max-restarts $MAX_RESTARTS"
  echo "RUN figure=$figure model=$MODEL nodes=$NNODES gpus_per_node=$GPUS_PER_NODE tp=$TP pp=$PP dp=$DP format=$fmt mode=$mode interval=$interval iters=$iters job=$SLURM_JOB_ID" | timestamp_lines >"$log"
  echo "[$(date +%T)] $name -> $log"
  local t0=$EPOCHREALTIME rc=0
  # One srun task per node; SLURM_NODEID is expanded on each node (single quotes), the rest here.
  # elastic: a lost node's task neither ends the others (--kill-on-bad-exit=0) nor the step (--no-kill)
  local keep=(--kill-on-bad-exit=1)
  [ "$MIN_NODES" -lt "$NNODES" ] && keep=(--kill-on-bad-exit=0 --no-kill)
  srun --nodes "$NNODES" --ntasks-per-node 1 "${TRAIN_NODES[@]}" "${keep[@]}" --export=ALL \
    bash -c "$launcher --node_rank \$SLURM_NODEID $REPO/pretrain_gpt.py ${args[*]}" 2>&1 \
    | timestamp_lines >>"$log" || rc=$?
  echo "RUN_END rc=$rc wall_s=$(awk -v a="$EPOCHREALTIME" -v b="$t0" 'BEGIN { printf "%.3f", a - b }')" | timestamp_lines >>"$log"
  rm -rf "$ckpt"
  return $rc
}
