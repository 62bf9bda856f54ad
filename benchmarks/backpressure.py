"""Back-pressure load test: save every iteration, faster than the disk can absorb, with a state much larger than
the staging budget and no compute in between.

Checks and prints: peak staging bytes <= budget (engine's own peak and the pool's allocation), process RSS growth
(psutil, sampled every 10 ms) bounded by the budget plus a fixed slack, no deadlock (the whole loop runs under a
watchdog), checkpoints published in order (the tracker, polled every 5 ms, only increases; the metadata of
iteration i is older than that of i+1), and the latest checkpoint loads bit-exact.

    python benchmarks/backpressure.py [--state-mb 512] [--budget-mb 64] [--iters 20] [--dir /tmp/bp] [--no-fsync]
    python benchmarks/backpressure.py --quick --dir DIR   # seconds: 16 MB of state, 4 MB budget, 5 saves
"""
from __future__ import annotations

import argparse
import faulthandler
import json
import os
import shutil
import sys
import tempfile
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from datastates import CheckpointEngine, PosixOptions, published_iterations, read_json, read_latest
from datastates.paths import METADATA, TRACKER, checkpoint_dir

RSS_SLACK = 96 << 20  # interpreter, threads, pickles, page-table noise


def _state(state_mb: float, n_tensors: int = 8) -> dict:
    numel = int(state_mb * (1 << 20) / 4 / n_tensors)
    return {f"layer{k}": torch.zeros(numel) for k in range(n_tensors)} | {"iteration": 0}


def _mutate(state: dict, it: int) -> None:
    for k, v in state.items():
        if isinstance(v, torch.Tensor):
            v.fill_(float(it) + int(k[5:]) / 16)
    state["iteration"] = it


def run(root: str, state_mb: float = 512, budget_mb: float = 64, iters: int = 20, writer_threads: int = 4,
        fsync: bool = True, keep_last: int | None = 2, timeout_s: float = 600) -> dict:
    import psutil
    proc = psutil.Process()
    os.makedirs(root, exist_ok=True)
    state = _state(state_mb)
    budget = int(budget_mb * (1 << 20))
    res: dict = {"state_bytes": sum(v.numel() * 4 for v in state.values() if isinstance(v, torch.Tensor)),
                 "budget_bytes": budget, "iters": iters}
    trackers: list[int] = []
    rss = {"base": proc.memory_info().rss, "peak": 0}
    stop = threading.Event()

    def poll():
        tracker = os.path.join(root, TRACKER)
        last_rss = 0.0
        while not stop.is_set():
            try:
                with open(tracker) as f:  # the file itself, as an observer sees it change
                    text = f.read().strip()
                if text.isdigit() and (not trackers or trackers[-1] != int(text)):
                    trackers.append(int(text))
            except FileNotFoundError:
                pass
            now = time.monotonic()
            if now - last_rss > 0.01:
                rss["peak"] = max(rss["peak"], proc.memory_info().rss)
                last_rss = now
            time.sleep(0.005)

    stats: list = []
    blocking: list[float] = []
    errors: list[BaseException] = []
    eng = CheckpointEngine(host_buffer_bytes=budget, storage=PosixOptions(writer_threads=writer_threads, fsync=fsync),
                           keep_last=keep_last)

    def loop():
        try:
            for it in range(1, iters + 1):
                t0 = time.perf_counter()
                eng.wait_for_snapshot()  # the fence before the "optimizer step"
                _mutate(state, it)
                eng.save(state, checkpoint_dir(root, it))
                blocking.append(time.perf_counter() - t0)
                for h in eng.maybe_finalize() or []:
                    if getattr(h, "error", None) is not None:
                        raise h.error
            stats.extend(eng.wait())
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    t0 = time.perf_counter()
    worker = threading.Thread(target=loop, daemon=True)
    worker.start()
    worker.join(timeout_s)
    elapsed = time.perf_counter() - t0
    res["deadlock"] = worker.is_alive()
    if res["deadlock"]:
        faulthandler.dump_traceback(all_threads=True)
    stop.set()
    poller.join()
    if errors:
        raise errors[0]
    if not res["deadlock"]:
        trackers_final = read_latest(root)
        if not trackers or trackers[-1] != trackers_final:
            trackers.append(trackers_final)
    res.update(
        elapsed_s=elapsed,
        saved_bytes=res["state_bytes"] * iters,
        throughput_gbps=res["state_bytes"] * iters / elapsed / 1e9,
        peak_staging_bytes=max((s.peak_staging_bytes for s in stats), default=0),
        allocated_bytes=eng.pool.allocated_bytes,
        rss_base_bytes=rss["base"], rss_peak_bytes=rss["peak"], rss_growth_bytes=max(0, rss["peak"] - rss["base"]),
        blocking_mean_s=sum(blocking) / max(1, len(blocking)), blocking_max_s=max(blocking, default=0.0),
        tracker_values=trackers,
        tracker_monotonic=all(a < b for a, b in zip(trackers, trackers[1:])),
        latest=read_latest(root),
    )
    published = published_iterations(root)
    created = [read_json(os.path.join(checkpoint_dir(root, i), METADATA), "metadata")["created_unix"]
               for i in published]
    res["published"] = published
    res["publish_order_ok"] = all(a < b for a, b in zip(created, created[1:])) and res["tracker_monotonic"]
    expected = _state(state_mb)
    _mutate(expected, iters)
    loaded = eng.load(root)
    res["verified_latest"] = loaded["iteration"] == iters and all(
        torch.equal(loaded[k], v) for k, v in expected.items() if isinstance(v, torch.Tensor))
    res["rss_bounded"] = res["rss_growth_bytes"] <= budget + RSS_SLACK
    eng.close()
    return res


def main(argv=None) -> int:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from deps import require
    require("psutil")
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--state-mb", type=float, default=512)
    p.add_argument("--budget-mb", type=float, default=64)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--writer-threads", type=int, default=4)
    p.add_argument("--keep-last", type=int, default=2)
    p.add_argument("--no-fsync", action="store_true")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--dir", default=None)
    p.add_argument("--quick", action="store_true", help="seconds: 16 MB of state, a 4 MB budget, 5 saves")
    a = p.parse_args(argv)
    if a.quick:
        a.state_mb, a.budget_mb, a.iters = 16, 4, 5
    root = a.dir or tempfile.mkdtemp(prefix="backpressure_")
    try:
        res = run(root, a.state_mb, a.budget_mb, a.iters, a.writer_threads, not a.no_fsync, a.keep_last, a.timeout)
    finally:
        if a.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    mb = 1 << 20
    print(f"state {res['state_bytes'] / mb:.0f} MiB, budget {res['budget_bytes'] / mb:.0f} MiB, "
          f"{res['iters']} saves back to back in {res['elapsed_s']:.1f} s ({res['throughput_gbps']:.2f} GB/s)")
    print(f"peak staging {res['peak_staging_bytes'] / mb:.1f} MiB, pool allocated {res['allocated_bytes'] / mb:.1f} MiB"
          f" (budget {res['budget_bytes'] / mb:.0f} MiB)")
    print(f"RSS {res['rss_base_bytes'] / mb:.0f} MiB -> peak {res['rss_peak_bytes'] / mb:.0f} MiB "
          f"(+{res['rss_growth_bytes'] / mb:.0f} MiB; bound budget + {RSS_SLACK // mb} MiB)")
    print(f"blocking per iteration: mean {res['blocking_mean_s'] * 1e3:.0f} ms, max {res['blocking_max_s'] * 1e3:.0f} ms")
    print(f"tracker seen: {res['tracker_values']}; published now: {res['published']}")
    ok = {"no deadlock": not res["deadlock"], "staging <= budget": res["peak_staging_bytes"] <= res["budget_bytes"]
          and res["allocated_bytes"] <= res["budget_bytes"], "RSS bounded": res["rss_bounded"],
          "published in order": res["publish_order_ok"], "latest bit-exact": res["verified_latest"]}
    print(json.dumps(ok))
    return 0 if all(ok.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
