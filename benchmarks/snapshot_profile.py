"""Where a lazy snapshot's device-to-host time goes: the same state copied five ways, each timed to its last byte.

The GPU check measured the engine's snapshot at 21.7 GB/s on 1 GB and 6.8-8 GB/s on 8 GB, against 55 GB/s for one
plain copy into pinned memory. This splits that gap into its steps, on one device, with the benchmark's state
(the shapes of `common.make_state`, as run_all.py's):

    plain          one contiguous device buffer of the state's size into one pinned buffer (the ceiling)
    per_tensor     every tensor of the state into its own view of one pinned buffer, on a side stream
    slots_cold     every tensor, cut at the engine's slot size, into a fresh StagingPool's slots (each slot mapped and
                   cudaHostRegister'ed as the copier first takes it: what a first save pays); `register_s` is the
                   time spent taking slots
    slots_warm     the same into the same slots again (what every later save pays for its copies)
    engine_1, _2   CheckpointEngine.save + wait_for_snapshot, twice, to a directory (its writers running behind):
                   the snapshot as the training loop sees it, first save and steady state
    loads          a fresh engine's save of (at most) 1 GB loaded back twice: the first load's one-time cost

    python benchmarks/snapshot_profile.py --gb 8 --dir /tmp/snap [--json out.json]   (on a CUDA machine)
    python benchmarks/snapshot_profile.py --gb 0.05 --dir /tmp/snap --device cpu     (the code path, on a CPU)

Prints one line per step (seconds, GB/s) and writes them as JSON. Nothing here asserts on time.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

from datastates import CheckpointEngine, PosixOptions  # noqa: E402
from datastates.copies import make_backend  # noqa: E402  the internals measured: the engine's own copy steps
from datastates.slots import StagingPool, chunk_size  # noqa: E402


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _timed(device: str, fn) -> float:
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def device_state(nbytes: float, device: str) -> dict:
    """The benchmark state's shapes (`common.state_shapes`), filled on the device: the values do not matter here,
    and generating 8 GB on the host would take longer than everything measured."""
    shapes, _, _ = common.state_shapes(nbytes)
    return {part: {k: torch.empty(s, device=device).normal_() for k, s in shapes.items()}
            for part in ("model", "exp_avg", "exp_avg_sq")} | {"iteration": 1}


def _pinned(nbytes: int, device: str) -> tuple[torch.Tensor, float]:
    t0 = time.perf_counter()
    out = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device == "cuda")
    return out, time.perf_counter() - t0


def _drop_pinned_cache() -> None:
    """torch keeps freed pinned blocks for reuse: give them back, so each step pins its own memory."""
    empty = getattr(torch._C, "_host_emptyCache", None)
    if empty is not None and torch.cuda.is_available():
        empty()


def plain(nbytes: int, device: str) -> tuple[float, float]:
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(7)
    dst, alloc = _pinned(nbytes, device)
    _timed(device, lambda: dst.copy_(src, non_blocking=True))  # warms the copy engine
    return _timed(device, lambda: dst.copy_(src, non_blocking=True)), alloc


def per_tensor(tensors: list[torch.Tensor], device: str) -> tuple[float, float]:
    dst, alloc = _pinned(sum(t.nbytes for t in tensors), device)
    stream = torch.cuda.Stream() if device == "cuda" else None

    def copy():
        pos = 0
        for t in tensors:
            view = dst[pos:pos + t.nbytes].view(t.dtype).view(t.shape)
            if stream is not None:
                with torch.cuda.stream(stream):
                    view.copy_(t, non_blocking=True)
            else:
                view.copy_(t)
            pos += t.nbytes
        if stream is not None:
            stream.synchronize()

    return _timed(device, copy), alloc


def into_slots(tensors: list[torch.Tensor], pool: StagingPool, device: str) -> tuple[float, float]:
    """(seconds for every copy to land, seconds of it spent taking slots) with the engine's copy backend. Every slot
    is held to the end, so the pool must hold the whole state (a writer would hand slots back)."""
    backend = make_backend()
    slots, taking = [], 0.0

    def copy():
        nonlocal taking
        ordering = backend.begin()
        slot, fill, chunk = None, pool.slot_bytes, chunk_size(pool.slot_bytes)
        for t in tensors:
            flat = t.reshape(-1).view(torch.uint8)
            for start in range(0, flat.numel(), chunk):  # the engine's chunks, packed as its slot filler does
                n = min(chunk, flat.numel() - start)
                if fill + n > pool.slot_bytes:
                    if slot is not None:
                        backend.mark(slot)
                    t0 = time.perf_counter()
                    slot = pool.acquire(block=False)  # nothing hands a slot back here: waiting would hang
                    if slot is None:
                        raise RuntimeError(f"{pool.max_slots} slots of {pool.slot_bytes} bytes do not hold the state")
                    taking += time.perf_counter() - t0
                    slots.append(slot)
                    fill = 0
                backend.copy(slot.buffer[fill:fill + n], flat[start:start + n], ordering)
                fill += n
        backend.mark(slot)
        backend.finish()

    seconds = _timed(device, copy)
    for slot in slots:
        pool.release(slot)
    backend.close()
    return seconds, taking


def engine_saves(state: dict, nbytes: int, directory: str, budget: int) -> list[dict]:
    """Two saves, each: the call, the fence (wait_for_snapshot), the engine's own snapshot_s, then durable. The
    engine makes its staging at start (`stage_ahead`), as a trainer's does while it builds the model: the first
    save comes once it is ready (`staging_s`, how long making it took)."""
    engine = CheckpointEngine(host_buffer_bytes=budget, storage=PosixOptions(writer_threads=4, fsync=True),
                              stage_ahead=True)
    t0 = time.perf_counter()
    engine.staging_ready()
    staging_s = time.perf_counter() - t0
    out = []
    try:
        for i in (1, 2):
            path = os.path.join(directory, f"iter_{i:07d}")
            _sync("cuda" if torch.cuda.is_available() else "cpu")
            t0 = time.perf_counter()
            handle = engine.save(state, path)
            call = time.perf_counter() - t0
            engine.wait_for_snapshot()
            fence = time.perf_counter() - t0
            engine.wait()
            durable = time.perf_counter() - t0
            stats = handle.stats.as_dict()
            out.append({"call_s": call, "fence_s": fence, "snapshot_s": stats.get("snapshot_s"), "durable_s": durable,
                        "pinned_bytes": engine.pool.pinned_bytes, "staging_s": staging_s})
            shutil.rmtree(path, ignore_errors=True)
    finally:
        engine.close()
    return out


def engine_loads(directory: str, gb: float, device: str) -> dict:
    """A fresh engine saves a `gb` state, then loads it back into the same tensors twice: what a first load pays
    once (the GPU check saw 2.2 s, then 0.7 s, for one 1 GB checkpoint), and a new copy backend's own cost."""
    state = device_state(gb * common.GB, device)
    t0 = time.perf_counter()
    make_backend().close()
    new_backend = time.perf_counter() - t0
    engine = CheckpointEngine(host_buffer_bytes=int(gb * common.GB * 1.2) + (64 << 20),
                              storage=PosixOptions(writer_threads=4, fsync=True))
    path = os.path.join(directory, "loads", "iter_0000001")
    try:
        engine.save(state, path)
        engine.wait()
        out = {"new_backend_s": new_backend}
        for i in (1, 2):
            _sync(device)
            t0 = time.perf_counter()
            engine.checkpoint(path)
            opened = time.perf_counter() - t0
            engine.load(path, template=state)
            _sync(device)
            out[f"load_{i}_s"], out[f"open_{i}_s"] = time.perf_counter() - t0, opened
    finally:
        engine.close()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gb", type=float, default=8.0, help="state size in GB (default 8)")
    ap.add_argument("--dir", required=True, help="where the engine's two saves go (removed after)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args(argv)
    device = args.device
    state = device_state(args.gb * common.GB, device)
    tensors = [t for _, t in common.iter_tensors(state)]
    nbytes = sum(t.nbytes for t in tensors)
    budget = int(nbytes * 1.1) + (64 << 20)
    fig = {"device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu", "state_bytes": nbytes,
           "tensors": len(tensors), "largest_tensor_bytes": max(t.nbytes for t in tensors), "steps": {}}

    def report(step: str, seconds: float, **extra) -> None:
        fig["steps"][step] = {"seconds": seconds, "gbps": nbytes / seconds / 1e9, **extra}
        more = "".join(f", {k} {v:.3f}" if isinstance(v, float) else f", {k} {v}" for k, v in extra.items())
        print(f"snapshot_profile: {step:11s} {seconds:8.3f} s  {nbytes / seconds / 1e9:6.1f} GB/s{more}", flush=True)

    print(f"snapshot_profile: {nbytes / 1e9:.2f} GB in {len(tensors)} tensors on {fig['device']}", flush=True)
    seconds, alloc = plain(nbytes, device)
    _drop_pinned_cache()
    report("plain", seconds, alloc_s=alloc)
    seconds, alloc = per_tensor(tensors, device)
    _drop_pinned_cache()
    report("per_tensor", seconds, alloc_s=alloc)
    pool = StagingPool(int(nbytes * 1.25) + (64 << 20), 4, pinned=device == "cuda")  # holds it: see into_slots
    fig["slot_bytes"] = pool.slot_bytes
    seconds, taking = into_slots(tensors, pool, device)
    report("slots_cold", seconds, register_s=taking, slots=pool.allocated_bytes // pool.slot_bytes)
    seconds, taking = into_slots(tensors, pool, device)
    report("slots_warm", seconds, register_s=taking)
    pool.close()
    os.makedirs(args.dir, exist_ok=True)
    for i, save in enumerate(engine_saves(state, nbytes, args.dir, budget), 1):
        report(f"engine_{i}", save["fence_s"], **{k: v for k, v in save.items() if k != "fence_s"})
    loads = engine_loads(args.dir, min(1.0, args.gb), device)
    fig["loads"] = loads
    print(f"snapshot_profile: loads of a fresh engine's {min(1.0, args.gb):g} GB checkpoint: "
          + ", ".join(f"{k} {v:.3f}" for k, v in loads.items()), flush=True)
    shutil.rmtree(args.dir, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(fig, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
