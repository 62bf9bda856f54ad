#!/usr/bin/env python
"""One command for the whole local comparison table.

    python benchmarks/run_all.py                          # default grid, ~15 min here; publishes RESULTS.md
    python benchmarks/run_all.py --quick                  # ~2 min smoke run (100 MB, 1 rank), no publishing
    python benchmarks/run_all.py --sizes 0.1,1 --ranks 1,2 --out bench_out/

For every configuration (state size x ranks): raw limits of the checkpoint directory (O_DIRECT, buffered+fsync,
memcpy), then all systems side by side in one set of processes (see worker.py), then the results are rendered
(report.py): <out>/results.csv, results.json, figures and, unless --no-publish, benchmarks/RESULTS.md with PNGs
under benchmarks/results/. Benchmarks never fail on time; a system that errors is reported as failed.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)


def machine_desc() -> str:
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{os.cpu_count()} cores ({cpu}), {mem:.0f} GiB RAM, {platform.system()} {platform.release()}, no GPU" \
        if not _has_cuda() else f"{os.cpu_count()} cores ({cpu}), {mem:.0f} GiB RAM, CUDA"


def _has_cuda():
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def fs_type(path: str) -> str:
    try:
        return subprocess.run(["stat", "-f", "-c", "%T", path], capture_output=True, text=True).stdout.strip()
    except Exception:
        return "?"


def parse_grid(a):
    if a.sizes or a.ranks:
        sizes = [float(x) for x in (a.sizes or "1").split(",")]
        ranks = [int(x) for x in (a.ranks or "1").split(",")]
        return [(s, r) for r in ranks for s in sizes]
    return [(float(s), int(r)) for s, r in (x.split("x") for x in a.grid.split(","))]


def main():
    from deps import require
    require("matplotlib", "psutil", "tqdm")
    from tqdm import tqdm
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", help="comma-separated total state sizes in GB (cross product with --ranks)")
    ap.add_argument("--ranks", help="comma-separated rank counts")
    ap.add_argument("--grid", default="0.1x1,1x1,2x1,1x2,1x4",
                    help="SIZExRANKS list used when --sizes/--ranks are not given [%(default)s]")
    ap.add_argument("--systems", default=None, help="comma-separated subset of: " + ",".join(_systems()))
    ap.add_argument("--reps", type=int, default=3, help="measured checkpoints per system after 1 warm-up")
    ap.add_argument("--restore-reps", type=int, default=5,
                    help="restore rounds per system (the read bandwidth of shared disks drifts the most)")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench_out"))
    ap.add_argument("--ckpt-dir", default=None, help="where checkpoints go [<out>/ckpt]")
    ap.add_argument("--engine-buffer-gb", type=float, default=4.0, help="engine staging budget per rank (GiB)")
    ap.add_argument("--engine-writer-threads", type=int, default=4)
    ap.add_argument("--loop-config", default="1x1", help="SIZExRANKS that also runs the compute loop ('' = none)")
    ap.add_argument("--warmup", type=int, default=1, help="saves per system before the timed ones (0: the first "
                    "save is timed too)")
    ap.add_argument("--loop-iters", type=int, default=12, help="enough that the last checkpoint's drain is a small part")
    ap.add_argument("--loop-compute-s", type=float, default=0.7)
    ap.add_argument("--loop-intervals", default="1,3")
    ap.add_argument("--mem-config", default="1x1",
                    help="SIZExRANKS for the peak-memory phase (fresh process per system; '' = none)")
    ap.add_argument("--raw-reads", default=None,
                    help="comma-separated raw read yardsticks of the restore phase (of 1t,4t,8t,stream) [all]")
    ap.add_argument("--loop-systems", default=None, help="comma-separated systems the loop runs [all of --systems]")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="where the state lives: cuda puts the model and its moments on the GPU (one device)")
    ap.add_argument("--loop-rounds", type=int, default=1, help="interleaved repetitions of each loop run")
    ap.add_argument("--trainer", choices=["auto", "on", "off"], default="auto",
                    help="also time pretrain_gpt.py (tiny GPT) with a checkpoint every iteration if it exists")
    ap.add_argument("--trainer-iters", type=int, default=6)
    ap.add_argument("--trainer-bf16-iters", type=int, default=3,
                    help="iterations of the bf16 + distributed-optimizer trainer rows (0: none)")
    ap.add_argument("--trainer-moe-iters", type=int, default=4,
                    help="iterations of the mixture-of-experts trainer rows (0: none)")
    ap.add_argument("--trainer-fsdp2-iters", type=int, default=3,
                    help="iterations of the --use-torch-fsdp2 trainer rows (0: none)")
    ap.add_argument("--trainer-rounds", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="~2 min smoke run: 0.1 GB, 1 rank, short loop")
    ap.add_argument("--no-publish", action="store_true", help="do not write benchmarks/RESULTS.md + results/")
    a = ap.parse_args()

    if a.quick:
        grid = [(0.1, 1)]
        a.reps, a.loop_config, a.loop_iters, a.loop_compute_s, a.loop_intervals = 2, "0.1x1", 4, 0.3, "1"
        a.restore_reps = 2
        a.mem_config, a.loop_rounds = "", 1
        a.no_publish = True
        if a.trainer == "auto":
            a.trainer = "off"
    else:
        grid = parse_grid(a)
    loop_cfg = tuple(float(x) if i == 0 else int(x) for i, x in enumerate(a.loop_config.split("x"))) \
        if a.loop_config else None
    if loop_cfg and loop_cfg not in grid:
        grid.append(loop_cfg)

    import torch

    import probes
    import report
    import systems as S

    os.makedirs(a.out, exist_ok=True)
    for stale in ("raw", "mem"):
        d = os.path.join(a.out, stale)
        if os.path.isdir(d):
            for f in os.listdir(d):
                os.unlink(os.path.join(d, f))
    ckpt_dir = os.path.abspath(a.ckpt_dir or os.path.join(a.out, "ckpt"))
    os.makedirs(ckpt_dir, exist_ok=True)
    names = S.available(a.systems.split(",") if a.systems else S.DEFAULT_SYSTEMS)
    command = "python benchmarks/run_all.py " + " ".join(sys.argv[1:])
    try:
        import megatron.core as mc

        mcore = mc.__version__
    except Exception:
        mcore = "?"
    try:
        from datastates import DEFAULT_READ_THREADS as read_threads
    except ImportError:  # the engine may not exist yet in a fresh tree
        read_threads = "?"
    meta = {
        "command": command.strip(), "machine": machine_desc(), "ckpt_dir": ckpt_dir, "fs": fs_type(ckpt_dir),
        "date": datetime.datetime.now().isoformat(timespec="seconds"), "torch": torch.__version__, "mcore": mcore,
        "engine_buffer_bytes": int(a.engine_buffer_gb * 2**30), "engine_writer_threads": a.engine_writer_threads,
        "engine_read_threads": read_threads, "systems": names, "grid": grid,
        "reps_note": f"1 warm-up + {a.reps} measured checkpoints per system and configuration "
                     f"({max(2, a.reps - 1)} above 1 GB), systems interleaved A B … B A; {a.restore_reps} "
                     f"restore rounds, interleaved the same way.",
    }
    with open(os.path.join(a.out, "meta.json"), "w") as f:
        json.dump(meta, f, indent=1)
    print(f"systems: {names}\ngrid (GB x ranks): {grid}\ncheckpoints in {ckpt_dir} ({meta['fs']})", flush=True)

    all_probes = {}
    t_start = time.time()
    for size, ranks in tqdm(grid, desc="configurations", unit="config", disable=None):
        tag = f"s{size:g}gb_r{ranks}".replace(".", "p")
        print(f"\n=== {tag}: probes", flush=True)
        pr = probes.run_probes(ckpt_dir, int(min(max(size, 0.25), 1.0) * 1e9), reps=3)
        all_probes[tag] = pr
        print(f"    O_DIRECT {pr.get('odirect_1t', {}).get('gbps', 0):.2f}/{pr.get('odirect_4t', {}).get('gbps', 0):.2f}"
              f" GB/s (1/4 thr), buffered+fsync {pr['buffered_fsync']['gbps']:.2f} GB/s, "
              f"memcpy {pr['memcpy']['gbps']:.2f} GB/s", flush=True)
        with open(os.path.join(a.out, "probes.json"), "w") as f:
            json.dump(all_probes, f, indent=1)
        is_loop = loop_cfg == (size, ranks)
        cfg = {
            "tag": tag, "size_gb": size, "ranks": ranks, "port": random.randint(20000, 40000),
            "ckpt_dir": os.path.join(ckpt_dir, tag), "out": a.out, "systems": names,
            "warmup": a.warmup, "reps": a.reps if size <= 1 else max(2, a.reps - 1), "restore_reps": a.restore_reps,
            "engine_buffer_bytes": int(a.engine_buffer_gb * 2**30),
            "engine_writer_threads": a.engine_writer_threads,
            "loop_iters": a.loop_iters if is_loop else 0, "loop_compute_s": a.loop_compute_s,
            "loop_intervals": [int(k) for k in a.loop_intervals.split(",")], "loop_rounds": a.loop_rounds,
            "loop_systems": a.loop_systems.split(",") if a.loop_systems else None, "device": a.device,
            "raw_reads": a.raw_reads.split(",") if a.raw_reads else None,
        }
        print(f"=== {tag}: systems", flush=True)
        env = dict(os.environ, PYTHONWARNINGS="ignore")
        rc = subprocess.run([sys.executable, os.path.join(HERE, "worker.py"), json.dumps(cfg)], env=env).returncode
        if rc != 0:
            print(f"!!! {tag}: worker exited with {rc}; its results are missing from the table", flush=True)
    if a.mem_config:
        msize, mranks = float(a.mem_config.split("x")[0]), int(a.mem_config.split("x")[1])
        mtag = f"s{msize:g}gb_r{mranks}".replace(".", "p")
        print(f"\n=== {mtag}: peak memory, one fresh process per system", flush=True)
        for name in names:
            cfg = {"mode": "memory", "tag": mtag, "size_gb": msize, "ranks": mranks,
                   "port": random.randint(20000, 40000), "ckpt_dir": os.path.join(ckpt_dir, "mem"), "out": a.out,
                   "systems": [name], "engine_buffer_bytes": int(a.engine_buffer_gb * 2**30),
                   "engine_writer_threads": a.engine_writer_threads}
            subprocess.run([sys.executable, os.path.join(HERE, "worker.py"), json.dumps(cfg)],
                           env=dict(os.environ, PYTHONWARNINGS="ignore"))
    if a.trainer != "off":
        import trainer_e2e

        print("\n=== trainer: pretrain_gpt.py, checkpoint every iteration vs. none", flush=True)
        res = trainer_e2e.run(a.out, required=(a.trainer == "on"), iters=a.trainer_iters, rounds=a.trainer_rounds,
                              bf16_iters=a.trainer_bf16_iters, moe_iters=a.trainer_moe_iters,
                              fsdp2_iters=a.trainer_fsdp2_iters)
        if res is not None:
            with open(os.path.join(a.out, "trainer.json"), "w") as f:
                json.dump(res, f, indent=1)
    print(f"\nall configurations done in {time.time() - t_start:.0f} s\n", flush=True)

    if a.no_publish:
        report.render(a.out, None, os.path.join(a.out, "RESULTS.md"), command)
        print(f"\nwrote {a.out}/results.csv, results.json, RESULTS.md, figures/")
    else:
        report.render(a.out, os.path.join(HERE, "results"), os.path.join(HERE, "RESULTS.md"), command)
        print(f"\nwrote {a.out}/results.csv, results.json, benchmarks/RESULTS.md, benchmarks/results/*.png")


def _systems():
    try:
        import systems as S

        return S.DEFAULT_SYSTEMS
    except Exception:
        return []


if __name__ == "__main__":
    main()
