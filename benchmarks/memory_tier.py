"""The memory tier with the real trainer (pretrain_gpt.py, one CPU process, the GPT of trainer_e2e.py).

1. Restart: a run saving to storage every 4 iterations and to memory every iteration is SIGKILLed once it has
   logged its memory checkpoint of iteration 7 (an iteration or two more may pass before the kill lands).
   Restarting it resumes from memory; the same restart without the memory tier resumes from storage, with the
   storage files evicted from the page cache. Reported: the iteration resumed, the trainer's load time, and
   process start to first trained iteration.
2. Loop: training time of N iterations with a lazy memory checkpoint every iteration (alone, and with storage
   every 10), beside storage every iteration and no checkpoint at all, in one run; with each run's CPU seconds
   beyond the checkpoint-free run's (what checkpointing costs, less sensitive to other load on the machine).
3. Save: one memory checkpoint of the same size in one process, the engine alone: staged into fresh files (the
   tier before the storage seam) against copied into the reused mapped pages of SharedMemoryStorage.

    python benchmarks/memory_tier.py [--iters 30] [--rounds 2] [--out /tmp/memtier] [--only restart|loop|save]
    python benchmarks/memory_tier.py --quick --out DIR --memory-dir DIR   # seconds: a tiny GPT, 1 round, 4 iterations
"""
from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from common import evict_tree  # noqa: E402
from trainer_e2e import MODEL, RE_ITER  # noqa: E402

# --quick: the same runs with a tiny GPT (process start dominates) and a small state for the save measurement
TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--max-position-embeddings", "32", "--vocab-size", "128", "--micro-batch-size", "2",
        "--global-batch-size", "2", "--lr", "1e-4", "--lr-decay-style", "constant", "--mock-data",
        "--log-interval", "1"]
SIZES = {"model": MODEL, "save_tensors": 40, "save_numel": 1_740_000}

RE_LOADED = re.compile(r"successfully loaded checkpoint from (.*) \(datastates\) at iteration (\d+) in ([\d.]+) ms")


def _env():
    return dict(os.environ, PYTHONWARNINGS="ignore", MASTER_ADDR="127.0.0.1", MASTER_PORT="29541", RANK="0",
                WORLD_SIZE="1", LOCAL_RANK="0", OMP_NUM_THREADS="1", DATASTATES_JOB_ID="bench-memtier")


def _cpu_s() -> float:
    """CPU seconds (user + system) of the finished child processes so far."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _run(flags, stop_at=None, timeout=900):
    """Run the trainer; with `stop_at` (a regex), SIGKILL it when a line matches. Returns (lines with their
    arrival times, seconds from start to the first iteration line, the process's exit code, its CPU seconds)."""
    t0, cpu0 = time.perf_counter(), _cpu_s()
    p = subprocess.Popen([sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), *SIZES["model"], *flags], cwd=ROOT,
                         env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines, first = [], None
    for line in p.stdout:
        now = time.perf_counter()
        lines.append((now, line))
        if first is None and RE_ITER.search(line):
            first = now - t0
        if stop_at and re.search(stop_at, line):
            p.send_signal(signal.SIGKILL)
            break
        if now - t0 > timeout:
            p.kill()
            break
    rc = p.wait()
    return lines, first, rc, _cpu_s() - cpu0


def restart(out: str, memory_dir: str, rounds: int) -> dict:
    ck, mem = os.path.join(out, "ck"), os.path.join(memory_dir, "restart")
    for d in (ck, mem):
        shutil.rmtree(d, ignore_errors=True)
    tier = ["--non-persistent-save-interval", "1", "--non-persistent-local-ckpt-dir", mem]
    base = ["--train-iters", "40", "--save", ck, "--load", ck, "--save-interval", "4", "--async-ckpt"]
    lines, _, _, _ = _run(base + tier, stop_at=r"memory checkpoint iteration\s+7 ")
    if not os.path.isdir(os.path.join(ck, "iter_0000004")):
        raise SystemExit("the first run did not leave storage at iteration 4:\n" + "".join(l for _, l in lines[-20:]))
    snap = os.path.join(out, "snapshot")
    shutil.rmtree(snap, ignore_errors=True)
    for d in (ck, mem):
        shutil.copytree(d, os.path.join(snap, os.path.basename(d)))
    res = {"memory": [], "storage": []}
    for rnd in range(rounds):
        for name in (("memory", "storage") if rnd % 2 == 0 else ("storage", "memory")):
            for d in (ck, mem):
                shutil.rmtree(d, ignore_errors=True)
                shutil.copytree(os.path.join(snap, os.path.basename(d)), d)
            evict_tree(ck)
            lines, first, _, _ = _run(base + (tier if name == "memory" else []) + ["--exit-interval", "9"],
                                   stop_at=RE_ITER.pattern)
            m = next((RE_LOADED.search(l) for _, l in lines if RE_LOADED.search(l)), None)
            if m is None:
                raise SystemExit(f"{name} restart did not load:\n" + "".join(l for _, l in lines[-20:]))
            res[name].append({"iteration": int(m[2]), "load_s": float(m[3]) / 1e3, "first_iteration_s": first})
            print(f"[restart] from {name:7s}: iteration {m[2]}, load {float(m[3]):7.1f} ms, start to first "
                  f"iteration {first:.2f} s", flush=True)
    shutil.rmtree(snap, ignore_errors=True)
    return {k: {"iteration": v[0]["iteration"], "load_s": statistics.median(r["load_s"] for r in v),
                "first_iteration_s": statistics.median(r["first_iteration_s"] for r in v)} for k, v in res.items()}


def loop(out: str, memory_dir: str, iters: int, rounds: int) -> dict:
    ck, mem = os.path.join(out, "loop_ck"), os.path.join(memory_dir, "loop")
    runs = {"no checkpoint": [],
            "storage every iteration": ["--save", ck, "--save-interval", "1", "--ckpt-keep-last", "1",
                                        "--async-ckpt"],
            "memory every iteration": ["--non-persistent-save-interval", "1", "--non-persistent-local-ckpt-dir",
                                       mem],
            "memory every iteration, storage every 10": [
                "--save", ck, "--save-interval", "10", "--ckpt-keep-last", "1", "--async-ckpt",
                "--non-persistent-save-interval", "1", "--non-persistent-local-ckpt-dir", mem]}
    times: dict[str, list] = {k: [] for k in runs}
    for rnd in range(rounds):
        for name in (list(runs) if rnd % 2 == 0 else list(runs)[::-1]):
            for d in (ck, mem):
                shutil.rmtree(d, ignore_errors=True)
            lines, _, rc, cpu = _run(["--train-iters", str(iters)] + runs[name])
            first = next((t - float(m[2]) / 1e3 for t, l in lines if (m := RE_ITER.search(l))), None)
            done = next((t for t, l in lines if "> training done" in l), None)
            if rc != 0 or first is None or done is None:
                raise SystemExit(f"{name} failed:\n" + "".join(l for _, l in lines[-20:]))
            times[name].append((done - first, cpu))
            print(f"[loop] {name:42s} {done - first:6.2f} s, process CPU {cpu:6.2f} s", flush=True)
    med = {k: (statistics.median(t for t, _ in v), statistics.median(c for _, c in v)) for k, v in times.items()}
    base = med["no checkpoint"]
    return {k: {"total_s": t, "ratio": t / base[0], "cpu_s": c, "extra_cpu_s": c - base[1]}
            for k, (t, c) in med.items()}


def save_cost(memory_dir: str, rounds: int) -> dict:
    """One memory checkpoint of 278 MB in one process, engine alone, steady state (saves 4-10 of 10): staged
    (slots, then written into fresh files of the memory directory, as the tier saved before the storage seam)
    against mapped (copied straight into the reused pages of SharedMemoryStorage). CPU seconds of the process
    per save, snapshot and durable times."""
    import torch
    from datastates import CheckpointEngine, PosixOptions
    from datastates.paths import checkpoint_dir
    from datastates.storage import SharedMemoryStorage  # the internal measured: the memory tier's backend
    state = {f"t{i}": torch.randn(SIZES["save_numel"], generator=torch.Generator().manual_seed(i))
             for i in range(SIZES["save_tensors"])}
    res: dict[str, list] = {"staged": [], "mapped": []}
    for _ in range(rounds):
        for name in res:
            root = os.path.join(memory_dir, "save-" + name)
            eng = CheckpointEngine(rank=0, world_size=1, keep_last=2,
                                   storage=SharedMemoryStorage() if name == "mapped"
                                   else PosixOptions(fsync=False, direct_io="off"))
            for it in range(1, 11):
                cpu0 = time.process_time()
                stats = eng.save(state, checkpoint_dir(root, it)).wait()
                retired = checkpoint_dir(root, it - 2)  # keep_last=2: this save retires that one
                while it > 2 and os.path.exists(retired):  # its deletion belongs to this save's cost
                    time.sleep(0.001)
                if it > 3:
                    res[name].append((time.process_time() - cpu0, stats.snapshot_s, stats.durable_s, stats.publish_s))
            eng.close()
            shutil.rmtree(root, ignore_errors=True)
    out = {k: {m: statistics.median(r[i] for r in v) for i, m in enumerate(("cpu_s", "snapshot_s", "durable_s",
                                                                            "publish_s"))}
           for k, v in res.items()}
    for k, v in out.items():
        print(f"[save] {k:7s} CPU {v['cpu_s']:.3f} s, snapshot {v['snapshot_s']:.3f} s, durable {v['durable_s']:.3f} s",
              flush=True)
    out["parts"] = where_a_memory_save_goes(state, memory_dir, out["mapped"]["publish_s"])
    return out


def where_a_memory_save_goes(state: dict, memory_dir: str, publish_s: float) -> dict:
    """What a memory save is made of, each part measured alone on the same bytes: the copy into pages already
    mapped (the snapshot), crc32c over them (what a load verifies), mapping and faulting in fresh pages (what
    the first saves paid before their pages were made ahead, and what no save pays once they are reused), and
    publication (manifest, index, rename, retention: the engine's publish_s)."""
    import torch
    from datastates import _native
    from datastates.storage import MappedSink  # the internal measured: the memory tier's mapped data file
    src = torch.cat([t.reshape(-1) for t in state.values()]).view(torch.uint8)
    nbytes = src.numel()
    os.makedirs(memory_dir, exist_ok=True)
    path = os.path.join(memory_dir, "parts.data")
    t0 = time.perf_counter()
    sink = MappedSink(path, nbytes, pinned=False, touch=True)
    fresh = time.perf_counter() - t0
    copy = min(_timed(lambda: sink.pages.copy_(src)) for _ in range(3))
    crc = min(_timed(lambda: _native.crc32c_ptr(sink.pages.data_ptr(), nbytes)) for _ in range(3))
    sink.unmap()
    os.unlink(path)
    parts = {"copy_s": copy, "crc32c_s": crc, "fresh_pages_s": fresh, "publish_s": publish_s}
    print(f"[save] where a {nbytes / 1e6:.0f} MB memory save goes: copy into mapped pages {copy:.3f} s, crc32c "
          f"{crc:.3f} s, fresh pages (map and fault in; reused pages pay none) {fresh:.3f} s, publication "
          f"(manifest, index, rename, retention) {publish_s:.3f} s", flush=True)
    return parts


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default="/tmp/datastates-memtier")
    ap.add_argument("--memory-dir", default="/dev/shm/datastates-bench",
                    help="the memory tier's directory: a memory file system, as in production")
    ap.add_argument("--only", choices=("restart", "loop", "save"), help="run one of the measurements")
    ap.add_argument("--quick", action="store_true",
                    help="seconds: a tiny GPT, 4 loop iterations, 1 round, a 1 MB state for the save measurement")
    a = ap.parse_args(argv)
    if a.quick:
        a.iters, a.rounds = 4, 1
        SIZES.update(model=TINY, save_tensors=4, save_numel=65_536)
    os.makedirs(a.out, exist_ok=True)
    try:
        result = {name: fn() if a.only in (None, name) else {} for name, fn in (
            ("restart", lambda: restart(a.out, a.memory_dir, a.rounds)),
            ("loop", lambda: loop(a.out, a.memory_dir, a.iters, a.rounds)),
            ("save", lambda: save_cost(a.memory_dir, a.rounds)))}
    finally:
        shutil.rmtree(a.memory_dir, ignore_errors=True)
    print("\nrestart      iteration  load s  start to first iteration s")
    for k, v in result["restart"].items():
        print(f"  {k:9s} {v['iteration']:10d} {v['load_s']:7.3f} {v['first_iteration_s']:27.2f}")
    print(f"\nloop ({a.iters} iterations)                      total s  vs no checkpoint  extra CPU s")
    for k, v in result["loop"].items():
        print(f"  {k:42s} {v['total_s']:7.2f} {v['ratio']:8.2f}x {v['extra_cpu_s']:16.2f}")
    with open(os.path.join(a.out, "memory_tier.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
