#!/usr/bin/env python
"""Plot the figures of the Slurm sweep from the run logs written by examples/slurm/*.sbatch.

    python examples/slurm/plot.py --logs logs/slurm --out logs/slurm/figures

Each log (one trainer run) starts with a `RUN key=value ...` line and ends with `RUN_END rc=.. wall_s=..`; every
line is prefixed with the wall-clock time (epoch seconds). From pretrain_gpt.py's output it reads:
  iteration lines  ` [date] iteration N/M | ... | elapsed time per iteration (ms): X | ...`
  per checkpoint   `checkpoint summary iteration N | format: F (mode) | max stall ms over ranks: B |
                    max time to durable ms: D | bytes all ranks: S | throughput GB/s: T`
                   (or, when the summary is absent, rank 0's `checkpoint iteration N | ... | stall ms: B |
                    ... | time to durable ms: D | bytes: S | ...`)
  the end          `> training done at iteration N`
Writes summary.csv and model_size.png, dp_scale.png, e2e.png (those with data) into --out.
"""
from __future__ import annotations

import argparse
import csv
import glob
import os
import re
import statistics

SIZES = {"tiny": 0, "3B": 3, "7B": 7, "13B": 13, "30B": 30, "70B": 70}
RE_ITER = re.compile(r"iteration\s+(\d+)/\s*(\d+) \|.*elapsed time per iteration \(ms\): ([\d.]+)")
RE_SUMMARY = re.compile(r"checkpoint summary iteration\s+(\d+) \| format: (\S+) \((\w+)\) \| max stall ms over "
                        r"ranks: ([\d.]+) \| max time to durable ms: ([\d.]+) \| bytes all ranks: (\d+)")
RE_CKPT = re.compile(r"checkpoint iteration\s+(\d+) \| format: (\S+) \((\w+)\) \| stall ms: ([\d.]+) \|.*"
                     r"time to durable ms: ([\d.]+) \| bytes: (\d+)")
RE_DONE = re.compile(r"> training done at iteration (\d+)")


def parse(path: str) -> dict | None:
    run = {"log": path, "_its": [], "ckpts": {}, "rank0_ckpts": {}}
    first_ts = done_ts = None
    with open(path, errors="replace") as f:
        for raw in f:
            ts_s, _, line = raw.rstrip("\n").partition(" ")
            try:
                ts = float(ts_s)
            except ValueError:
                ts, line = None, raw.rstrip("\n")
            if line.startswith("RUN "):
                run.update(kv.split("=", 1) for kv in line[4:].split() if "=" in kv)
            elif line.startswith("RUN_END"):
                run.update(kv.split("=", 1) for kv in line[8:].split() if "=" in kv)
            elif m := RE_SUMMARY.search(line):
                run["ckpts"][int(m[1])] = (float(m[4]) / 1e3, float(m[5]) / 1e3, int(m[6]))
            elif m := RE_CKPT.search(line):
                run["rank0_ckpts"][int(m[1])] = (float(m[4]) / 1e3, float(m[5]) / 1e3, int(m[6]))
            elif m := RE_ITER.search(line):
                run["_its"].append((ts, int(m[1]), float(m[3]) / 1e3))
                if first_ts is None and ts is not None:
                    first_ts = ts - float(m[3]) / 1e3
            elif RE_DONE.search(line):
                done_ts = ts
    if "model" not in run:
        return None
    ck = run["ckpts"] or run["rank0_ckpts"]  # rank 0's numbers only when the all-rank summary is missing
    run["ckpt_source"] = "all ranks" if run["ckpts"] else "rank 0"
    its = sorted(ck)
    use = its[1:] if len(its) > 1 else its  # the first checkpoint of a process pays one-off costs
    if use:
        run["n_ckpt"] = len(use)
        run["blocking_s"] = statistics.median(ck[i][0] for i in use)
        run["durable_s"] = statistics.median(ck[i][1] for i in use)
        run["ckpt_bytes"] = statistics.median(ck[i][2] for i in use)
        run["gbps"] = statistics.median(ck[i][2] / ck[i][1] / 1e9 for i in use if ck[i][1] > 0)
    if run["_its"]:
        end = done_ts if done_ts is not None else run["_its"][-1][0]
        if first_ts is not None and end is not None:
            run["train_s"] = end - first_ts  # first iteration's start .. all checkpoints durable
        run["iter_s_median"] = statistics.median(x[2] for x in run["_its"])
    for k in ("nodes", "tp", "pp", "dp", "interval", "iters", "gpus_per_node"):
        if k in run and isinstance(run[k], str) and run[k].isdigit():
            run[k] = int(run[k])
    run["label"] = "no checkpoint" if run.get("interval") == 0 else \
        f"{run.get('format')}{' (async)' if run.get('mode') == 'async' else ' (sync)'}"
    return run


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--logs", default="logs/slurm")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    out = a.out or os.path.join(a.logs, "figures")
    os.makedirs(out, exist_ok=True)
    runs = [r for r in (parse(p) for p in sorted(glob.glob(os.path.join(a.logs, "**", "*.log"), recursive=True)))
            if r]
    if not runs:
        raise SystemExit(f"no run logs under {a.logs}")
    cols = ["figure", "model", "nodes", "tp", "pp", "dp", "format", "mode", "interval", "iters", "rc", "wall_s",
            "n_ckpt", "blocking_s", "durable_s", "ckpt_bytes", "gbps", "train_s", "iter_s_median", "ckpt_source",
            "log"]
    with open(os.path.join(out, "summary.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols, extrasaction="ignore")
        w.writeheader()
        for r in runs:
            w.writerow(r)
    for r in runs:
        print(f"{r.get('figure', '?'):10s} {r['model']:5s} n={r.get('nodes')} dp={r.get('dp')} {r['label']:24s} "
              f"k={r.get('interval')} rc={r.get('rc')} blocking={_f(r.get('blocking_s'))}s "
              f"durable={_f(r.get('durable_s'))}s GB/s={_f(r.get('gbps'))} train={_f(r.get('train_s'))}s")
    for r in runs:
        if r.get("mode") == "sync" and r.get("blocking_s") is not None and r["blocking_s"] < 0.9 * r["durable_s"]:
            print(f"note: {os.path.basename(r['log'])}: a synchronous save logged blocking {r['blocking_s']:.3f} s < "
                  f"time to durable {r['durable_s']:.3f} s; the trainer's blocking figure for sync mode covers "
                  "only part of the save (plotted as logged)")
    bad = [r for r in runs if str(r.get("rc", "0")) != "0"]

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []

    def series_plot(fig_name, xkey, xlabel, fname, title, xorder=None):
        sel = [r for r in runs if r.get("figure") == fig_name and "gbps" in r]
        if not sel:
            return
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
        for lab in sorted({r["label"] for r in sel}):
            pts = sorted(((xorder(r[xkey]) if xorder else r[xkey]), r) for r in sel if r["label"] == lab)
            xs = [p[0] for p in pts]
            a1.plot(xs, [p[1]["gbps"] for p in pts], marker="o", label=lab)
            a2.plot(xs, [p[1]["blocking_s"] for p in pts], marker="o", label=lab)
        ticks = sorted({(xorder(r[xkey]) if xorder else r[xkey], r[xkey]) for r in sel})
        for ax in (a1, a2):
            ax.set_xticks([t[0] for t in ticks])
            ax.set_xticklabels([str(t[1]) for t in ticks])
            ax.set_xlabel(xlabel)
            ax.legend(fontsize=8)
        a1.set_ylabel("aggregate checkpoint throughput (GB/s)")
        a2.set_ylabel("blocking time per checkpoint (s)")
        a2.set_yscale("log")
        fig.suptitle(title)
        fig.tight_layout()
        p = os.path.join(out, fname)
        fig.savefig(p, dpi=110)
        plt.close(fig)
        made.append(p)

    series_plot("model_size", "model", "model size", "model_size.png",
                "Checkpointing vs. model size (TP=4, PP=nodes)", xorder=lambda m: list(SIZES).index(m))
    series_plot("dp_scale", "dp", "data-parallel replicas", "dp_scale.png",
                "Checkpointing vs. data-parallel scale (model and TPxPP fixed)")

    e2e = [r for r in runs if r.get("figure") == "e2e" and "train_s" in r]
    if e2e:
        groups = sorted({(r["model"], r.get("nodes")) for r in e2e}, key=lambda g: (SIZES.get(g[0], 99), g[1]))
        fig, axes = plt.subplots(1, len(groups), figsize=(6 * len(groups), 4), squeeze=False)
        for ax, (model, nodes) in zip(axes[0], groups):
            g = [r for r in e2e if r["model"] == model and r.get("nodes") == nodes]
            base = next((r["train_s"] for r in g if r.get("interval") == 0), None)
            ks = sorted({r["interval"] for r in g if r.get("interval")})
            labs = sorted({r["label"] for r in g if r.get("interval")})
            wdt = 0.8 / max(1, len(labs))
            for i, lab in enumerate(labs):
                xs, ys = [], []
                for j, k in enumerate(ks):
                    r = next((r for r in g if r["label"] == lab and r.get("interval") == k), None)
                    if r:
                        xs.append(j + (i - (len(labs) - 1) / 2) * wdt)
                        ys.append(r["train_s"] / base if base else r["train_s"])
                ax.bar(xs, ys, wdt, label=lab)
            if base:
                ax.axhline(1.0, color="k", linestyle="--", linewidth=1)
            ax.set_xticks(range(len(ks)))
            ax.set_xticklabels([f"every {k}" for k in ks])
            ax.set_ylabel("training time / without checkpoints" if base else "training time (s)")
            ax.set_title(f"{model} on {nodes} node(s)" + (f", no-checkpoint run {base:.1f} s" if base else ""))
            ax.legend(fontsize=8)
        fig.tight_layout()
        p = os.path.join(out, "e2e.png")
        fig.savefig(p, dpi=110)
        plt.close(fig)
        made.append(p)
    print("wrote", os.path.join(out, "summary.csv"), *made)
    if bad:
        print("runs that failed:", *[r["log"] for r in bad])
        raise SystemExit(1)


def _f(v):
    return "—" if v is None else f"{v:.3f}"


if __name__ == "__main__":
    main()
