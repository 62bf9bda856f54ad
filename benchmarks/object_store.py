"""This engine on an object store against its limit, one local SeaweedFS (tests/s3_store.py): the lazy save
(blocking: the save call and the fence; durable: until published), the synchronous save, and the restore, beside
boto3's plain parallel multipart PUT and ranged GET of the same bytes (benchmarks/object_store_raw.py).

    python benchmarks/object_store.py [--size-mib 256] [--tensors 8] [--threads 8] [--reps 2]
"""
import argparse
import os
import shutil
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from object_store_raw import boto3_raw  # noqa: E402
from s3_store import S3Store  # noqa: E402

from datastates import CheckpointEngine, layout  # noqa: E402
from datastates.storage import storage_for  # noqa: E402


def engine_run(root, state, threads, budget, lazy):
    """(blocking s, durable s, restore s) of one save of `state` under `root` and its load."""
    with CheckpointEngine(host_buffer_bytes=budget, writer_threads=threads, rank=0, world_size=1,
                          storage=storage_for(root, writer_threads=threads, read_threads=threads)) as eng:
        t0 = time.perf_counter()
        handle = eng.save(state, layout.checkpoint_dir(root, 1))
        if lazy:
            eng.wait_for_snapshot()
        blocking = time.perf_counter() - t0
        handle.wait()
        durable = time.perf_counter() - t0
        target = {k: torch.empty_like(v) for k, v in state.items()}
        t0 = time.perf_counter()
        eng.load(root, target)
        restore = time.perf_counter() - t0
    if not all(torch.equal(target[k], v) for k, v in state.items()):
        raise RuntimeError("the restored state differs")
    return (blocking if lazy else durable), durable, restore


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mib", type=int, default=256)
    ap.add_argument("--tensors", type=int, default=8)
    ap.add_argument("--threads", type=int, default=8, help="upload and GET threads (and the raw client's)")
    ap.add_argument("--budget-mib", type=int, default=1024, help="the engine's staging budget")
    ap.add_argument("--reps", type=int, default=2, help="best of")
    a = ap.parse_args()
    size = a.size_mib << 20
    g = torch.Generator().manual_seed(0)
    state = {f"t{i}": torch.randn(size // a.tensors // 4, generator=g) for i in range(a.tensors)}
    data = b"".join(v.numpy().tobytes() for v in state.values())
    store = S3Store()
    try:
        store.start()
        os.environ.update(store.env())
        bucket = store.create_bucket()
        put, get = boto3_raw(store, bucket, 16 << 20, a.threads)
        rows = {}
        for r in range(a.reps):
            t = time.perf_counter()
            put(f"raw/{r}", data)
            p = time.perf_counter() - t
            out = bytearray(len(data))
            t = time.perf_counter()
            get(f"raw/{r}", out)
            rows.setdefault("raw multipart PUT / ranged GET (boto3)", []).append((p, p, time.perf_counter() - t))
            for lazy in (True, False):
                name = f"datastates {'lazy' if lazy else 'sync'}"
                rows.setdefault(name, []).append(engine_run(f"s3://{bucket}/{name.split()[1]}{r}", state, a.threads,
                                                            a.budget_mib << 20, lazy))
        print(f"{a.size_mib} MiB in {a.tensors} tensors, {a.threads} threads, best of {a.reps}; SeaweedFS weed mini "
              f"at {store.endpoint}")
        print(f"{'system':<40}{'blocking s':>11}{'durable s':>11}{'restore s':>11}{'PUT GB/s':>10}{'GET GB/s':>10}")
        for name, runs in rows.items():
            b, d, rs = (min(x[i] for x in runs) for i in range(3))
            print(f"{name:<40}{b:>11.3f}{d:>11.3f}{rs:>11.3f}{size / d / 1e9:>10.2f}{size / rs / 1e9:>10.2f}")
    finally:
        store.stop()
        shutil.rmtree(store.root, ignore_errors=True)


if __name__ == "__main__":
    main()
