"""The fence against a plain copy: `save()` plus an immediate `wait_for_snapshot()` (the most a training step
shorter than the snapshot waits), timed beside a plain copy of the same tensors into a buffer of the same size,
in the same process, rounds alternated. The fence is meant to wait for the copies only; the checksums the copy
threads also compute belong to the writers' side.

    python benchmarks/fence.py --gb 1 --tensors 32 --rounds 7 --dir /tmp/fence [--copy-threads N]

`--pool` times the native copy pool alone, as the engine queues it (64 MiB slots, each slot's four chunks
checksummed after its copies): to the last copy (what the fence waits for) and to the last checksum, beside the
same copies with no checksum; and to the last copy when the caller, as the fence's does, runs queued copies
itself (`run_copies`). On a busy host its figures move far less than the engine's against torch's copy.

Prints the median of each and of each round's ratio (a plain copy beside its fence: both under the same load),
one line; with --json, every sample. Nothing here asserts on time.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time

import torch

from datastates import CheckpointEngine, PosixOptions


def pool_rounds(threads: int, rounds: int, gib: float) -> None:
    from datastates import _native  # the internal measured: the copy pool's order of copies and checksums
    slot, nbytes = 64 << 20, int(gib * 2**30) // (64 << 20) * (64 << 20)
    src = torch.randn(nbytes // 4)
    dst = torch.empty_like(src)
    pool = _native.CopyPool(threads)

    def one(checksums: bool, lend: bool = False) -> tuple[float, float]:
        t0, batches, sums = time.perf_counter(), [], []
        for off in range(0, nbytes, slot):
            batch = _native.CopyBatch()
            pool.copy(batch, dst.data_ptr() + off, src.data_ptr() + off, slot)
            batches.append(batch)
            if checksums:
                sums.append(pool.checksum(batch, dst.data_ptr() + off, [(k, slot // 4) for k in range(0, slot, slot // 4)]))
        if lend:
            pool.run_copies()
        for batch in batches:
            batch.wait()
        copied = time.perf_counter() - t0
        for s in sums:
            s.wait()
        return copied, time.perf_counter() - t0

    plain, both, lent = [], [], []
    for r in range(rounds + 1):  # the first round warms up, not counted
        p, b, c = one(False)[0], one(True), one(True, lend=True)[0]
        if r:
            plain.append(p)
            both.append(b)
            lent.append(c)
    m = statistics.median
    print(f"copy pool, {threads} thread(s), {nbytes / 2**30:.2f} GiB, {rounds} rounds: copies alone {m(plain) * 1e3:.0f} "
          f"ms; with checksums: copies done {m(c for c, _ in both) * 1e3:.0f} ms, checksums done "
          f"{m(s for _, s in both) * 1e3:.0f} ms; copies done x copies alone {m(c / p for (c, _), p in zip(both, plain)):.2f}; "
          f"with checksums and the caller lent to the copies: copies done {m(lent) * 1e3:.0f} ms")
    pool.close()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gb", type=float, default=1.0)
    p.add_argument("--tensors", type=int, default=32)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--dir", default="/tmp/ds_fence")
    p.add_argument("--copy-threads", type=int, default=None, help="default: the engine's own choice")
    p.add_argument("--json", default=None)
    p.add_argument("--pool", action="store_true", help="the native copy pool alone (--copy-threads, default 1)")
    a = p.parse_args(argv)
    if a.pool:
        return pool_rounds(a.copy_threads or 1, a.rounds, a.gb)
    per = int(a.gb * 2**30) // 4 // a.tensors
    state = {f"t{i}": torch.randn(per) for i in range(a.tensors)}
    plain = [torch.empty_like(t) for t in state.values()]
    nbytes = per * 4 * a.tensors
    samples = {"plain": [], "fence": []}
    shutil.rmtree(a.dir, ignore_errors=True)
    with CheckpointEngine(host_buffer_bytes=nbytes + (64 << 20), storage=PosixOptions(fsync=False),
                          copy_threads=a.copy_threads, keep_last=1) as engine:
        for r in range(a.rounds + 1):  # the first round warms both up, not counted
            t0 = time.perf_counter()
            for dst, src in zip(plain, state.values()):
                dst.copy_(src)
            plain_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            handle = engine.save(state, f"{a.dir}/iter_{r + 1:07d}")
            engine.wait_for_snapshot()
            fence_s = time.perf_counter() - t0
            handle.wait()  # the writes, off the clock
            if r:
                samples["plain"].append(plain_s)
                samples["fence"].append(fence_s)
    shutil.rmtree(a.dir, ignore_errors=True)
    plain_m, fence_m = statistics.median(samples["plain"]), statistics.median(samples["fence"])
    ratio = statistics.median(f / c for f, c in zip(samples["fence"], samples["plain"]))  # each round's own
    print(f"{nbytes / 2**30:.2f} GiB in {a.tensors} tensors, {a.rounds} rounds: plain copy {plain_m * 1e3:.0f} ms, "
          f"save + fence {fence_m * 1e3:.0f} ms (medians), {ratio:.2f}x (the median of each round's ratio)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"bytes": nbytes, "tensors": a.tensors, **samples}, f, indent=1)


if __name__ == "__main__":
    main()
