#!/bin/bash
# Submits the whole sweep that reproduces the paper's figures on a cluster with 4 GPUs per node, then
# (after they finish) run: python examples/slurm/plot.py --logs logs/slurm --out logs/slurm/figures
#   examples/slurm/submit_sweep.sh [extra sbatch options, e.g. -A myproject -p gpu]
set -euo pipefail
cd "$(dirname "$0")/../.."
S=examples/slurm
# model size: TP=4 inside a node, one pipeline stage per node
for mn in 3B:1 7B:2 13B:4 30B:8 70B:20; do
  sbatch "$@" -N "${mn#*:}" --export=ALL,MODEL="${mn%%:*}" $S/ckpt_vs_model_size.sbatch
done
# DP scale: 7B with TP=4, PP=2 on 2..32 nodes (DP = 1..16)
for n in 2 4 8 16 32; do
  sbatch "$@" -N "$n" --export=ALL,MODEL=7B,PP=2 $S/ckpt_vs_dp_scale.sbatch
done
# end to end: checkpoint every iteration and every 10 vs. none
for mn in 7B:2 13B:4; do
  sbatch "$@" -N "${mn#*:}" --export=ALL,MODEL="${mn%%:*}" $S/e2e_every_iter.sbatch
done
