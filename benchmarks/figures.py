"""The PNG figures of a benchmark run (matplotlib, imported only when drawing)."""
from __future__ import annotations

import os

from labels import LABELS, ORDER


def plot_mem(mem, figdir):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in mem if "error" not in r]
    if not ok:
        return []
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.bar(range(len(ok)), [r["peak_extra_bytes"] / 1e9 for r in ok],
           color=[plt.get_cmap("tab10")(ORDER.index(r["system"])) for r in ok])
    ax.axhline(ok[0]["state_bytes"] / 1e9, color="k", linestyle="--", linewidth=1, label="state size")
    ax.set_xticks(range(len(ok)))
    ax.set_xticklabels([LABELS[r["system"]] for r in ok], rotation=25, ha="right", fontsize=8)
    ax.set_ylabel("GB above the state-only baseline")
    ax.set_title(f"Peak memory (PSS of process tree), {ok[0]['state_bytes'] / 1e9:.2f} GB state")
    ax.legend(fontsize=8)
    fig.tight_layout()
    p = os.path.join(figdir, "peak_memory_fresh.png")
    fig.savefig(p, dpi=110)
    plt.close(fig)
    return [p]


def plots(rs, configs, probes, trainer, figdir):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(figdir, exist_ok=True)
    made = []
    tags = [c["tag"] for c in configs]
    names = [c_tag_label(c) for c in configs]
    systems = [s for s in ORDER if any(r["system"] == s and "error" not in r for r in rs)]
    colors = {s: plt.get_cmap("tab10")(i) for i, s in enumerate(ORDER)}

    def grouped(metric, ylabel, fname, title, log=False, lo=None, hi=None, hline=None):
        fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(tags) + 3), 4.2))
        w = 0.8 / max(1, len(systems))
        for i, s in enumerate(systems):
            xs, ys, errs = [], [], [[], []]
            for j, t in enumerate(tags):
                r = next((r for r in rs if r["tag"] == t and r["system"] == s and "error" not in r), None)
                if r is None or r.get(metric) is None:
                    continue
                xs.append(j + (i - (len(systems) - 1) / 2) * w)
                ys.append(r[metric])
                if lo and hi:
                    errs[0].append(max(0, r[metric] - r[lo]))
                    errs[1].append(max(0, r[hi] - r[metric]))
            ax.bar(xs, ys, w, label=LABELS[s], color=colors[s], yerr=errs if lo and hi and xs else None,
                   capsize=2)
            if metric == "blocking_s" and s in ("engine_lazy", "dcp_async"):
                calls = [next(r for r in rs if r["tag"] == t and r["system"] == s and "error" not in r)["call_s"]
                         for t in tags if any(r["tag"] == t and r["system"] == s and "error" not in r for r in rs)]
                ax.scatter(xs, calls, marker="v", color="k", s=18, zorder=3,
                           label="save() call alone" if s == "engine_lazy" else None)
        if hline:
            for j, t in enumerate(tags):
                v = hline(t)
                if v:
                    ax.hlines(v, j - 0.45, j + 0.45, colors="k", linestyles="--", linewidth=1)
        ax.set_xticks(range(len(tags)))
        ax.set_xticklabels(names)
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        if log:
            ax.set_yscale("log")
        ax.legend(fontsize=7, ncol=2)
        fig.tight_layout()
        p = os.path.join(figdir, fname)
        fig.savefig(p, dpi=110)
        plt.close(fig)
        made.append(p)

    grouped("blocking_s", "seconds (log)", "blocking.png",
            "Blocking time per checkpoint (median, min–max)", log=True, lo="blocking_min_s", hi="blocking_max_s")
    grouped("durable_s", "seconds", "durable.png", "Time to durable (fsynced, all ranks)",
            lo="durable_min_s", hi="durable_max_s")
    grouped("gbps", "GB/s", "throughput.png", "Throughput (bytes / time to durable); "
            "dashed = raw O_DIRECT", hline=lambda t: probes.get(t, {}).get("raw_odirect_gbps"))
    grouped("frac_raw_odirect", "fraction", "throughput_fraction.png",
            "Throughput as a fraction of raw O_DIRECT write bandwidth", hline=lambda t: 0.9)
    grouped("peak_extra_mem_gb", "GB", "peak_memory.png",
            "Peak extra memory (PSS of the process tree) during a checkpoint")
    grouped("restore_gbps", "GB/s", "restore.png", "Restore throughput (page cache evicted, in place)")

    loops = [c for c in configs if (c.get("loop") or {}).get("runs")]
    if loops or (trainer and trainer.get("runs")):
        n = len(loops) + (1 if trainer and trainer.get("runs") else 0)
        fig, axes = plt.subplots(1, n, figsize=(6.5 * n, 4.2), squeeze=False)
        for ax, c in zip(axes[0], loops):
            loop = c["loop"]
            base = loop["baseline_s"]
            ks = sorted({r["k"] for r in loop["runs"]})
            syss = [s for s in ORDER if any(r["system"] == s and "total_s" in r for r in loop["runs"])]
            w = 0.8 / max(1, len(syss))
            for i, s in enumerate(syss):
                xs, ys = [], []
                for j, k in enumerate(ks):
                    r = next((r for r in loop["runs"] if r["system"] == s and r["k"] == k and "total_s" in r), None)
                    if r:
                        xs.append(j + (i - (len(syss) - 1) / 2) * w)
                        ys.append(r["total_s"] / base)
                ax.bar(xs, ys, w, label=LABELS[s], color=colors[s])
            ax.axhline(1.0, color="k", linestyle="--", linewidth=1)
            ax.set_xticks(range(len(ks)))
            ax.set_xticklabels([f"ckpt every {k}" for k in ks])
            ax.set_ylabel("time / time without checkpoints")
            ax.set_title(f"{loop['iters']}-iteration loop, {c_tag_label(c)}")
            ax.legend(fontsize=7)
        if trainer and trainer.get("runs"):
            ax = axes[0][-1]
            base = trainer.get("baseline_s")
            runs = [r for r in trainer["runs"] if r.get("total_s")]
            ax.bar(range(len(runs)), [r["total_s"] / base for r in runs])
            ax.axhline(1.0, color="k", linestyle="--", linewidth=1)
            ax.set_xticks(range(len(runs)))
            ax.set_xticklabels([r["name"] for r in runs], rotation=30, ha="right", fontsize=7)
            ax.set_ylabel("time / time without checkpoints")
            ax.set_title("pretrain_gpt.py " + trainer.get("short", ""))
        fig.tight_layout()
        p = os.path.join(figdir, "end_to_end.png")
        fig.savefig(p, dpi=110)
        plt.close(fig)
        made.append(p)
    return made


def c_tag_label(c):
    return f"{c['state_bytes'] / 1e9:.2f} GB × {c['ranks']}r"
