"""A node lost inside an elastic torchrun job, timed: two torchrun agents as two nodes of 2 ranks on this machine
(tests/test_elastic.py's scenario: TP2, the distributed optimizer, storage every 5 iterations), one node's agent
and ranks SIGKILLed once its checkpoint of iteration 7 is held; the survivor goes on as DP1. Per rendezvous and
node lost (node 1 under a c10d store that this process hosts, as an agent would; node 0, the first started,
under etcd, which no node hosts), per level it resumes from (the memory tier every iteration with replication
factor 2, or storage alone) and per rendezvous setting: the seconds from the loss to the survivor's first
iteration, the iterations trained again (the one in flight included), the load's own seconds, and etcd's own
start (launch to its first answer). Without replication the lost node's parts are nowhere else: storage.

    python benchmarks/elastic.py [--rdzv c10d:1,etcd:0] [--levels memory,storage]
                                 [--rdzv-conf last_call_timeout=5,keep_alive_interval=1]
    python benchmarks/elastic.py --quick   # the memory tier once, c10d, a short rendezvous settle (about a minute)

The issue's target: iterations lost at most one plus the one in flight with the memory tier; the time at most the
rendezvous's own settle time plus 1.5x (process start + load). Times are read from the trainer's log (whole
seconds) against the kill's own timestamp.
"""
import argparse
import json
import os
import re
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from etcd_server import EtcdServer  # noqa: E402
from test_elastic import FLAGS, KILLED_AFTER, STORAGE_EVERY, _elastic_job, c10d_store  # noqa: E402

ITERATION_RE = re.compile(r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)\] iteration +(\d+)/")
KILLED_RE = re.compile(r"FAULT-KILL-NODE \d+ rank \d+ after the memory checkpoint of iteration \d+ at ([\d.]+)")
RESUMED_RE = re.compile(r"RESUMED from (.+?) at iteration (\d+), saved")
LOADED_RE = re.compile(r"successfully loaded checkpoint from .*? in ([\d.]+) ms")


def one_loss(work: str, level: str, rdzv: str, killed: int, rdzv_conf: str) -> dict:
    """Run the scenario once on rendezvous `rdzv` (c10d or etcd), node `killed` lost; what the survivor's log
    says."""
    flags = FLAGS + ["--save", os.path.join(work, "ck"), "--load", os.path.join(work, "ck"), "--save-interval",
                     str(STORAGE_EVERY), "--async-ckpt", "--non-persistent-save-interval", "1"]
    if level == "memory":  # else no replication: the lost node's parts are nowhere else, storage is loaded
        flags += ["--replication", "--replication-factor", "2"]
    row = {"rdzv": rdzv, "lost_node": killed, "level": level, "rdzv_conf": rdzv_conf}
    if rdzv == "etcd":
        with EtcdServer(work) as etcd:
            row["service_start_s"] = round(etcd.start_s, 2)
            _, survivor, lost = _elastic_job(work, flags, etcd.endpoint, killed, "etcd-v2", rdzv_conf, 600)
    else:
        store, endpoint = c10d_store()
        _, survivor, lost = _elastic_job(work, flags, endpoint, killed, "c10d",
                                         ",".join(filter(None, ["is_host=false", rdzv_conf])), 600)
    killed_at = min(float(t) for t in KILLED_RE.findall(lost))
    resumed = RESUMED_RE.search(survivor)
    after = [(datetime.strptime(ts, "%Y-%m-%d %H:%M:%S").timestamp(), int(it))
             for ts, it in ITERATION_RE.findall(survivor)]
    first = next(t for t, it in after if t >= int(killed_at) and it > int(resumed.group(2)))
    loaded = ([None] + list(LOADED_RE.finditer(survivor, 0, resumed.start())))[-1]  # logged before the resume line
    return {**row, "resumed_from": resumed.group(1), "resumed_at": int(resumed.group(2)),
            "trained_again": KILLED_AFTER + 1 - int(resumed.group(2)),
            "loss_to_first_iteration_s": round(first - killed_at, 1),
            "load_s": float(loaded.group(1)) / 1e3 if loaded else None}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rdzv", default="c10d:1,etcd:0",
                    help="rendezvous:node lost, comma-separated (c10d: a store this process hosts, with is_host=false)")
    ap.add_argument("--levels", default="memory,storage")
    ap.add_argument("--rdzv-conf", action="append", default=None,
                    help="torchrun --rdzv-conf settings (repeat; default: torchrun's own and "
                         "last_call_timeout=5,keep_alive_interval=1)")
    ap.add_argument("--quick", action="store_true", help="the memory tier once, c10d, last_call_timeout=2")
    a = ap.parse_args(argv)
    if a.quick:
        a.rdzv, a.levels, a.rdzv_conf = "c10d:1", "memory", ["last_call_timeout=2,keep_alive_interval=1"]
    confs = a.rdzv_conf or ["", "last_call_timeout=5,keep_alive_interval=1"]
    rows = []
    for conf in confs:
        for scenario in a.rdzv.split(","):
            rdzv, killed = scenario.split(":")
            for level in a.levels.split(","):
                with tempfile.TemporaryDirectory() as work:
                    t0 = time.perf_counter()
                    row = one_loss(work, level, rdzv, int(killed), conf)
                    row["run_s"] = round(time.perf_counter() - t0, 1)
                print(json.dumps(row), flush=True)
                rows.append(row)
    return rows


if __name__ == "__main__":
    main()
