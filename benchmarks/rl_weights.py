#!/usr/bin/env python
"""Policy weights handed to the inference side (issue 68; docs/rl-weights.md), with the real trainer, side by side
in one run, the same model and steps:

    python benchmarks/rl_weights.py [--quick] [--ranks N] [--readers R] [--iters N] [--modes a,b] [--out DIR]

- none:      training alone (no publication, no memory tier);
- tier:      the memory tier every iteration (the snapshot a version is published from), no publication;
- publish:   the memory tier every iteration and --publish-weights-interval 1 into /dev/shm, R reader processes
             (benchmarks/rl_reader.py) taking every version whole through datastates.weights;
- publish-deltas: the same with --publish-weights-deltas 8, the readers bringing their own copy to each version
             through the deltas (fp32 at lr 1e-4 by default, where most elements change; --rl: bf16 at 1e-6);
- remote, remote-deltas: publish and publish-deltas with the R readers on "another node": a relay process
             (python -m datastates.weights.relay) serves the versions over TCP on 127.0.0.1, each reader takes them
             through datastates.weights.RemoteReader in pieces (bytes counted on the wire, frames included);
- save-hf:   a checkpoint every iteration with --save-hf to disk (what a user does today), the R readers reloading
             each new model with transformers' from_pretrained;
- broadcast: every tensor of the same model broadcast over gloo from a trainer process to R reader processes
             (what NeMo-RL and OpenRLHF do on their transport), the trainer blocked meanwhile.

Reports the loop ratio (median elapsed time per iteration, iterations 3..N, against `none`, or the first mode
run), the version latency (the trainer's iteration line for step N, printed right after its optimizer step, to the
last reader holding version N: medians over the versions the readers took) and the bytes each reader read per
version.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from hf_export import LLAMA, QUICK, FULL, _command  # noqa: E402

MODES = ("none", "tier", "publish", "publish-deltas", "remote", "remote-deltas", "save-hf")
RE_ITER = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*elapsed time per iteration \(ms\): ([\d.]+)")


def readers(kind: str, root: str, last: int, n: int) -> list[subprocess.Popen]:
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    return [subprocess.Popen([sys.executable, os.path.join(ROOT, "benchmarks", "rl_reader.py"), kind, root,
                              str(last)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
            for _ in range(n)]


def serve(root: str) -> tuple[subprocess.Popen, str]:
    """A relay process serving the versions under `root` on 127.0.0.1 (a free port): it and its HOST:PORT."""
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    relay = subprocess.Popen([sys.executable, "-m", "datastates.weights.relay", "--dir", root, "--host", "127.0.0.1",
                              "--port", "0"], stdout=subprocess.PIPE, text=True, env=env)
    line = relay.stdout.readline()
    if not (m := re.search(r" on (\S+:\d+) ", line)):
        relay.kill()
        raise SystemExit(f"the relay did not start: {line!r}")
    return relay, m[1]


def one_run(mode: str, ranks: int, flags: list[str], iters: int, work: str, shm: str, n_readers: int) -> dict:
    """One training run of `mode`: its iteration times, the wall time of each iteration line, the readers' GOTs."""
    for d in (work, shm):
        shutil.rmtree(d, ignore_errors=True)
        os.makedirs(d)
    flags = flags + ["--train-iters", str(iters), "--save", os.path.join(work, "ckpt"), "--async-ckpt"]
    tier = ["--non-persistent-save-interval", "1", "--non-persistent-local-ckpt-dir", os.path.join(shm, "tier")]
    procs, kind, root, relay = [], None, None, None
    if mode == "tier":
        flags += tier
    elif mode in ("publish", "publish-deltas", "remote", "remote-deltas"):
        root, kind = os.path.join(shm, "versions"), {"publish": "versions", "publish-deltas": "deltas"}.get(mode, mode)
        flags += tier + ["--publish-weights-dir", root, "--publish-weights-interval", "1"]
        if mode.endswith("deltas"):
            flags += ["--publish-weights-deltas", "8"]
        if mode.startswith("remote"):
            relay, root = serve(root)
    elif mode == "save-hf":
        root, kind = os.path.join(work, "hf"), "hf"
        flags += ["--save-interval", "1", "--save-hf", root, "--save-hf-keep-last", "4"]
    if kind:
        procs = readers(kind, root, iters, n_readers)
    got: list[list] = [[] for _ in procs]
    ready = threading.Semaphore(0)

    def collect(k: int) -> None:
        for line in procs[k].stdout:
            if line.startswith("READY"):
                ready.release()
            elif line.startswith("GOT"):
                _, it, t, nbytes = line.split()
                got[k].append((int(it), float(t), int(nbytes)))
            elif "Error" in line:
                print(f"reader {k}: {line}", end="", file=sys.stderr)
    threads = [threading.Thread(target=collect, args=(k,)) for k in range(len(procs))]
    for t in threads:
        t.start()
    for _ in procs:  # the readers' imports done before training starts
        ready.acquire(timeout=300)
    cmd, env = _command(ranks, flags)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT)
    elapsed, stepped, tail = {}, {}, []
    for line in proc.stdout:
        now = time.time()
        tail = (tail + [line])[-20:]
        if m := RE_ITER.search(line):
            elapsed[int(m[1])], stepped[int(m[1])] = float(m[2]), now
    if proc.wait() != 0:
        raise SystemExit(f"the {mode} run failed:\n" + "".join(tail))
    for p in procs:
        try:
            p.wait(timeout=120)
        except subprocess.TimeoutExpired:
            p.kill()
    for t in threads:
        t.join()
    if relay is not None:
        relay.terminate()
        relay.wait()
    return {"elapsed": elapsed, "stepped": stepped, "got": got}


def summary(run: dict) -> dict:
    its = sorted(run["elapsed"])[2:]
    out = {"iter_ms": statistics.median(run["elapsed"][i] for i in its)}
    if run["got"]:
        held = {}  # iteration: (readers that took it, the last one's time, bytes)
        for got in run["got"]:
            for it, t, nbytes in got:
                n, last, _ = held.get(it, (0, 0.0, 0))
                held[it] = (n + 1, max(last, t), nbytes)
        every = {it: v for it, v in held.items() if v[0] == len(run["got"]) and it in run["stepped"]}
        out["latency_ms"] = statistics.median((v[1] - run["stepped"][it]) * 1e3 for it, v in every.items())
        out["versions_every_reader_took"] = len(every)
        out["bytes_per_reader"] = statistics.median(v[2] for v in every.values())
    return out


def _broadcast_rank(rank: int, world: int, port: int, names: list, tensors: dict, reps: int, out: dict) -> None:
    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    bufs = [tensors[n] if rank == 0 else torch.empty_like(tensors[n]) for n in names]
    times = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        for b in bufs:
            dist.broadcast(b, src=0)
        dist.barrier()  # every reader holds every tensor
        times.append(time.perf_counter() - t0)
    if rank == 0:
        out["latency_ms"] = statistics.median(times) * 1e3
    dist.destroy_process_group()


def broadcast(version_dir: str, n_readers: int, reps: int = 3) -> dict:
    """Every tensor of the version at `version_dir` broadcast over gloo from one process to `n_readers`."""
    import socket
    import torch.multiprocessing as mp
    from safetensors.torch import load_file
    tensors = {}
    for f in sorted(os.listdir(version_dir)):
        if f.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(version_dir, f)))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = mp.Manager().dict()
    mp.spawn(_broadcast_rank, args=(n_readers + 1, port, sorted(tensors), tensors, reps, out), nprocs=n_readers + 1)
    return {"latency_ms": out["latency_ms"], "bytes_per_reader": sum(t.numel() * t.element_size()
                                                                      for t in tensors.values())}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="the 21 MB model (default: hf_export's 110 MB one)")
    ap.add_argument("--ranks", type=int, default=1)
    ap.add_argument("--readers", type=int, default=2)
    ap.add_argument("--iters", type=int, default=12)
    ap.add_argument("--rl", action="store_true", help="bf16 and Adam at lr 1e-6, an RL post-training step (the "
                                                         "default: fp32 at 1e-4, where most elements change)")
    ap.add_argument("--modes", default=",".join(MODES), help=f"which runs, in order (default: {','.join(MODES)}; "
                                                               f"the broadcast runs after `publish`)")
    ap.add_argument("--out", default=None, help="where results.json goes")
    a = ap.parse_args(argv)
    flags = (QUICK if a.quick else FULL) + LLAMA + ["--micro-batch-size", "2", "--global-batch-size", str(2 * a.ranks),
                                                    "--ckpt-host-buffer-gb", "0.5"]
    if a.rl:
        flags += ["--bf16", "--lr", "1e-6"]
    if a.ranks > 1:
        flags += ["--tensor-model-parallel-size", str(a.ranks)]
    work = tempfile.mkdtemp(prefix="rl_weights_")
    shm = tempfile.mkdtemp(prefix="rl_weights_", dir="/dev/shm")
    kept = tempfile.mkdtemp(prefix="rl_weights_last_")
    results, device = {}, None
    try:
        modes = a.modes.split(",")
        if unknown := set(modes) - set(MODES):
            raise SystemExit(f"--modes: no mode {', '.join(sorted(unknown))} (these are: {', '.join(MODES)})")
        for mode in modes:
            results[mode] = summary(one_run(mode, a.ranks, flags, a.iters, work, shm, a.readers))
            print(mode, results[mode], flush=True)
            if mode == "publish":  # the last version, for the broadcast of the same tensors
                shutil.copytree(os.path.join(shm, "versions", f"iter_{a.iters:07d}"), kept, dirs_exist_ok=True)
        if "publish" in modes:
            results["broadcast"] = broadcast(kept, a.readers)
            device = _device_figures(kept)
    finally:
        for d in (work, shm, kept):
            shutil.rmtree(d, ignore_errors=True)
    _table(a, results, modes)
    if device:
        results["device"] = device
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "results.json"), "w") as f:
            json.dump(results, f, indent=2)


def _device_figures(version_dir: str) -> dict | None:
    """On a CUDA machine, the device side of the same version (benchmarks/rl_device.py); None elsewhere."""
    import torch
    if not torch.cuda.is_available():
        return None
    from rl_device import describe, measure
    r = measure(version_dir)
    print(f"device (the last version): {describe(r)}", flush=True)
    return r


def _table(a, results: dict, modes: list[str]) -> None:
    import torch
    base = results[modes[0]]["iter_ms"]
    where = f"the trainer on {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else "CPU figures"
    print(f"{where}: {a.ranks} trainer rank(s), {a.readers} readers, {a.iters} iterations, "
          f"{'quick' if a.quick else 'full'} model, {'bf16 at lr 1e-6' if a.rl else 'fp32 at lr 1e-4'}; "
          f"{os.cpu_count()} cores")
    print("| mode | iter ms | loop ratio | version latency ms | bytes per reader per version | versions every reader took |")
    print("|---|---|---|---|---|---|")
    for mode, r in results.items():
        it = r.get("iter_ms")
        print(f"| {mode} | {'-' if it is None else f'{it:.1f}'} | {'-' if it is None else f'{it / base:.3f}'} | "
              f"{r['latency_ms']:.1f} | {r['bytes_per_reader']} | {r.get('versions_every_reader_took', '-')} |"
              if "latency_ms" in r else f"| {mode} | {it:.1f} | {it / base:.3f} | - | - | - |")


if __name__ == "__main__":
    main()
