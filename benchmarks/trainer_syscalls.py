"""File-metadata system calls of the real trainer's checkpoints, per rank, under strace.

Runs pretrain_gpt.py with 4 ranks (TP2 x DP2, tiny GPT, CPU) saving a lazy checkpoint every iteration with
retention, then resumes from it; every rank runs under its own `strace -f -y`. Counts per rank the calls on
paths of the checkpoint tree that touch file-system metadata (open, stat, mkdir, rename, unlink, getdents,
fsync, ftruncate, fallocate; not the reads and writes of data), per checkpoint, and the JSON files each rank
opens to resume.

    python benchmarks/trainer_syscalls.py [--iters 6] [--out DIR]
    python benchmarks/trainer_syscalls.py --quick --out DIR   # 2 checkpoints, then the resume

Targets: at most 20 file-metadata syscalls per checkpoint per rank; at most 2 JSON files opened per rank at
resume.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--vocab-size", "128", "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "1e-3",
        "--mock-data", "--seed", "1234", "--tensor-model-parallel-size", "2"]
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from syscalls import metadata_call, opens_json  # noqa: E402


def traced_run(args: list[str], trace_prefix: str) -> None:
    """torchrun starts each worker as `strace ... python pretrain_gpt.py`: one trace file per rank."""
    wrapper = (f'exec {shutil.which("strace")} -f -qq -y -e trace=%file,%desc -o "{trace_prefix}.$RANK" '
               f'{sys.executable} {os.path.join(ROOT, "pretrain_gpt.py")} "$@"')
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4", "--master_port", "29777",
           "--no-python", "sh", "-c", wrapper, "worker", *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        raise SystemExit(f"trainer failed ({r.returncode}):\n{(r.stdout + r.stderr)[-3000:]}")


def count(trace: str, tree: str) -> tuple[int, int, float]:
    """(metadata calls on the checkpoint tree, JSON files opened there for reading, calls per checkpoint in the
    steady state) in one rank's trace. The steady state runs from the first save's mkdir to the last one's: one
    whole checkpoint per save in between, without the run's start-up and shutdown."""
    calls = jsons = 0
    starts = []
    with open(trace) as f:
        for line in f:
            call = metadata_call(line)
            if call and tree in call[1]:
                if call[0] == "mkdir" and '.partial"' in call[1]:
                    starts.append(calls)
                calls += 1
                jsons += opens_json(call)
    steady = (starts[-1] - starts[0]) / (len(starts) - 1) if len(starts) > 1 else float("nan")
    return calls, jsons, steady


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=6)
    ap.add_argument("--out", default=None, help="work directory, kept (default: a temporary one, removed)")
    ap.add_argument("--quick", action="store_true", help="2 checkpoints, then the resume")
    a = ap.parse_args(argv)
    if a.quick:
        a.iters = 2
    if not shutil.which("strace"):
        raise SystemExit("strace is needed (apt-get install strace)")
    work = a.out or tempfile.mkdtemp(prefix="ds-syscalls-")
    os.makedirs(work, exist_ok=True)
    ckpt = os.path.join(work, "ckpt")
    flags = TINY + ["--train-iters", str(2 * a.iters), "--save", ckpt, "--load", ckpt, "--save-interval", "1",
                    "--async-ckpt", "--ckpt-keep-last", "2"]
    traced_run(flags + ["--exit-interval", str(a.iters)], os.path.join(work, "save"))
    traced_run(flags + ["--exit-interval", str(a.iters + 1)], os.path.join(work, "resume"))
    for rank in range(4):
        saved, _, steady = count(os.path.join(work, f"save.{rank}"), ckpt)
        resumed, jsons, _ = count(os.path.join(work, f"resume.{rank}"), ckpt)
        print(f"rank {rank}: {steady:5.1f} file-metadata syscalls per checkpoint ({saved / a.iters:.1f} with the "
              f"run's start-up and shutdown spread over its {a.iters} checkpoints); resume: {resumed} calls (its "
              f"one save included), {jsons} JSON file(s) opened")
    if a.out is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
