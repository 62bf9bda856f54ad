"""This engine on an object store against its limit and its peers, one local SeaweedFS (tests/s3_store.py): the
lazy save (blocking: the save call and the fence; durable: until published), the synchronous save, and the
restore, beside boto3's plain parallel multipart PUT and ranged GET of the same bytes (object_store_raw.py), PyTorch
DCP's async_save through fsspec and through s3torchconnector, and megatron-core's torch_dist through
multi-storage-client, sync and async (object_store_peers.py); and each one's loop ratio: a training loop with a
checkpoint every iteration over the same loop without.

    python benchmarks/object_store.py [--size-mib 256] [--tensors 8] [--threads 8] [--reps 3] [--iters 4] [--step-s 1]
    python benchmarks/object_store.py --quick   # seconds: 16 MiB in 4 tensors, 2 threads, 1 rep, 2 steps of 0.05 s
"""
import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from deps import require  # noqa: E402
from object_store_peers import PEERS, init_single_rank  # noqa: E402
from object_store_raw import boto3_raw  # noqa: E402
from s3_store import S3Store  # noqa: E402

from datastates import CheckpointEngine, storage_for
from datastates.paths import checkpoint_dir  # noqa: E402


class Raw:
    """The limit: the state's bytes (joined once, outside the timings) as one object by boto3's multipart PUT,
    read back by ranged GETs into one buffer that `target`'s tensors view."""

    def __init__(self, store, bucket, state, threads):
        self.put, self.get = boto3_raw(store, bucket, 16 << 20, threads)
        self.data = b"".join(v.numpy().tobytes() for v in state.values())
        self.out = bytearray(len(self.data))
        self.target, off = {}, 0
        for k, v in state.items():
            self.target[k] = torch.frombuffer(self.out, dtype=v.dtype, count=v.numel(), offset=off)
            off += v.numel() * v.element_size()

    def save(self, key):
        self.put(key, self.data)

    def wait(self):
        pass

    def load(self, key):
        self.get(key, self.out)

    def close(self):
        pass


class Engine:
    """This engine under s3://bucket/<key>: the lazy save returns after its fence (wait_for_snapshot), the
    synchronous one once published."""

    def __init__(self, bucket, state, threads, budget, lazy):
        self.bucket, self.state, self.lazy = bucket, state, lazy
        self.target = {k: torch.empty_like(v) for k, v in state.items()}
        self.eng = CheckpointEngine(host_buffer_bytes=budget, rank=0, world_size=1,
                                    storage=storage_for(f"s3://{bucket}", writer_threads=threads,
                                                        read_threads=threads))

    def save(self, key):
        handle = self.eng.save(self.state, checkpoint_dir(f"s3://{self.bucket}/{key}", 1))
        if self.lazy:
            self.eng.wait_for_snapshot()
        else:
            handle.wait()

    def wait(self):
        self.eng.wait()

    def load(self, key):
        self.eng.load(f"s3://{self.bucket}/{key}", self.target)

    def close(self):
        self.eng.close()


def measure(ckpt, state, key):
    """(blocking s, durable s, restore s) of one save of `state` and its load into the zeroed target, checked."""
    t0 = time.perf_counter()
    ckpt.save(key)
    blocking = time.perf_counter() - t0
    ckpt.wait()
    durable = time.perf_counter() - t0
    for v in ckpt.target.values():
        v.zero_()
    t0 = time.perf_counter()
    ckpt.load(key)
    restore = time.perf_counter() - t0
    if not all(torch.equal(ckpt.target[k], v) for k, v in state.items()):
        raise RuntimeError("the restored state differs")
    return blocking, durable, restore


def loop(ckpt, iters, step_s, key):
    """Seconds of `iters` iterations, each a save (when `ckpt` is given) and a step, until the last checkpoint is
    durable. The step is a sleep: an accelerator's step, which leaves the host's cores to the checkpoint (a CPU
    matmul here would instead measure two cores shared by the step, the uploads and the store)."""
    t0 = time.perf_counter()
    for i in range(iters):
        if ckpt is not None:
            ckpt.save(f"{key}/{i}")
        time.sleep(step_s)
    if ckpt is not None:
        ckpt.wait()
    return time.perf_counter() - t0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mib", type=int, default=256)
    ap.add_argument("--tensors", type=int, default=8)
    ap.add_argument("--threads", type=int, default=8, help="upload and GET threads (the raw client's, DCP's)")
    ap.add_argument("--budget-mib", type=int, default=1024, help="the engine's staging budget")
    ap.add_argument("--reps", type=int, default=3, help="best of")
    ap.add_argument("--iters", type=int, default=4, help="iterations of the loop ratio")
    ap.add_argument("--step-s", type=float, default=1.0, help="one training step of the loop ratio")
    ap.add_argument("--quick", action="store_true",
                    help="seconds: 16 MiB in 4 tensors, 2 threads, a 64 MiB budget, 1 rep, 2 steps of 0.05 s")
    a = ap.parse_args(argv)
    if a.quick:
        a.size_mib, a.tensors, a.threads, a.budget_mib, a.reps, a.iters, a.step_s = 16, 4, 2, 64, 1, 2, 0.05
    require("boto3", "s3fs", "s3torchconnector", "multistorageclient", "megatron.core")
    size = a.size_mib << 20
    g = torch.Generator().manual_seed(0)
    state = {f"t{i}": torch.randn(size // a.tensors // 4, generator=g) for i in range(a.tensors)}
    store = S3Store()
    try:
        store.start()
        os.environ.update(store.env())
        init_single_rank()
        bucket = store.create_bucket()
        makers = {"raw multipart PUT / ranged GET (boto3)": lambda: Raw(store, bucket, state, a.threads),
                  "datastates lazy": lambda: Engine(bucket, state, a.threads, a.budget_mib << 20, True),
                  "datastates sync": lambda: Engine(bucket, state, a.threads, a.budget_mib << 20, False),
                  **{name: (lambda f=f: f(store, bucket, state, a.threads)) for name, f in PEERS.items()}}
        systems, failed = {}, {}
        for name, make in makers.items():
            try:
                systems[name] = make()
            except Exception as e:  # a peer that cannot run here is reported, the others still run
                failed[name] = f"{type(e).__name__}: {str(e)[:200]}"
        runs, loops = {name: [] for name in systems}, {name: [] for name in systems}
        for r in range(a.reps):  # systems interleaved, rep by rep
            for i, (name, ckpt) in enumerate(systems.items()):
                if name in failed:
                    continue
                try:
                    runs[name].append(measure(ckpt, state, f"s{i}/{r}"))
                    loops[name].append(loop(ckpt, a.iters, a.step_s, f"s{i}/loop{r}"))
                except Exception as e:
                    failed[name] = f"{type(e).__name__}: {str(e)[:200]}"
        bare = loop(None, a.iters, a.step_s, None)
        for ckpt in systems.values():
            ckpt.close()
        print(f"{a.size_mib} MiB in {a.tensors} tensors, {a.threads} threads, best of {a.reps} (the loop too): "
              f"{a.iters} iterations of a {a.step_s:g} s step, {bare:.2f} s without checkpoints; SeaweedFS weed mini "
              f"at {store.endpoint}")
        print(f"{'system':<40}{'blocking s':>11}{'durable s':>11}{'restore s':>11}{'PUT GB/s':>10}{'GET GB/s':>10}"
              f"{'loop ratio':>11}")
        for name in (n for n in systems if n not in failed):
            b, d, rs = (min(x[i] for x in runs[name]) for i in range(3))
            print(f"{name:<40}{b:>11.3f}{d:>11.3f}{rs:>11.3f}{size / d / 1e9:>10.2f}{size / rs / 1e9:>10.2f}"
                  f"{min(loops[name]) / bare:>11.2f}")
        for name, why in failed.items():
            print(f"{name:<40} failed: {why}")
    finally:
        store.close()


if __name__ == "__main__":
    main()
