"""End to end with the real trainer: pretrain_gpt.py (a small GPT on CPU) for N iterations with a checkpoint
every iteration, per checkpoint format, against the same run without checkpoints.

Training time = from the start of the first iteration (its log line's time minus its elapsed time) until
"> training done" (all checkpoints durable and published), measured from the arrival time of the trainer's
output lines, so process start-up and model construction are excluded. Runs are interleaved over rounds.
"""
from __future__ import annotations

import os
import re
import shutil
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RE_ITER = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*elapsed time per iteration \(ms\): ([\d.]+)")
RE_CKPT = re.compile(r"checkpoint iteration\s+\d+ \| format: \S+ \(\w+\) \| stall ms: ([\d.]+).*"
                     r"time to durable ms: ([\d.]+) \| bytes: (\d+)")
RE_CKPT_SUM = re.compile(r"checkpoint summary iteration\s+\d+ .*max stall ms over ranks: ([\d.]+) \| "
                         r"max time to durable ms: ([\d.]+) \| bytes all ranks: (\d+)")

MODEL = ["--num-layers", "6", "--hidden-size", "512", "--num-attention-heads", "8", "--seq-length", "128",
         "--max-position-embeddings", "128", "--vocab-size", "8192", "--micro-batch-size", "2",
         "--global-batch-size", "2", "--lr", "1e-4", "--lr-decay-style", "constant", "--mock-data",
         "--log-interval", "1"]
RUNS = [("no checkpoint", None), ("datastates (lazy async)", ["--ckpt-format", "datastates", "--async-ckpt"]),
        ("datastates (sync)", ["--ckpt-format", "datastates"]), ("torch_dist (sync)", ["--ckpt-format", "torch_dist"]),
        ("torch (sync)", ["--ckpt-format", "torch"])]
# megatron-core's bf16 state: bf16 params, DistributedOptimizer with fp32 main params and moments (the state real
# runs checkpoint); compared with its own no-checkpoint run. bf16 matmuls are slow on CPUs without bf16 units.
BF16 = ["--bf16", "--use-distributed-optimizer"]
BF16_RUNS = [("bf16 + distributed optimizer: no checkpoint", None),
             ("bf16 + distributed optimizer: datastates (lazy async)", ["--ckpt-format", "datastates", "--async-ckpt"]),
             ("bf16 + distributed optimizer: torch_dist (sync)", ["--ckpt-format", "torch_dist"])]
# A Mixtral-style mixture of experts (SwiGLU experts, top-2 of 8, RMSNorm, RoPE) with megatron-core's chained
# dense + expert distributed optimizer: the state MoE runs checkpoint, against its own no-checkpoint run.
MOE = ["--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear", "--position-embedding-type", "rope",
       "--untie-embeddings-and-output-weights", "--num-experts", "8", "--moe-router-topk", "2",
       "--moe-ffn-hidden-size", "256", "--moe-aux-loss-coeff", "0.01", "--use-distributed-optimizer"]
MOE_RUNS = [("MoE 8 experts top-2 + distributed optimizer: no checkpoint", None),
            ("MoE 8 experts top-2 + distributed optimizer: datastates (lazy async)",
             ["--ckpt-format", "datastates", "--async-ckpt"]),
            ("MoE 8 experts top-2 + distributed optimizer: torch_dist (sync)", ["--ckpt-format", "torch_dist"])]
# FSDP2 (megatron-core's TorchFullyShardedDataParallel on the one rank, bf16): the lazy engine against its own
# synchronous save and its own no-checkpoint run (megatron-core's savers take no FSDP2 state: docs/fsdp.md)
FSDP2 = ["--use-torch-fsdp2", "--untie-embeddings-and-output-weights", "--bf16"]
FSDP2_RUNS = [("FSDP2 bf16: no checkpoint", None),
              ("FSDP2 bf16: datastates (lazy async)", ["--ckpt-format", "datastates", "--async-ckpt"]),
              ("FSDP2 bf16: datastates (sync)", ["--ckpt-format", "datastates"])]


def _one(name, extra, iters, ckpt, timeout=600, model_extra=()):
    cmd = [sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), *MODEL, *model_extra, "--train-iters", str(iters)]
    if extra is not None:
        cmd += ["--save", ckpt, "--save-interval", "1", "--ckpt-keep-last", "1", *extra]
    env = dict(os.environ, PYTHONWARNINGS="ignore", MASTER_ADDR="127.0.0.1", MASTER_PORT="29533", RANK="0",
               WORLD_SIZE="1", LOCAL_RANK="0", OMP_NUM_THREADS="1")
    shutil.rmtree(ckpt, ignore_errors=True)
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT)
    first = done = None
    tail, ckpts, sums = [], [], []
    t_start = time.time()
    for line in p.stdout:
        now = time.perf_counter()
        tail = (tail + [line])[-15:]
        if (m := RE_ITER.search(line)) and first is None:
            first = now - float(m[2]) / 1e3
        elif m := RE_CKPT_SUM.search(line):
            sums.append((float(m[1]) / 1e3, float(m[2]) / 1e3, int(m[3])))
        elif m := RE_CKPT.search(line):
            ckpts.append((float(m[1]) / 1e3, float(m[2]) / 1e3, int(m[3])))
        elif "> training done" in line:
            done = now
        if time.time() - t_start > timeout:
            p.kill()
            break
    rc = p.wait()
    shutil.rmtree(ckpt, ignore_errors=True)
    if rc != 0 or first is None or done is None:
        return {"name": name, "total_s": None, "error": f"rc={rc}: " + "".join(tail)[-600:]}
    rec = sums or ckpts
    out = {"name": name, "total_s": done - first}
    if rec:
        use = rec[1:] if len(rec) > 1 else rec
        out["blocking_median_s"] = statistics.median(r[0] for r in use)
        out["durable_median_s"] = statistics.median(r[1] for r in use)
        out["ckpt_bytes"] = rec[0][2]
    return out


def _group(runs, iters, rounds, ckpt, model_extra=()):
    """Interleaved rounds of `runs` (the first is the no-checkpoint baseline); their medians, each with it."""
    res: dict[str, list] = {}
    for rnd in range(rounds):
        order = runs if rnd % 2 == 0 else runs[::-1]
        for name, extra in order:
            r = _one(name, extra, iters, ckpt, model_extra=model_extra)
            res.setdefault(name, []).append(r)
            print(f"[trainer] {name:26s} " + (f"{r['total_s']:.2f} s" if r["total_s"] else f"FAILED {r['error'][-300:]}")
                  + (f", blocking {r['blocking_median_s'] * 1e3:.0f} ms/ckpt" if "blocking_median_s" in r else ""),
                  flush=True)
    out = []
    for name, _ in runs:
        ok = [r for r in res[name] if r["total_s"]]
        if not ok:
            out.append(res[name][0])
            continue
        m = {"name": name, "total_s": statistics.median(r["total_s"] for r in ok),
             "samples_s": [r["total_s"] for r in ok], "iters": iters}
        for k in ("blocking_median_s", "durable_median_s", "ckpt_bytes"):
            v = [r[k] for r in ok if k in r]
            if v:
                m[k] = statistics.median(v)
        out.append(m)
    base = out[0].get("total_s")
    for r in out[1:]:
        r["baseline_s"] = base
    return base, out[1:]


def run(out, required=False, iters=8, rounds=2, bf16_iters=3, moe_iters=4, fsdp2_iters=3):
    if not os.path.exists(os.path.join(ROOT, "pretrain_gpt.py")):
        if required:
            raise SystemExit("pretrain_gpt.py does not exist yet")
        print("pretrain_gpt.py not found: skipping the trainer end-to-end runs")
        return None
    ckpt = os.path.join(out, "ckpt", "trainer")
    base, runs = _group(RUNS, iters, rounds, ckpt)
    if bf16_iters:
        runs += _group(BF16_RUNS, bf16_iters, 1, ckpt, model_extra=BF16)[1]
    if moe_iters:
        runs += _group(MOE_RUNS, moe_iters, 1, ckpt, model_extra=MOE)[1]
    if fsdp2_iters:
        runs += _group(FSDP2_RUNS, fsdp2_iters, 1, ckpt, model_extra=FSDP2)[1]
    cb = next((r.get("ckpt_bytes") for r in runs if r.get("ckpt_bytes")), None)
    desc = (f"GPT 6 layers, hidden 512, vocab 8192 on 1 CPU process (1 thread), {iters} iterations, checkpoint every "
            f"iteration ({cb / 1e6:.0f} MB per checkpoint)" if cb else f"{iters} iterations, checkpoint every iteration")
    if bf16_iters:
        desc += f"; bf16 rows: {bf16_iters} iterations, 1 round, against their own no-checkpoint run"
    if moe_iters:
        desc += (f"; MoE rows (same sizes, SwiGLU experts with FFN 256, fp32): {moe_iters} iterations, 1 round, "
                 "against their own no-checkpoint run")
    if fsdp2_iters:
        desc += f"; FSDP2 rows (bf16): {fsdp2_iters} iterations, 1 round, against their own no-checkpoint run"
    return {"description": desc + f"; median of {rounds} interleaved rounds", "short": f"({iters} it, ckpt every it)",
            "baseline_s": base, "runs": runs, "iters": iters}
