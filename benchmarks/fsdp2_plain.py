"""Plain PyTorch FSDP2 checkpointed side by side, in one run, interleaved: examples/fsdp2/train.py's model
(`fully_shard` over gloo on CPU, AdamW, torch's distributed state dicts) saved by this engine lazily (`save`, the
fence before the next optimizer step) and synchronously (`save` + `wait`), and by PyTorch DCP's `async_save` (a
reused DefaultStager, pinned memory requested as torchtitan's async_with_pinned_mem; CPU torch stages pageable)
and `save`. Per system, the slowest rank's: the stall (the call; and the call plus an immediate fence), the time to
durable (fsynced, published), the restore into the live model (page cache evicted first, values checked after),
and the loop ratio: iterations with a checkpoint every iteration over the same iterations without one, the last
checkpoint's drain included, with what held the loop per checkpoint (its fences, save calls and final wait): the
part of the ratio the system itself holds, the rest being its background work slowing the training. CPU figures: no accelerator, so every copy is host memory to host memory.

    python benchmarks/fsdp2_plain.py [--ranks 2] [--sizes 1024,3072,3072,3072,1024] [--reps 3] [--out DIR]
    python benchmarks/fsdp2_plain.py --quick   # a tiny model, one rep of each phase: seconds
"""
from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import multiprocessing
import os
import shutil
import statistics
import tempfile
import time
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from common import evict_tree  # benchmarks/ helpers, by name as the other scripts import them
from datastates import CheckpointEngine, PosixOptions

_spec = importlib.util.spec_from_file_location(
    "fsdp2_train", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples", "fsdp2", "train.py"))
example = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(example)


class Engine:
    """This engine; `lazy`: the save returns at once and the fence waits for its snapshot, else save + wait."""

    def __init__(self, lazy: bool, state_bytes: int):
        self.name = "engine_lazy" if lazy else "engine_sync"
        self.lazy = lazy
        self.eng = CheckpointEngine(host_buffer_bytes=state_bytes * 11 // 10 + (64 << 20),
                                    storage=PosixOptions(writer_threads=4, fsync=True), stage_ahead=True)
        self.eng.staging_ready()

    def save(self, model, optimizer, path):
        self.eng.save(example.state(model, optimizer, 0), path)
        if not self.lazy:
            self.eng.wait()

    def fence(self):
        self.eng.wait_for_snapshot()

    def wait(self):
        self.eng.wait()

    def load(self, model, optimizer, path):
        example.resume(self.eng, path, model, optimizer)

    def close(self):
        self.eng.close()


class DCP:
    """PyTorch DCP on the same state dicts; `asynchronous`: async_save staged by a reused DefaultStager, at most one
    save in flight (torchtitan waits for the last one before the next), the staging waited for at the fence, and
    its collectives on a gloo group of its own (as torchtitan's: on the training's group they would interleave
    with FSDP's all-gathers)."""

    def __init__(self, asynchronous: bool):
        self.name = "dcp_async" if asynchronous else "dcp_sync"
        with warnings.catch_warnings():  # CPU torch: "Ignoring pin_memory flag" (said in the table's notes)
            warnings.simplefilter("ignore")
            self.stager = DefaultStager(StagingOptions(
                use_pinned_memory=True, use_shared_memory=False, use_async_staging=True,
                use_non_blocking_copy=torch.cuda.is_available())) if asynchronous else None
        self.group = dist.new_group(backend="gloo") if asynchronous else None
        self.pending = None

    @staticmethod
    def _sd(model, optimizer):
        return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}

    def save(self, model, optimizer, path):
        if self.stager is None:
            dcp.save(self._sd(model, optimizer), checkpoint_id=path)
            return
        self.wait()
        self.pending = dcp.async_save(self._sd(model, optimizer), checkpoint_id=path, async_stager=self.stager,
                                      process_group=self.group)

    def fence(self):
        if self.pending is not None:
            self.pending.staging_completion.result()

    def wait(self):
        if self.pending is not None:
            self.pending.upload_completion.result()
            self.pending = None

    def load(self, model, optimizer, path):
        sd = self._sd(model, optimizer)
        dcp.load(sd, checkpoint_id=path)
        set_model_state_dict(model, sd["model"])
        set_optimizer_state_dict(model, optimizer, sd["optim"])

    def close(self):
        self.wait()
        if self.stager is not None:
            self.stager.close()


def _slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _locals(model, optimizer) -> list[torch.Tensor]:
    """This rank's own storage of every parameter and optimizer state (DTensors' local shards)."""
    out = []
    for t in list(model.parameters()) + [v for s in optimizer.state.values() for v in s.values()]:
        out.append(t._local_tensor if hasattr(t, "_local_tensor") else t)
    return out


def _rotation(systems: list, rep: int) -> list:
    return systems if rep % 2 == 0 else systems[::-1]


def _fresh(path: str) -> str:
    if dist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
    dist.barrier()
    return path


def _timed(fn, *args) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def _step(model, optimizer, x, y, fence=lambda: None) -> float:
    """One training iteration, `fence` right before the optimizer step; the seconds the fence held it."""
    torch.nn.functional.mse_loss(model(x), y).backward()
    held = _timed(fence)
    optimizer.step()
    optimizer.zero_grad()
    return held


def _bench(work: str, a) -> dict | None:
    torch.set_num_threads(1)
    sizes = [int(n) for n in a.sizes.split(",")]
    model, optimizer = example.build(sizes)
    g = torch.Generator().manual_seed(dist.get_rank())
    x, y = torch.randn(a.batch, sizes[0], generator=g), torch.randn(a.batch, sizes[-1], generator=g)
    _step(model, optimizer, x, y)  # Adam's moments exist from here on
    local_bytes = sum(t.numel() * t.element_size() for t in _locals(model, optimizer))
    state_bytes = int(_slowest(local_bytes) * dist.get_world_size())
    systems = [Engine(True, local_bytes), Engine(False, local_bytes), DCP(True), DCP(False)]
    rows = {s.name: {"system": s.name, "call_s": [], "call_fence_s": [], "durable_s": [], "restore_s": []}
            for s in systems}
    for rep in range(a.reps + 1):  # rep 0 warms every system up
        for s in _rotation(systems, rep):
            path = _fresh(os.path.join(work, s.name))
            t0 = time.perf_counter()
            s.save(model, optimizer, path)
            call = time.perf_counter() - t0
            s.fence()
            fence = time.perf_counter() - t0
            s.wait()
            durable = time.perf_counter() - t0
            if rep:
                for key, v in (("call_s", call), ("call_fence_s", fence), ("durable_s", durable)):
                    rows[s.name][key].append(_slowest(v))
    expected = [t.double().sum().item() for t in _locals(model, optimizer)]
    for rep in range(a.reps):
        for s in _rotation(systems, rep):
            if dist.get_rank() == 0:
                evict_tree(os.path.join(work, s.name))
            with torch.no_grad():
                for t in _locals(model, optimizer):
                    t.zero_()
            dist.barrier()
            t0 = time.perf_counter()
            s.load(model, optimizer, os.path.join(work, s.name))
            rows[s.name]["restore_s"].append(_slowest(time.perf_counter() - t0))
            got = [t.double().sum().item() for t in _locals(model, optimizer)]
            assert got == expected, f"{s.name}: restored values differ from the saved ones"
    loops = {"none": []} | {s.name: [] for s in systems}
    held = {s.name: [] for s in systems}  # per round: the seconds the fences, save calls and final wait held it
    for rep in range(a.loop_rounds):
        for name in _rotation(list(loops), rep):
            s = next((s for s in systems if s.name == name), None)
            root = _fresh(os.path.join(work, "loop"))
            t0 = time.perf_counter()
            if s is None:
                for it in range(a.loop_iters):
                    _step(model, optimizer, x, y)
            else:
                h = sum(_step(model, optimizer, x, y, s.fence) +
                        _timed(s.save, model, optimizer, os.path.join(root, f"iter_{it:07d}"))
                        for it in range(a.loop_iters)) + _timed(s.wait)
                held[name].append(_slowest(h))
            loops[name].append(_slowest(time.perf_counter() - t0))
    for s in systems:
        s.close()
    if dist.get_rank():
        return None
    base = statistics.median(loops["none"]) / a.loop_iters
    out = []
    for s in systems:
        row = {k: (statistics.median(v) if isinstance(v, list) else v) for k, v in rows[s.name].items()}
        ratios = [t / none for t, none in zip(loops[s.name], loops["none"])]  # each round against its own
        row["loop_ratio"], row["loop_ratio_range"] = statistics.median(ratios), (min(ratios), max(ratios))
        row["loop_held_s"] = statistics.median(held[s.name]) / a.loop_iters
        out.append(row)
    return {"ranks": dist.get_world_size(), "sizes": sizes, "state_mb": round(state_bytes / 1e6, 1),
            "iteration_s": base, "loop_iters": a.loop_iters, "reps": a.reps, "systems": out}


def _rank(rank, world, port, work, a, results):
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=300))
    dist.init_process_group("gloo", rank=rank, world_size=world, store=store)
    try:
        out = _bench(work, a)
        if out is not None:
            results.put(out)
    finally:
        dist.destroy_process_group()


def table(result: dict) -> str:
    lines = [f"FSDP2 (`fully_shard`, gloo, CPU), {result['ranks']} ranks, model {result['sizes']}, state "
             f"{result['state_mb']} MB (fp32 parameters + Adam's two moments), {result['reps']} reps (medians), "
             f"loop of {result['loop_iters']} iterations of {result['iteration_s']:.3f} s with a checkpoint each",
             "", "| system | stall: call s | call + fence s | durable s | restore s | loop ratio (range) | loop held s |",
             "|---|---|---|---|---|---|---|"]
    for r in result["systems"]:
        lines.append(f"| {r['system']} | {r['call_s']:.3f} | {r['call_fence_s']:.3f} | {r['durable_s']:.3f} | "
                     f"{r['restore_s']:.3f} | {r['loop_ratio']:.2f} ({r['loop_ratio_range'][0]:.2f}-"
                     f"{r['loop_ratio_range'][1]:.2f}) | {r['loop_held_s']:.3f} |")
    return "\n".join(lines)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--sizes", default="1024,3072,3072,3072,1024", help="layer widths (default: ~300 MB of state)")
    ap.add_argument("--batch", type=int, default=256, help="rows per rank per iteration")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--loop-iters", type=int, default=4)
    ap.add_argument("--loop-rounds", type=int, default=2, help="rounds of the loop, the systems' order reversed "
                    "each round (A B .. B A)")
    ap.add_argument("--out", help="directory for fsdp2_plain.json (and the checkpoints, else a temporary one)")
    ap.add_argument("--quick", action="store_true", help="a tiny model, one rep, one round of a loop of 2 iterations")
    a = ap.parse_args(argv)
    if a.quick:
        a.sizes, a.batch, a.reps, a.loop_iters, a.loop_rounds = "64,128,128,8", 16, 1, 2, 1
    if a.out:
        os.makedirs(a.out, exist_ok=True)
    work = tempfile.mkdtemp(prefix="fsdp2_plain_", dir=a.out)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ctx = multiprocessing.get_context("fork")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, a.ranks, store.port, work, a, results)) for r in range(a.ranks)]
    try:
        for p in procs:
            p.start()
        while results.empty():
            failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if failed:
                raise RuntimeError(f"a rank failed (exit {failed[0]}): its traceback is above")
            time.sleep(0.2)
        result = results.get()
        for p in procs:
            p.join()
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        shutil.rmtree(work, ignore_errors=True)
    print(table(result), flush=True)
    if a.out:
        with open(os.path.join(a.out, "fsdp2_plain.json"), "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
