"""One benchmark configuration (state size x ranks), run by `world` processes joined by a gloo group.

Phases, all on the same state and the same directory:
  1. save: warm-up round, then `reps` rounds; the systems are interleaved (A B C ... then ... C B A) so that
     drift of the shared disk hits all of them alike. Per checkpoint: call time, call+fence (blocking),
     time to durable (max over ranks, all files fsynced), peak extra memory of the process tree.
  2. restore: each system's last checkpoint, `restore_reps` rounds interleaved like the saves; each load
     into a zeroed state with the page cache of every system's checkpoint evicted first, verified against checksums
     taken before (outside the timing).
  3. loop (optional): N iterations of a compute loop (fixed matmul work, then an optimizer-like in-place
     update of the whole state) with a checkpoint every k iterations, per system and without checkpoints.
Rank 0 writes <out>/raw/<tag>.json.
"""
from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(1, os.path.dirname(HERE))


def _log(rank, *a):
    if rank == 0:
        print(*a, flush=True)


def _gather(obj):
    import torch.distributed as dist

    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _rm(path):
    shutil.rmtree(path, ignore_errors=True)


_deleting: list = []


def _rm_later(path):
    """Retention off the training loop's critical path, for every system alike: deleting a 1 GB file takes
    about a second on this disk (ext4 mounted with discard), which a trainer does not pay in its loop (the
    engine's own retention deletes in a background thread too). `_drain` waits for it before the next run."""
    import threading
    doomed = f"{path}.deleting.{time.monotonic_ns()}"
    os.rename(path, doomed)
    t = threading.Thread(target=shutil.rmtree, args=(doomed,), kwargs={"ignore_errors": True})
    t.start()
    _deleting.append(t)


def _drain():
    while _deleting:
        _deleting.pop().join()


def run(rank: int, world: int, cfg: dict):
    import torch
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(cfg["port"])
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        _run(rank, world, cfg)
    except Exception:
        traceback.print_exc()
        raise
    finally:
        try:
            dist.barrier()
        except Exception:
            pass
        dist.destroy_process_group()


# The read yardstick is the best of these ways to read a file raw: O_DIRECT from 1, 4 or 8 threads, or one
# buffered sequential stream (the engine's two read modes and their neighbours).
RAW_READS = ("1t", "4t", "8t", "stream")


class _RawRead:
    """One rank's raw read of a file (page cache evicted first): O_DIRECT from `how` threads ("4t"), or one
    buffered stream ("stream")."""

    def __init__(self, path: str, how: str):
        self.path, self.how, self.name = path, how, f"raw_read_{how}"

    def read(self):
        import probes
        if self.how == "stream":
            probes.read_stream(self.path)
        else:
            probes.read_odirect(self.path, os.path.getsize(self.path), int(self.how[:-1]))


def _run(rank, world, cfg):

    import common
    import systems as S

    guard = common.install_cpu_guard()
    if cfg.get("mode") == "memory":
        return _memory(rank, world, cfg)
    tag, root = cfg["tag"], cfg["ckpt_dir"]
    result = {"tag": tag, "size_gb": cfg["size_gb"], "ranks": world, "cpu_guard": guard, "save": {},
              "restore": {}, "restore_raw": {}, "loop": {}, "errors": {}}

    device = cfg.get("device", "cpu")
    state = common.make_state(cfg["size_gb"] * common.GB, rank, world, device=device)
    nbytes = sum(_gather(common.state_bytes(state)))
    result["device"] = device
    if device == "cuda":
        import probes
        result["d2h_pinned_gbps"] = probes.device_to_host_gbps()
        _log(rank, f"[{tag}] device -> pinned host copy {result['d2h_pinned_gbps']:.1f} GB/s")
    result["state_bytes"] = nbytes
    ref_sums = common.checksums(state)
    _log(rank, f"[{tag}] state {nbytes / 1e9:.3f} GB over {world} rank(s)")

    ctx = {"rank": rank, "world": world, "engine_buffer_bytes": cfg["engine_buffer_bytes"],
           "engine_writer_threads": cfg["engine_writer_threads"], "state_bytes": common.state_bytes(state)}
    systems = []
    for name in cfg["systems"]:
        s = S.REGISTRY[name]()
        try:
            s.setup(ctx)
            systems.append(s)
        except Exception as e:
            result["errors"][name] = f"setup: {type(e).__name__}: {e}"
            _log(rank, f"[{tag}] {name} setup failed: {e}")

    def one_save(s, path, it):
        """Returns the per-rank sample of one checkpoint; raises on failure."""
        S.barrier()
        mem = common.MemorySampler(max_share=0.1).start()  # beside a timed save: at most a tenth of a core
        t0 = time.perf_counter()
        s.save(state, path, it)
        t_call = time.perf_counter() - t0
        s.fence()
        t_fence = time.perf_counter() - t0
        extra = s.wait() or {}
        t_rank = time.perf_counter() - t0
        common.fsync_tree(path)
        t_rank_fsynced = time.perf_counter() - t0
        S.barrier()
        t_durable = time.perf_counter() - t0
        return {"call_s": t_call, "blocking_s": t_fence, "rank_done_s": t_rank, "rank_fsynced_s": t_rank_fsynced,
                "durable_s": t_durable, "peak_extra_mem": mem.stop(), **extra}

    # ---------------------------------------------------------------- 1. save
    last_path = {}
    failed = set()
    samples = {s.name: [] for s in systems}
    for rep in range(cfg["warmup"] + cfg["reps"]):
        order = systems if rep % 2 == 0 else systems[::-1]
        for s in order:
            if s.name in failed:
                continue
            path = os.path.join(root, s.name, f"iter_{rep + 1:07d}")
            try:
                smp = one_save(s, path, rep + 1)
                ok = True
            except Exception as e:
                smp, ok = {"error": f"{type(e).__name__}: {e}"}, False
                if rank == 0:
                    traceback.print_exc()
            all_ok = all(_gather(ok))
            per_rank = _gather(smp)
            if not all_ok:
                failed.add(s.name)
                result["errors"][s.name] = next(p["error"] for p in per_rank if "error" in p)
                _log(rank, f"[{tag}] {s.name} failed: {result['errors'][s.name]}")
                continue
            if rank == 0:
                if s.name in last_path:
                    _rm(last_path[s.name])
                if rep >= cfg["warmup"]:
                    samples[s.name].append(per_rank)
                    r0 = per_rank[0]
                    print(f"[{tag}] rep {rep} {s.name:17s} call {r0['call_s']:7.3f}s "
                          f"blocking {max(p['blocking_s'] for p in per_rank):7.3f}s "
                          f"durable {r0['durable_s']:7.3f}s", flush=True)
            last_path[s.name] = path
            S.barrier()

    if rank == 0:
        for name, reps in samples.items():
            if not reps:
                continue
            rec = {}
            keys = [k for k in reps[0][0] if isinstance(reps[0][0][k], (int, float))]
            for k in keys:
                # the loop is stalled as long as its slowest rank: max over ranks (those that report it: rank 0
                # alone publishes), then median over reps
                vals = [max(p[k] for p in per_rank if k in p) for per_rank in reps]
                rec[k] = {"median": statistics.median(vals), "min": min(vals), "max": max(vals), "samples": vals}
            rec["bytes_on_disk"] = common.tree_bytes(last_path[name])
            result["save"][name] = rec

    # ---------------------------------------------------------------- 2. restore
    restorable = [s for s in systems if s.name not in failed and s.name in last_path]
    # The yardstick, in the same rotation: each rank reads its own data file of the engine's checkpoint with
    # O_DIRECT at the same moment, so the disk's drift and any cache below the VM treat it like the loads.
    own_file = os.path.join(last_path.get("engine_lazy", ""), f"rank_{rank:05d}.data")
    if os.path.isfile(own_file):
        restorable += [_RawRead(own_file, how) for how in cfg.get("raw_reads") or RAW_READS]
    samples: dict[str, list[float]] = {}
    for rep in range(cfg.get("restore_reps", cfg["reps"])):
        for s in (restorable if rep % 2 == 0 else restorable[::-1]):  # A B … B A, as the saves
            for p in last_path.values():  # every system's: another's cached pages must not slow this read
                common.evict_tree(p)
            common.warm_free_memory(2 * common.state_bytes(state))  # page cache and new tensors of a load
            if isinstance(s, _RawRead):
                S.barrier()
                t0 = time.perf_counter()
                s.read()
                S.barrier()
                samples.setdefault(s.name, []).append(time.perf_counter() - t0)
                continue
            if s.name in result["restore"] and not result["restore"][s.name]["verified"]:
                continue  # failed once: reported, not retried
            path = last_path[s.name]
            for t in common.big_tensors(state):
                t.zero_()
            S.barrier()
            t0 = time.perf_counter()
            err = None
            try:
                s.load(state, path)
            except Exception as e:
                err = f"{type(e).__name__}: {e}"
            S.barrier()
            dt = time.perf_counter() - t0
            sums = common.checksums(state)
            ok = err is None and all(abs(sums[k] - v) <= 1e-6 * max(1.0, abs(v)) for k, v in ref_sums.items())
            oks, errs = _gather(ok), _gather(err)
            samples.setdefault(s.name, []).append(dt)
            if rank == 0:
                v = samples[s.name]
                result["restore"][s.name] = {"seconds": statistics.median(v), "min": min(v), "max": max(v),
                                             "samples": v, "verified": all(oks),
                                             "error": next((e for e in errs if e), None)}
                print(f"[{tag}] restore {s.name:17s} {dt:7.3f}s verified={all(oks)} {errs[0] or ''}", flush=True)
            else:
                result["restore"][s.name] = {"verified": all(oks)}
            if not ok:  # leave a correct state for whatever comes next
                state = common.make_state(cfg["size_gb"] * common.GB, rank, world, device=device)

    if rank == 0:
        for name in (f"raw_read_{how}" for how in RAW_READS):
            if name in samples:
                v = samples[name]
                result["restore_raw"][name] = {"seconds": statistics.median(v), "min": min(v), "max": max(v),
                                               "samples": v}

    # ---------------------------------------------------------------- 3. loop
    if cfg.get("loop_iters", 0) > 0:
        looped = [s for s in systems if s.name not in failed and s.name in (cfg.get("loop_systems") or [s.name])]
        result["loop"] = _loop(rank, world, cfg, state, looped, root)

    for s in systems:
        try:
            s.teardown()
        except Exception:
            pass
    if rank == 0:
        os.makedirs(os.path.join(cfg["out"], "raw"), exist_ok=True)
        with open(os.path.join(cfg["out"], "raw", f"{tag}.json"), "w") as f:
            json.dump(result, f, indent=1)
        _rm(root)


def _memory(rank, world, cfg):
    """Peak memory of a fresh process tree for one system: state built, then setup + warm-up + 2 checkpoints.

    Unlike the per-checkpoint column of the side-by-side phase, this includes memory a system keeps between
    checkpoints (staging pools, cached staged copies) and forked writers (PSS, so shared pages count once).
    """
    import common
    import systems as S

    state = common.make_state(cfg["size_gb"] * common.GB, rank, world, device=cfg.get("device", "cpu"))
    nbytes = common.state_bytes(state)
    ctx = {"rank": rank, "world": world, "engine_buffer_bytes": cfg["engine_buffer_bytes"],
           "engine_writer_threads": cfg["engine_writer_threads"], "state_bytes": nbytes}
    s = S.REGISTRY[cfg["systems"][0]]()
    # library imports are not checkpoint memory: load them all before the baseline
    import torch.distributed.checkpoint  # noqa: F401
    from megatron.core import dist_checkpointing  # noqa: F401
    try:
        import datastates  # noqa: F401
    except ImportError:
        pass
    mem = common.MemorySampler(0.01).start()
    res = {"system": s.name, "state_bytes": nbytes, "baseline_bytes": mem.baseline}
    try:
        s.setup(ctx)
        for i in range(3):
            path = os.path.join(cfg["ckpt_dir"], s.name, f"iter_{i + 1:07d}")
            s.save(state, path, i + 1)
            s.fence()
            for t in common.big_tensors(state):  # the optimizer step that follows (COW faults for forks)
                t.add_(1e-7)
            s.wait()
            common.fsync_tree(path)
            handle = getattr(s, "handle", None)
            if handle is not None:
                res["engine_peak_staging_bytes"] = handle.stats.peak_staging_bytes
            _rm(path)
        s.teardown()
    except Exception as e:
        res["error"] = f"{type(e).__name__}: {e}"
    res["peak_extra_bytes"] = mem.stop()
    res["peak_bytes"] = mem.peak
    S.barrier()
    if rank == 0:
        os.makedirs(os.path.join(cfg["out"], "mem"), exist_ok=True)
        with open(os.path.join(cfg["out"], "mem", f"{cfg['tag']}_{s.name}.json"), "w") as f:
            json.dump(res, f, indent=1)
        print(f"[mem {cfg['tag']}] {s.name:17s} peak extra {res['peak_extra_bytes'] / 1e9:6.2f} GB "
              f"(state {nbytes / 1e9:.2f} GB) {res.get('error', '')}", flush=True)


def _calibrate(seconds: float, device: str = "cpu"):
    """A fixed amount of matmul work that takes ~seconds on an idle machine (stands in for fwd/bwd). On a GPU:
    bf16 products of 8192 x 8192 matrices, queued, then waited for, as a training step ends in `loss.item()`."""
    import torch

    if device == "cuda":
        a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
        sync = torch.cuda.synchronize
    else:
        a = torch.randn(768, 768)
        sync = (lambda: None)
    b = a.clone()
    for _ in range(3):
        a @ b
    sync()
    per = float("inf")
    for _ in range(5):  # the fastest of several windows: a busy neighbour must not shrink the work
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < 0.1:
            for _ in range(8):
                a @ b
            sync()
            n += 8
        per = min(per, (time.perf_counter() - t0) / n)
    reps = max(1, int(seconds / per))

    def compute():
        for _ in range(reps):
            a @ b
        sync()

    return compute


def _loop(rank, world, cfg, state, systems, root):
    import common
    import systems as S

    import torch

    # One compute thread: on a GPU node forward/backward runs on the device and leaves the host CPU to the
    # checkpoint's copies and writes; here one of the two cores stands in for that idle host.
    torch.set_num_threads(1)
    compute = _calibrate(cfg["loop_compute_s"], cfg.get("device", "cpu"))
    tensors = common.big_tensors(state)
    iters = cfg["loop_iters"]
    out = {"iters": iters, "compute_s": cfg["loop_compute_s"], "runs": []}

    def run_one(s, k):
        """The loop's seconds, and where the checkpoints held it: the fence (`fence_s`), the save call
        (`call_s`), the wait for the previous checkpoint before the next (`wait_s`: at most one in flight), the
        last checkpoint's drain after the last step (`drain_s`)."""
        S.barrier()
        held = dict.fromkeys(("fence_s", "call_s", "wait_s", "drain_s"), 0.0)
        inflight = None
        keep = []
        t0, cpu0 = time.perf_counter(), time.process_time()
        for i in range(1, iters + 1):
            compute()                                 # forward/backward of step i: reads the state
            if s is not None:
                tb = time.perf_counter()
                s.fence()                             # before the optimizer mutates what was saved
                held["fence_s"] += time.perf_counter() - tb
            for t in tensors:                         # optimizer step: in-place update of all of it
                t.add_(1e-7)
            state["iteration"] = i
            if s is not None:
                s.poll()
                if i % k == 0:
                    tb = time.perf_counter()
                    if inflight is not None:          # at most one checkpoint in flight, for every system
                        s.wait()
                        common.fsync_tree(inflight)
                        keep.append(inflight)
                    tc = time.perf_counter()
                    path = os.path.join(root, "loop", s.name, f"iter_{i:07d}")
                    s.save(state, path, i)
                    inflight = path
                    held["wait_s"] += tc - tb
                    held["call_s"] += time.perf_counter() - tc
                    while len(keep) > 1:              # retention: keep the newest durable checkpoint
                        common.fsync_tree(keep[0])
                        if rank == 0:
                            _rm_later(keep.pop(0))
                        else:
                            keep.pop(0)
        if s is not None and inflight is not None:
            tb = time.perf_counter()
            s.fence()
            s.wait()
            common.fsync_tree(inflight)
            held["drain_s"] = time.perf_counter() - tb
        held["cpu_s"] = time.process_time() - cpu0  # the process's CPU: checkpointing's cost, less sensitive to load
        S.barrier()
        total = time.perf_counter() - t0
        _drain()
        if rank == 0:
            _rm(os.path.join(root, "loop"))
        S.barrier()
        return total, held

    intervals = cfg["loop_intervals"]
    rounds = int(cfg.get("loop_rounds", 2))
    base, base_cpu = [], []
    run_one(None, 1)  # warm-up of the loop itself (page faults, caches)
    out["floor_inputs"] = _floor_inputs(cfg, os.path.join(root, f"floor_probe_{rank}"), common.state_bytes(state))
    per = {}
    for k in intervals:
        for rnd in range(rounds):
            order = [None] + systems
            if rnd % 2:
                order = order[::-1]
            for s in order:
                if s is None:
                    t, held = run_one(None, k)
                    base.append(t)
                    base_cpu.append(held["cpu_s"])
                    _log(rank, f"[{cfg['tag']}] loop k={k} {'(no checkpoint)':17s} {t:7.2f}s (cpu {held['cpu_s']:.2f}s)")
                    continue
                try:
                    t, held = run_one(s, k)
                    per.setdefault((s.name, k), []).append((t, held))
                    _log(rank, f"[{cfg['tag']}] loop k={k} {s.name:17s} {t:7.2f}s (" +
                         ", ".join(f"{n[:-2]} {v:.2f}s" for n, v in held.items()) + ")")
                except Exception as e:
                    _log(rank, f"[{cfg['tag']}] loop k={k} {s.name} failed: {e}")
                    per.setdefault((s.name, k), []).append((None, str(e)))
    out["baseline_s"] = statistics.median(base)
    out["baseline_samples_s"] = base
    out["baseline_cpu_s"] = statistics.median(base_cpu)
    out["rounds"] = rounds
    _log(rank, f"[{cfg['tag']}] loop without checkpoints: {out['baseline_s']:.2f}s (samples {base})")
    for (name, k), v in per.items():
        ok = [x for x in v if x[0] is not None]
        if not ok:
            out["runs"].append({"system": name, "k": k, "error": v[0][1]})
            continue
        held = {n: statistics.median(x[1][n] for x in ok) for n in ok[0][1]}
        floor = loop_floor(out["baseline_s"], iters, k, **out["floor_inputs"])
        run = {"system": name, "k": k, "total_s": statistics.median(x[0] for x in ok), **held,
               "blocked_s": held["fence_s"] + held["call_s"] + held["wait_s"], "floor_s": floor,
               "extra_cpu_s": held["cpu_s"] - out["baseline_cpu_s"],
               "samples_s": [x[0] for x in ok]}
        out["runs"].append(run)
        _log(rank, f"[{cfg['tag']}] loop k={k} {name}: {run['total_s']:.2f}s = {run['total_s'] / floor:.3f}x its "
                   f"floor {floor:.2f}s, {run['total_s'] / out['baseline_s']:.3f}x the loop without checkpoints, "
                   f"{run['extra_cpu_s']:.2f}s more CPU")
    return out


def _floor_inputs(cfg, path, nbytes) -> dict:
    """What one checkpoint costs at the least on this machine: a plain copy of the state (device to pinned host
    memory, or a memcpy on CPU) and a plain write of its bytes to the checkpoint directory (O_DIRECT where the file
    system takes it, fsynced)."""
    import probes
    if cfg.get("device", "cpu") == "cuda":
        copy_s = nbytes / 1e9 / probes.device_to_host_gbps(nbytes)
    else:
        copy_s = min(probes.memcpy_seconds(nbytes) for _ in range(2))
    try:
        write_s = probes.write_odirect(path, nbytes)
    except OSError:
        write_s = probes.write_buffered_fsync(path, nbytes)
    finally:
        _rm(path)
    return {"copy_s": copy_s, "write_s": write_s}


def loop_floor(baseline_s: float, iters: int, k: int, copy_s: float, write_s: float) -> float:
    """The least the loop can take with a checkpoint every k of its `iters` steps and one in flight: the loop
    without checkpoints, plus per checkpoint what neither its copy nor its write can hide (the copy must end
    within the step after the save, the write before the next save), plus the last one's drain."""
    step, one = baseline_s / iters, max(copy_s, write_s)
    n = iters // k
    return baseline_s + one + max(0, n - 1) * max(0.0, one - k * step, copy_s - step)


def main():
    """Entry point for one configuration: python worker.py '<json cfg>' (spawns cfg['ranks'] processes)."""
    import torch.multiprocessing as mp

    cfg = json.loads(sys.argv[1])
    world = cfg["ranks"]
    if world == 1:
        run(0, 1, cfg)
    else:
        mp.spawn(_spawn_entry, args=(world, cfg), nprocs=world, join=True)


def _spawn_entry(rank, world, cfg):
    run(rank, world, cfg)


if __name__ == "__main__":
    main()
