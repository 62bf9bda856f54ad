"""What a restart inside one job costs: torchrun --max-restarts 1, one rank SIGKILLed from outside.

A 2-rank job (DP2, gloo, the GPT below) runs under real torchrun; once rank 1 has logged iteration K, a
worker is SIGKILLed (mid-iteration K+1, the memory save of K possibly still copying). torchrun restarts the
workers and the job finishes. Measured, with the memory tier every iteration and storage every S against storage
every S alone:

  - death to first iteration: from the kill to the first iteration line after the restart;
  - iterations lost: the newest iteration logged before the kill minus the iteration resumed from;
  - the resume's load time (the trainer's load line) and its level;
  - cold start: launch to the first iteration line of a fresh job (no checkpoint), the same command.

The target (issue 42): death to first iteration <= 1.5 x (cold start + the memory-tier load).

    python benchmarks/restart.py [--rounds 2] [--kill-after 17] [--out /tmp/restart_bench]
    python benchmarks/restart.py --quick --out DIR   # a tiny GPT, 1 round, the kill after iteration 5
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8", "--seq-length", "128",
         "--max-position-embeddings", "128", "--vocab-size", "8192", "--micro-batch-size", "2",
         "--global-batch-size", "4", "--lr", "1e-4", "--lr-decay-style", "constant", "--mock-data",
         "--log-interval", "1"]
TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--max-position-embeddings", "32", "--vocab-size", "128", "--micro-batch-size", "2",
        "--global-batch-size", "4", "--lr", "1e-4", "--lr-decay-style", "constant", "--mock-data",
        "--log-interval", "1"]
RE_ITER = re.compile(r"\[rank 1\] .*iteration\s+(\d+)/")
RE_LOADED = re.compile(r"successfully loaded checkpoint from (.*?) \(datastates\) at iteration (\d+) in ([\d.]+) ms")


def _workers(agent: int) -> dict[int, int]:
    """local rank -> pid of the agent's worker processes."""
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) != agent:
                    continue
            with open(f"/proc/{name}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        except (OSError, ValueError, IndexError):
            continue
        if b"LOCAL_RANK" in env:
            out[int(env[b"LOCAL_RANK"])] = int(name)
    return out


def run(flags: list[str], kill_after: int | None, workdir: str, model: list[str] = MODEL) -> dict:
    """One torchrun job; with `kill_after`, local rank 1 is SIGKILLed once iteration `kill_after` is logged."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "--max-restarts", "1", os.path.join(ROOT, "pretrain_gpt.py"), *model, *flags]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHONPATH=ROOT,
               DATASTATES_JOB_ID=f"bench-restart-{os.getpid()}")
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
    first, killed_at, newest_before, after, loaded, log = None, None, None, None, None, []
    for line in p.stdout:
        now = time.perf_counter()
        log.append(line)
        m = RE_ITER.search(line)
        if m and killed_at is None:
            first = first if first is not None else now - t0
            newest_before = int(m.group(1))
            if kill_after is not None and newest_before >= kill_after:
                os.kill(_workers(p.pid)[1], signal.SIGKILL)
                killed_at = now
        elif m and after is None:
            after = now - killed_at
        if (lm := RE_LOADED.search(line)) and killed_at is not None:
            loaded = (lm.group(1), int(lm.group(2)), float(lm.group(3)))
    if p.wait() != 0:
        raise RuntimeError(f"the job exited with {p.returncode}:\n{''.join(log[-60:])}")
    out = {"cold_start_s": first}
    if kill_after is not None:
        if loaded is None or after is None:
            raise RuntimeError("the restarted job did not resume:\n" + "".join(log[-60:]))
        out.update(death_to_first_iteration_s=after, newest_before_kill=newest_before, resumed_from=loaded[1],
                   iterations_lost=newest_before - loaded[1],
                   level="memory tier" if "memory tier" in loaded[0] else "storage", load_ms=loaded[2])
    return out


def main(argv=None) -> None:
    a = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a.add_argument("--rounds", type=int, default=2)
    a.add_argument("--kill-after", type=int, default=17)
    a.add_argument("--storage-every", type=int, default=10)
    a.add_argument("--out", default=None, help="work directory (default: a fresh temporary one)")
    a.add_argument("--quick", action="store_true",
                   help="a tiny GPT, 1 round, the kill after iteration 5, storage every 3 iterations")
    args = a.parse_args(argv)
    model = MODEL
    if args.quick:
        args.rounds, args.kill_after, args.storage_every, model = 1, 5, 3, TINY
    out = args.out or tempfile.mkdtemp(prefix="restart_bench_")
    os.makedirs(out, exist_ok=True)
    iters = str(args.kill_after + 6)
    systems = {"memory tier every iteration + storage": ["--non-persistent-save-interval", "1"],
               "storage only": []}
    rows = {name: [] for name in systems}
    cold = []
    for r in range(args.rounds):
        cold.append(run(["--train-iters", iters], None, out, model)["cold_start_s"])
        for name, extra in systems.items():
            ck = os.path.join(out, "ck")
            shutil.rmtree(ck, ignore_errors=True)
            flags = ["--train-iters", iters, "--save", ck, "--load", ck, "--save-interval", str(args.storage_every),
                     "--async-ckpt", "--non-persistent-local-ckpt-dir", os.path.join(out, "mem"), *extra]
            rows[name].append(run(flags, args.kill_after, out, model))
            print(f"round {r} {name}: {rows[name][-1]}", flush=True)
    cold_s = statistics.median(cold)
    print(f"\ncold start (launch to first iteration), median of {len(cold)}: {cold_s:.2f} s")
    print("| system | death to first iteration s | iterations lost | resumed from | load ms |")
    print("|---|---|---|---|---|")
    for name, rs in rows.items():
        print(f"| {name} | {statistics.median(x['death_to_first_iteration_s'] for x in rs):.2f} | "
              f"{statistics.median(x['iterations_lost'] for x in rs):g} | {rs[0]['level']} | "
              f"{statistics.median(x['load_ms'] for x in rs):.1f} |")
    memory = rows["memory tier every iteration + storage"]
    bound = 1.5 * (cold_s + statistics.median(x["load_ms"] for x in memory) / 1e3)
    print(f"target: death to first iteration <= 1.5 x (cold start + memory load) = {bound:.2f} s")
    with open(os.path.join(out, "restart.json"), "w") as f:
        json.dump({"cold_start_s": cold, "runs": rows, "target_s": bound}, f, indent=1)


if __name__ == "__main__":
    main()
