"""A node lost inside an elastic torchrun job, timed: two torchrun agents as two nodes of 2 ranks on this machine
(tests/test_elastic.py's scenario: TP2, the distributed optimizer, storage every 5 iterations), node 1's agent
and ranks SIGKILLed once its checkpoint of iteration 7 is held; the survivor goes on as DP1. Per level it resumes
from (the memory tier every iteration with replication factor 2, or storage alone) and per rendezvous setting:
the seconds from the loss to the survivor's first iteration, the iterations trained again (the one in flight
included), and the load's own seconds. Without replication the lost node's parts are nowhere else: storage.

    python benchmarks/elastic.py [--levels memory,storage] [--rdzv-conf last_call_timeout=5,keep_alive_interval=1]
    python benchmarks/elastic.py --quick   # the memory tier once, a short rendezvous settle (about a minute)

The issue's target: iterations lost at most one plus the one in flight with the memory tier; the time at most the
rendezvous's own settle time plus 1.5x (process start + load). Times are read from the trainer's log (whole
seconds) against the kill's own timestamp.
"""
import argparse
import datetime
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import torch.distributed as dist  # noqa: E402

from test_elastic import FLAGS, KILLED_AFTER, STORAGE_EVERY, _agent  # noqa: E402
from trainer_kills import kill_tree  # noqa: E402

ITERATION_RE = re.compile(r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)\] iteration +(\d+)/")
KILLED_RE = re.compile(r"FAULT-KILL-NODE 1 rank \d+ after the memory checkpoint of iteration \d+ at ([\d.]+)")
RESUMED_RE = re.compile(r"RESUMED from (.+?) at iteration (\d+), saved")
LOADED_RE = re.compile(r"successfully loaded checkpoint from .*? in ([\d.]+) ms")


def one_loss(work: str, level: str, rdzv_conf: str) -> dict:
    """Run the scenario once; what the survivor's log says."""
    flags = FLAGS + ["--save", os.path.join(work, "ck"), "--load", os.path.join(work, "ck"), "--save-interval",
                     str(STORAGE_EVERY), "--async-ckpt", "--non-persistent-save-interval", "1"]
    if level == "memory":  # else no replication: the lost node's parts are nowhere else, storage is loaded
        flags += ["--replication", "--replication-factor", "2"]
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, multi_tenant=True, timeout=datetime.timedelta(seconds=60))
    agents = [_agent(node, store.port, flags, work, rdzv_conf=rdzv_conf) for node in range(2)]
    try:
        for proc, _ in agents:
            proc.wait(timeout=600)
    finally:
        for proc, _ in agents:
            if proc.poll() is None:
                kill_tree(proc.pid)
    texts = [open(log).read() for _, log in agents]
    lost = next(i for i, text in enumerate(texts) if "FAULT-KILL-NODE" in text)
    survivor = texts[1 - lost]
    killed_at = min(float(t) for t in KILLED_RE.findall(texts[lost]))
    resumed = RESUMED_RE.search(survivor)
    after = [(datetime.datetime.strptime(ts, "%Y-%m-%d %H:%M:%S").timestamp(), int(it))
             for ts, it in ITERATION_RE.findall(survivor)]
    first = next(t for t, it in after if t >= int(killed_at) and it > int(resumed.group(2)))
    loaded = ([None] + list(LOADED_RE.finditer(survivor, 0, resumed.start())))[-1]  # logged before the resume line
    return {"level": level, "rdzv_conf": rdzv_conf, "resumed_from": resumed.group(1),
            "resumed_at": int(resumed.group(2)), "trained_again": KILLED_AFTER + 1 - int(resumed.group(2)),
            "loss_to_first_iteration_s": round(first - killed_at, 1),
            "load_s": float(loaded.group(1)) / 1e3 if loaded else None}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--levels", default="memory,storage")
    ap.add_argument("--rdzv-conf", action="append", default=None,
                    help="torchrun --rdzv-conf settings besides is_host=false (repeat; default: torchrun's own and "
                         "last_call_timeout=5,keep_alive_interval=1)")
    ap.add_argument("--quick", action="store_true", help="the memory tier once, last_call_timeout=2")
    a = ap.parse_args(argv)
    if a.quick:
        a.levels, a.rdzv_conf = "memory", ["last_call_timeout=2,keep_alive_interval=1"]
    confs = a.rdzv_conf or ["", "last_call_timeout=5,keep_alive_interval=1"]
    rows = []
    for conf in confs:
        for level in a.levels.split(","):
            with tempfile.TemporaryDirectory() as work:
                t0 = time.perf_counter()
                row = one_loss(work, level, ",".join(filter(None, ["is_host=false", conf])))
                row["run_s"] = round(time.perf_counter() - t0, 1)
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


if __name__ == "__main__":
    main()
