#!/usr/bin/env bash
# A single-node Slurm on this machine, to check the examples/slurm sbatch scripts for real (tiny GPT model).
#
#   scripts/slurm_local.sh setup    # install (apt) + configure + start munge, slurmctld, slurmd; idempotent
#   scripts/slurm_local.sh test     # setup, then submit every examples/slurm script with MODEL=tiny, wait,
#                                   # check each job's exit state, and plot the logs with examples/slurm/plot.py;
#                                   # exits non-zero when a job does not complete or a figure is missing
#   scripts/slurm_local.sh status   # sinfo + squeue
#   scripts/slurm_local.sh stop     # cancel this Slurm's jobs, stop the daemons this script started (CI runs
#                                   # test, then stop: .ci/run)
#
# What it sets up (Debian 12, Slurm 22.05, run as root, no systemd):
# - munge with the packaged key (created if missing), /run/munge owned by munge, munged run as munge;
# - /etc/slurm/slurm.conf for one node named after `hostname -s` at 127.0.0.1, with plugins that need neither
#   cgroups nor accounting (proctrack/linuxproc, task/none, jobacct_gather/none, accounting_storage/none);
# - the node claims CPUS (default 16) CPUs and 4 GPUs: SlurmdParameters=config_overrides lets it claim more
#   than it has, and the GPUs are fake character devices (/dev/fakegpu0-3, made with `mknod c 1 3`, i.e. like
#   /dev/null) named in gres.conf, so scripts written for 4-GPU nodes (--gres=gpu:4, --ntasks-per-node) schedule
#   unchanged. torch here is CPU-only; CUDA_VISIBLE_DEVICES=0,1,2,3 is set by Slurm and ignored.
# - state, spool and logs under $SLURM_LOCAL_DIR (default /var/tmp/slurm-local).
# - the jobs and plot.py use the project's venv (scripts/env.sh: PYTHON/VENV as for the test command), set up
#   here with the bench extra (matplotlib) added: EXTRAS=megatron,tools,test,bench scripts/setup.sh.
# Multi-node allocations (--nodes>1) cannot run on one node; the scripts are checked with -N 1 here, and
# their multi-node parts (MASTER_ADDR from the node list, torchrun --nnodes/--node_rank) run with one node.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
SL=${SLURM_LOCAL_DIR:-/var/tmp/slurm-local}
CPUS=${CPUS:-16}
HOST=$(hostname -s)
CONF=/etc/slurm/slurm.conf

log() { echo "[slurm_local] $*"; }

install_pkgs() {
  if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v sbatch >/dev/null \
     || ! command -v munged >/dev/null; then
    log "installing slurmctld slurmd slurm-client munge"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurmctld slurmd slurm-client munge >/dev/null
  fi
}

start_munge() {
  [ -s /etc/munge/munge.key ] || mungekey --create
  chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
  mkdir -p /run/munge /var/log/munge /var/lib/munge
  chown munge:munge /run/munge /var/log/munge /var/lib/munge
  if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    log "starting munged"
    rm -f /run/munge/munge.socket.2.lock
    runuser -u munge -- munged
    mkdir -p "$SL" && touch "$SL/munged.started"  # stop stops it again (and only a munged started here)
    sleep 1
  fi
  munge -n | unmunge >/dev/null
}

write_conf() {
  mkdir -p "$SL"/{state,spool,log} /etc/slurm
  for i in 0 1 2 3; do [ -c /dev/fakegpu$i ] || mknod /dev/fakegpu$i c 1 3; done
  local mem
  mem=$(awk '/MemTotal/ {printf "%d", $2/1024*0.9}' /proc/meminfo)
  local tmp
  tmp=$(mktemp)
  cat >"$tmp" <<EOF
# Written by scripts/slurm_local.sh: a one-node Slurm for checking examples/slurm. Not for production.
ClusterName=local
SlurmctldHost=${HOST}(127.0.0.1)
SlurmUser=root
AuthType=auth/munge
CryptoType=crypto/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
SlurmdParameters=config_overrides
GresTypes=gpu
StateSaveLocation=$SL/state
SlurmdSpoolDir=$SL/spool
SlurmctldPidFile=$SL/slurmctld.pid
SlurmdPidFile=$SL/slurmd.pid
SlurmctldLogFile=$SL/log/slurmctld.log
SlurmdLogFile=$SL/log/slurmd.log
SlurmctldPort=6817
SlurmdPort=6818
InactiveLimit=0
KillWait=10
MinJobAge=300
Waittime=0
SchedulerType=sched/backfill
NodeName=${HOST} NodeAddr=127.0.0.1 CPUs=${CPUS} RealMemory=${mem} Gres=gpu:4 State=UNKNOWN
PartitionName=debug Nodes=${HOST} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
EOF
  if ! cmp -s "$tmp" "$CONF" 2>/dev/null; then
    log "writing $CONF"
    cp "$tmp" "$CONF"
    CONF_CHANGED=1
  fi
  rm -f "$tmp"
  echo "NodeName=${HOST} Name=gpu File=/dev/fakegpu[0-3]" >/etc/slurm/gres.conf.new
  if ! cmp -s /etc/slurm/gres.conf.new /etc/slurm/gres.conf 2>/dev/null; then
    mv /etc/slurm/gres.conf.new /etc/slurm/gres.conf
    CONF_CHANGED=1
  else
    rm -f /etc/slurm/gres.conf.new
  fi
}

running() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

start_slurm() {
  if [ "${CONF_CHANGED:-0}" = 1 ]; then
    # a changed config needs fresh daemons (and a node that was INVAL must be resumed)
    running "$SL/slurmd.pid" && kill "$(cat "$SL/slurmd.pid")" && sleep 1 || true
    running "$SL/slurmctld.pid" && kill "$(cat "$SL/slurmctld.pid")" && sleep 1 || true
  fi
  if ! running "$SL/slurmctld.pid"; then
    log "starting slurmctld"
    slurmctld
  fi
  if ! running "$SL/slurmd.pid"; then
    log "starting slurmd"
    slurmd
  fi
  for _ in $(seq 60); do
    st=$(sinfo -h -n "$HOST" -o %T 2>/dev/null || true)
    case "$st" in
      idle*|mix*|alloc*) log "node $HOST is $st"; return 0 ;;
      *drain*|*inval*|down*) scontrol update nodename="$HOST" state=resume 2>/dev/null || true ;;
    esac
    sleep 1
  done
  log "node did not become idle; see $SL/log/"
  sinfo -N -l || true
  tail -20 "$SL/log/slurmctld.log" "$SL/log/slurmd.log" || true
  return 1
}

setup() {
  install_pkgs
  start_munge
  write_conf
  start_slurm
}

stop_pid() {  # stop_pid NAME PIDFILE: SIGTERM, then wait up to 30 s for it to go
  local pid
  running "$2" || return 0
  pid=$(cat "$2")
  log "stopping $1 (pid $pid)"
  kill "$pid"
  for _ in $(seq 30); do kill -0 "$pid" 2>/dev/null || return 0; sleep 1; done
  log "$1 (pid $pid) is still running after 30 s"
  return 1
}

stop() {
  local rc=0
  if running "$SL/slurmctld.pid" && [ -n "$(squeue -h -o %i 2>/dev/null)" ]; then
    log "cancelling this Slurm's jobs: $(squeue -h -o %i | tr '\n' ' ')"
    scancel $(squeue -h -o %i) || true
    for _ in $(seq 30); do [ -z "$(squeue -h -o %i 2>/dev/null)" ] && break; sleep 1; done
  fi
  stop_pid slurmd "$SL/slurmd.pid" || rc=1
  stop_pid slurmctld "$SL/slurmctld.pid" || rc=1
  if [ -f "$SL/munged.started" ]; then
    stop_pid munged /run/munge/munged.pid || rc=1
    rm -f "$SL/munged.started"
  fi
  return $rc
}

wait_job() {  # polling scontrol is faster than sbatch --wait; returns non-zero unless COMPLETED
  local id=$1 st
  while :; do
    st=$(scontrol show job "$id" 2>/dev/null | sed -n 's/.*JobState=\([A-Z_]*\).*/\1/p')
    case "$st" in
      PENDING|RUNNING|CONFIGURING|COMPLETING|"") sleep 2 ;;
      *) break ;;
    esac
  done
  log "job $id: $st"
  [ "$st" = COMPLETED ]
}

test_examples() {
  # the project's venv with the bench extra (plot.py needs matplotlib); idempotent, adds only what is missing
  EXTRAS=megatron,tools,test,bench bash scripts/setup.sh
  local venv
  venv=$(. scripts/env.sh && cd "$VENV" && pwd)
  setup
  local out=${OUT:-$REPO/bench_out/slurm_local}
  rm -rf "$out"; mkdir -p "$out"
  # The tiny model; few iterations; the engine and one peer, not every format (each format's save and resume
  # are the suite's tests; this checks the scripts, the launch and the figures). Everything else is what a
  # cluster run uses. -t 15: a job that hangs ends as TIMEOUT after 15 minutes (and fails the check) instead
  # of keeping the check waiting for hours.
  local common_env="ALL,REPO=$REPO,MODEL=tiny,TRAIN_ITERS=${TRAIN_ITERS:-4},LOG_DIR=$out/logs,CKPT_ROOT=$out/ckpt,GPUS_PER_NODE=4,VENV=$venv"
  local sb=(sbatch --parsable -N 1 -t 15 -o "$out/%x-%j.out")
  local ids=() names=()
  local j
  j=$("${sb[@]}" --export="$common_env,FORMATS=datastates:async torch_dist" \
        examples/slurm/ckpt_vs_model_size.sbatch); ids+=("$j"); names+=(model_size)
  j=$("${sb[@]}" --export="$common_env,FORMATS=datastates:async" \
        examples/slurm/ckpt_vs_dp_scale.sbatch); ids+=("$j"); names+=(dp_scale)
  # e2e: its rendezvous on an etcd that common.sh starts (on the one node here), two runs on one etcd
  j=$("${sb[@]}" --export="$common_env,FORMATS=datastates:async,INTERVALS=0 1,RDZV=etcd" \
        examples/slurm/e2e_every_iter.sbatch); ids+=("$j"); names+=(e2e)
  local fail=0
  for i in "${!ids[@]}"; do
    wait_job "${ids[$i]}" || { fail=1; log "FAIL: job ${names[$i]} did not complete; its output:"; tail -40 "$out"/*-"${ids[$i]}".out || true; }
  done
  grep -q "ready to serve client requests" "$out/logs/etcd-${ids[2]}.out" 2>/dev/null \
    || { fail=1; log "FAIL: the e2e job's etcd did not serve (RDZV=etcd fell back, or it did not start)"; }
  "$venv/bin/python" examples/slurm/plot.py --logs "$out/logs" --out "$out/figures" || { fail=1; log "FAIL: plot.py failed"; }
  ls -l "$out/figures" || true
  local f
  for f in summary.csv model_size.png dp_scale.png e2e.png; do
    [ -s "$out/figures/$f" ] || { fail=1; log "FAIL: figure $out/figures/$f is missing or empty"; }
  done
  if [ $fail = 0 ]; then
    log "PASS: all example jobs completed; logs in $out/logs, figures in $out/figures"
  else
    log "FAIL: see the lines above; job outputs in $out, Slurm's logs in $SL/log"
  fi
  return $fail
}

case "${1:-setup}" in
  setup) setup ;;
  test) test_examples ;;
  status) sinfo -N -l; squeue ;;
  stop) stop ;;
  *) echo "usage: $0 {setup|test|status|stop}" >&2; exit 2 ;;
esac
