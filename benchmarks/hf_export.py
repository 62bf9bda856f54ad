#!/usr/bin/env python
"""--save-hf's cost, with the real trainer: the same run with and without a Hugging Face export at every checkpoint.

    python benchmarks/hf_export.py [--quick | --large | --gigabyte] [--ranks N] [--out DIR]

Reports (docs/huggingface.md, "Published while training"; issue 44's targets):
- loop ratio: the median `elapsed time per iteration` (iterations 2..N) with the export over without it (and each
  round's, the spread a single ratio hides);
- end-to-end ratio: first iteration's start to "> training done" (every checkpoint and export finished);
- publish latency: from the save call to the model published, against the checkpoint's own time to durable
  (the trainer's `published the Hugging Face model` line);
- the export's own work in the trainer (from the weights kept to every rank's files written; the rest of its time
  is the wait for the checkpoint to be published), and the offline converter on the same checkpoint:
  `convert_checkpoint.py --to hf` as a process (wall) and its export call in this process;
- the storage's floor for the same safetensors files: written and fsynced from 1 thread and from one per rank;
- the checkpoints' own time to durable with the export and without it (what the export's writes, on the same
  storage, cost the checkpoint's);
- the bytes of kept weights passed between the ranks per export (the rest each rank kept itself);
- peak host memory of the run's process tree (PSS, psutil) with and without, against the staging budget.
Runs alternate (without, with, with, without, ...); medians over --rounds.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

RE_ITER = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*elapsed time per iteration \(ms\): ([\d.]+)")
RE_DURABLE = re.compile(r"checkpoint summary iteration\s+(\d+) \|.*max time to durable ms: ([\d.]+)")
RE_HF = re.compile(r"published the Hugging Face model of iteration\s+(\d+): \S+ \| export ms: ([\d.]+) \| files "
                   r"written ms: ([\d.]+) \| ms from the save call: ([\d.]+) \| checkpoint's time to durable ms: "
                   r"([\d.]+) \| bytes passed between ranks: (\d+|-)")
LLAMA = ["--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
         "--untie-embeddings-and-output-weights", "--mock-data", "--lr", "1e-4", "--lr-decay-style", "constant",
         "--log-interval", "1", "--seed", "1234"]
FULL = ["--num-layers", "6", "--hidden-size", "512", "--ffn-hidden-size", "1408", "--num-attention-heads", "8",
        "--seq-length", "128", "--max-position-embeddings", "128", "--vocab-size", "8192"]
QUICK = ["--num-layers", "4", "--hidden-size", "256", "--ffn-hidden-size", "704", "--num-attention-heads", "8",
         "--seq-length", "64", "--max-position-embeddings", "64", "--vocab-size", "4096"]
LARGE = ["--num-layers", "8", "--hidden-size", "768", "--ffn-hidden-size", "2048", "--num-attention-heads", "12",
         "--seq-length", "128", "--max-position-embeddings", "128", "--vocab-size", "32000"]  # ~425 MB of fp32
GIGABYTE = ["--num-layers", "16", "--hidden-size", "1024", "--ffn-hidden-size", "2816", "--num-attention-heads", "16",
            "--seq-length", "128", "--max-position-embeddings", "128", "--vocab-size", "32000"]  # ~1.08 GB of fp32
# each size: its model, iterations (a checkpoint every 2) and staging budget per rank (GiB); --gigabyte's 2 GiB lets
# a save keep its 1 GiB of weights for the export
SIZES = {"quick": (QUICK, 8, 0.25), "full": (FULL, 12, 0.25), "large": (LARGE, 8, 0.25), "gigabyte": (GIGABYTE, 8, 2.0)}


def _command(ranks: int, flags: list[str]) -> tuple[list[str], dict]:
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    script = os.path.join(ROOT, "pretrain_gpt.py")
    if ranks == 1:
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29547", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        return [sys.executable, script, *flags], env
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks), script,
            *flags], env


def one_run(ranks: int, flags: list[str], work: str, hf: bool, shard: int) -> dict:
    """One training run; its iteration times, end-to-end time, export lines and peak memory."""
    from common import MemorySampler
    save, out = os.path.join(work, "ckpt"), os.path.join(work, "hf")
    shutil.rmtree(save, ignore_errors=True)
    shutil.rmtree(out, ignore_errors=True)
    flags = flags + ["--save", save]
    if hf:
        flags += ["--save-hf", out, "--save-hf-max-shard-size", str(shard)]
    cmd, env = _command(ranks, flags)
    # this process's tree: the run's processes above this one's baseline, sampled with at most a tenth of a core
    # (at a fixed 20 ms, reading a 1 GB model's run took most of a core from the nice +10 export on 2 cores)
    memory = MemorySampler(max_share=0.1).start()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT)
    iters, durable, exports, tail, first, done = {}, {}, [], [], None, None
    for line in proc.stdout:
        now = time.perf_counter()
        tail = (tail + [line])[-20:]
        if m := RE_ITER.search(line):
            iters[int(m[1])] = float(m[2])
            if first is None:
                first = now - float(m[2]) / 1e3
        elif m := RE_DURABLE.search(line):
            durable[int(m[1])] = float(m[2])
        elif m := RE_HF.search(line):
            exports.append({"iteration": int(m[1]), "export_ms": float(m[2]), "written_ms": float(m[3]),
                            "from_save_ms": float(m[4]), "durable_ms": float(m[5]),
                            "passed": None if m[6] == "-" else int(m[6])})
        elif "> training done" in line:
            done = now
    peak = memory.stop()
    if proc.wait() != 0 or done is None:
        raise SystemExit(f"the run failed ({'with' if hf else 'without'} --save-hf):\n" + "".join(tail))
    return {"iters": iters, "durable": durable, "total_s": done - first, "exports": exports, "peak_bytes": peak,
            "save": save}


def offline(save: str, work: str, shard: int) -> tuple[float, float, list[int]]:
    """(the converter process's wall seconds, its export call's seconds in this process, the sizes of the
    safetensors files it wrote) on `save`'s latest."""
    out = os.path.join(work, "offline")
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    subprocess.run([sys.executable, os.path.join(ROOT, "tools", "convert_checkpoint.py"), "--from", "datastates",
                    "--to", "hf", "--input", save, "--output", out, "--max-shard-size", str(shard)], check=True, cwd=ROOT, capture_output=True)
    wall = time.perf_counter() - t0
    shutil.rmtree(out)
    from datastates.hf.export import export
    t0 = time.perf_counter()
    export("datastates", save, out, progress=False, max_shard_bytes=shard)
    call = time.perf_counter() - t0
    sizes = [os.path.getsize(os.path.join(out, f)) for f in sorted(os.listdir(out)) if f.endswith(".safetensors")]
    shutil.rmtree(out)
    return wall, call, sizes


def storage_floor(sizes: list[int], work: str, writers: int) -> tuple[float, float]:
    """The median seconds (of 3) to write and fsync files of these sizes here from 1 and from `writers`
    threads: what no export of them, offline or in the trainer, can beat on this storage."""
    from probes import write_files_fsync
    d = os.path.join(work, "probe")
    one = statistics.median(write_files_fsync(d, sizes, 1) for _ in range(3))
    many = statistics.median(write_files_fsync(d, sizes, writers) for _ in range(3)) if writers > 1 else one
    shutil.rmtree(d, ignore_errors=True)
    return one, many


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a smaller model, fewer iterations, one round")
    ap.add_argument("--large", action="store_true", help="a model of about 425 MB (fp32), 8 iterations")
    ap.add_argument("--gigabyte", action="store_true", help="a model of about 1.08 GB (fp32), 8 iterations")
    ap.add_argument("--ranks", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--out", default="/tmp/hf_export_bench")
    ap.add_argument("--shard-mb", type=float, default=4.0,
                    help="safetensors files of at most this size (spread over the ranks), in both exports [4]")
    a = ap.parse_args(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    model, iters, budget = SIZES["quick" if a.quick else "large" if a.large else "gigabyte" if a.gigabyte else "full"]
    interval = 2
    rounds = a.rounds or (1 if a.quick else 2)
    shard = int(a.shard_mb * 2**20)
    batch = str(2 * a.ranks)
    flags = model + LLAMA + ["--micro-batch-size", "2", "--global-batch-size", batch, "--train-iters", str(iters),
                             "--save-interval", str(interval), "--async-ckpt", "--ckpt-host-buffer-gb",
                             str(budget)]
    os.makedirs(a.out, exist_ok=True)
    runs = {False: [], True: []}
    for r in range(rounds):
        for hf in ((False, True) if r % 2 == 0 else (True, False)):
            runs[hf].append(one_run(a.ranks, flags, a.out, hf, shard))
            print(f"round {r + 1}: {'with' if hf else 'without'} --save-hf: {runs[hf][-1]['total_s']:.2f} s",
                  flush=True)
    wall, call, sizes = offline(runs[True][-1]["save"], a.out, shard)
    floor_one, floor_ranks = storage_floor(sizes, a.out, a.ranks)

    def loop(rs):
        return statistics.median(ms for x in rs for i, ms in x["iters"].items() if i > 1)
    by_round = ", ".join(f"{loop([w]) / loop([o]):.3f}" for w, o in zip(runs[True], runs[False]))
    exports = [e for x in runs[True] for e in x["exports"]]
    print(f"\n{'quick: ' if a.quick else ''}{a.ranks} rank(s), {iters} iterations, a checkpoint (and an export) every "
          f"{interval}, staging budget {budget:g} GiB, safetensors files of {a.shard_mb:g} MiB, rounds {rounds}")
    print(f"loop: median iteration {loop(runs[True]):.1f} ms with, {loop(runs[False]):.1f} ms without: ratio "
          f"{loop(runs[True]) / loop(runs[False]):.3f} (each round's: {by_round})")
    tw, to = (statistics.median(x["total_s"] for x in runs[k]) for k in (True, False))
    print(f"end to end (all checkpoints and exports done): {tw:.2f} s with, {to:.2f} s without: ratio {tw / to:.3f}")
    print(f"exports: {len(exports)}; median export {statistics.median(e['export_ms'] for e in exports):.0f} ms; "
          f"median from the save call to published {statistics.median(e['from_save_ms'] for e in exports):.0f} ms "
          f"vs the checkpoint's time to durable {statistics.median(e['durable_ms'] for e in exports):.0f} ms: ratio "
          f"{statistics.median(e['from_save_ms'] / e['durable_ms'] for e in exports):.2f}")
    dw, do = (statistics.median(ms for x in runs[k] for ms in x["durable"].values()) for k in (True, False))
    print(f"the checkpoints' time to durable (median, every checkpoint): {dw:.0f} ms with, {do:.0f} ms without: "
          f"ratio {dw / do:.2f} (what the export's writes cost the checkpoint's)")
    written = statistics.median(e["written_ms"] for e in exports) / 1e3
    print(f"offline converter on the last checkpoint: {wall:.2f} s as a process, {call:.2f} s its export call; the "
          f"trainer's files written in {written:.2f} s (median, from the weights kept): {wall / written:.1f}x and "
          f"{call / written:.1f}x faster")
    print(f"storage floor: the same {len(sizes)} safetensors files ({sum(sizes) / 2**20:.0f} MiB) written and "
          f"fsynced here in {floor_one:.2f} s by 1 writer, {floor_ranks:.2f} s by {a.ranks} (one a rank): the converter's "
          f"export call can be beaten by {call / floor_ranks:.1f}x at most")
    passed = [e["passed"] for e in exports if e["passed"] is not None]
    if passed:
        print(f"bytes passed between the ranks per export (median): {statistics.median(passed) / 2**20:.1f} MiB")
    pw, po = (max(x["peak_bytes"] for x in runs[k]) for k in (True, False))
    print(f"peak host memory (PSS of the process tree): {pw / 2**20:.0f} MiB with, {po / 2**20:.0f} MiB without: "
          f"+{(pw - po) / 2**20:.0f} MiB (staging budget {budget * 1024:.0f} MiB per rank)")


if __name__ == "__main__":
    main()
