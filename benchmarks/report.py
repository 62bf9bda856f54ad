"""Turns <out>/raw/*.json (+ probes, + trainer runs) into results.csv/json, a printed table, PNGs and RESULTS.md.

Usable on its own to re-render an earlier run: python benchmarks/report.py --out bench_out/ [--results-dir D]
"""
from __future__ import annotations

import argparse
import csv
import glob
import json
import os
import platform

LABELS = {
    "torch_save": "torch.save (sync)",
    "torch_dist_sync": "mcore torch_dist (sync)",
    "torch_dist_async": "mcore torch_dist (async)",
    "dcp_sync": "DCP save (sync)",
    "dcp_async": "DCP async_save (staged)",
    "engine_sync": "this engine (sync)",
    "engine_lazy": "this engine (lazy async)",
}
ORDER = list(LABELS)
ASYNC_PEERS = ("torch_dist_async", "dcp_async")
PEERS = ("torch_save", "torch_dist_sync", "torch_dist_async", "dcp_sync", "dcp_async")


def load(out):
    configs = []
    for p in sorted(glob.glob(os.path.join(out, "raw", "*.json"))):
        with open(p) as f:
            configs.append(json.load(f))
    configs.sort(key=lambda c: (c["ranks"], c["size_gb"]))
    probes = {}
    pp = os.path.join(out, "probes.json")
    if os.path.exists(pp):
        with open(pp) as f:
            probes = json.load(f)
    meta = {}
    mp = os.path.join(out, "meta.json")
    if os.path.exists(mp):
        with open(mp) as f:
            meta = json.load(f)
    trainer = None
    tp = os.path.join(out, "trainer.json")
    if os.path.exists(tp):
        with open(tp) as f:
            trainer = json.load(f)
    return configs, probes, meta, trainer


def load_mem(out):
    res = []
    for p in sorted(glob.glob(os.path.join(out, "mem", "*.json"))):
        with open(p) as f:
            res.append(json.load(f))
    res.sort(key=lambda r: ORDER.index(r["system"]) if r["system"] in ORDER else 99)
    return res


def mem_md(mem):
    if not mem:
        return ""
    lines = [f"\n### Peak memory of a fresh process tree: state {mem[0]['state_bytes'] / 1e9:.2f} GB, setup + 3 "
             "checkpoints, each followed by an in-place update of the whole state\n",
             "| system | peak extra GB (PSS above the state-only baseline) | × state size | engine peak staging GB |",
             "|---|---|---|---|"]
    for r in mem:
        if "error" in r:
            lines.append(f"| {LABELS.get(r['system'], r['system'])} | failed: {r['error'][:80]} | | |")
            continue
        st = r.get("engine_peak_staging_bytes")
        lines.append(f"| {LABELS.get(r['system'], r['system'])} | {r['peak_extra_bytes'] / 1e9:.2f} | "
                     f"{r['peak_extra_bytes'] / r['state_bytes']:.2f} | {fmt(st / 1e9 if st else None, 2)} |")
    return "\n".join(lines)


def _raw_read_label(name: str) -> str:
    how = name.removeprefix("raw_read_")
    return "one buffered stream" if how == "stream" else f"O_DIRECT, {how[:-1]} thread(s)"


def raw_read_gbps(c, pr):
    """The read yardstick: each rank's raw read of its own engine data file in the restore rotation (the best of
    O_DIRECT from 1, 4 and 8 threads and one buffered stream); without it, the probe's read of a fresh file."""
    raw = c.get("restore_raw") or {}
    disk = c["save"].get("engine_lazy", {}).get("bytes_on_disk")
    if raw and disk:
        return disk / 1e9 / min(r["seconds"] for r in raw.values())
    return pr.get("raw_read_gbps")


def rows(configs, probes):
    out = []
    for c in configs:
        pr = probes.get(c["tag"], {})
        raw = pr.get("raw_odirect_gbps")
        gb = c["state_bytes"] / 1e9
        for name in ORDER:
            s = c["save"].get(name)
            if s is None:
                if name in c.get("errors", {}):
                    out.append({"tag": c["tag"], "size_gb": round(gb, 3), "ranks": c["ranks"], "system": name,
                                "error": c["errors"][name]})
                continue
            r = c["restore"].get(name, {})
            dur = s["durable_s"]["median"]
            row = {
                "tag": c["tag"], "size_gb": round(gb, 3), "ranks": c["ranks"], "system": name,
                "call_s": s["call_s"]["median"],
                "blocking_s": s["blocking_s"]["median"],
                "blocking_min_s": s["blocking_s"]["min"], "blocking_max_s": s["blocking_s"]["max"],
                "durable_s": dur, "durable_min_s": s["durable_s"]["min"], "durable_max_s": s["durable_s"]["max"],
                "gbps": gb / dur,
                "frac_raw_odirect": (gb / dur / raw) if raw else None,
                "peak_extra_mem_gb": s["peak_extra_mem"]["median"] / 1e9,
                "peak_extra_mem_max_gb": s["peak_extra_mem"]["max"] / 1e9,
                "restore_s": r.get("seconds"),
                "restore_min_s": r.get("min", r.get("seconds")), "restore_max_s": r.get("max", r.get("seconds")),
                "restore_gbps": (gb / r["seconds"]) if r.get("seconds") else None,
                "restore_frac_raw_read": (gb / r["seconds"] / raw_read_gbps(c, pr))
                if r.get("seconds") and raw_read_gbps(c, pr) else None,
                "restore_verified": r.get("verified"),
                "reps": len(s["durable_s"]["samples"]),
                "bytes_on_disk": s.get("bytes_on_disk"),
            }
            for k in ("engine_peak_staging_bytes", "engine_snapshot_s", "engine_blocking_s"):
                if k in s:
                    row[k] = s[k]["max"] if k.endswith("bytes") else s[k]["median"]
            out.append(row)
    return out


def ratios(configs, probes, trainer, engine_budget_bytes):
    """The targets of the issue, as ratios reached (never asserted)."""
    res = []
    for c in configs:
        s = c["save"]
        if "engine_lazy" not in s:
            continue
        lazy_b = s["engine_lazy"]["blocking_s"]["median"]
        lazy_call = s["engine_lazy"]["call_s"]["median"]
        e = {"tag": c["tag"], "size_gb": round(c["state_bytes"] / 1e9, 3), "ranks": c["ranks"]}
        if "torch_dist_sync" in s:
            e["blocking_vs_torch_dist_sync"] = s["torch_dist_sync"]["blocking_s"]["median"] / lazy_b
            e["call_vs_torch_dist_sync"] = s["torch_dist_sync"]["blocking_s"]["median"] / max(lazy_call, 1e-9)
        peers = {p: s[p]["blocking_s"]["median"] for p in ASYNC_PEERS if p in s}
        if peers:
            best = min(peers, key=peers.get)
            e["best_async_peer"] = best
            e["blocking_vs_best_async_peer"] = peers[best] / lazy_b
            e["call_vs_best_async_peer"] = peers[best] / max(lazy_call, 1e-9)
        raw = probes.get(c["tag"], {}).get("raw_odirect_gbps")
        if raw:
            gb = c["state_bytes"] / 1e9
            e["lazy_frac_raw_odirect"] = gb / s["engine_lazy"]["durable_s"]["median"] / raw
            if "engine_sync" in s:
                e["sync_frac_raw_odirect"] = gb / s["engine_sync"]["durable_s"]["median"] / raw
        rs = {n: r["seconds"] for n, r in c["restore"].items() if r.get("seconds") and r.get("verified")}
        if "engine_lazy" in rs:
            peers = {p: v for p, v in rs.items() if p in PEERS}
            if peers:
                best = min(peers, key=peers.get)
                e["restore_best_peer"] = best
                e["restore_vs_best_peer"] = peers[best] / rs["engine_lazy"]
            read = raw_read_gbps(c, probes.get(c["tag"], {}))
            if read:
                e["restore_frac_raw_read"] = c["state_bytes"] / 1e9 / rs["engine_lazy"] / read
        st = s["engine_lazy"].get("engine_peak_staging_bytes")
        if st:
            e["peak_staging_gb"] = st["max"] / 1e9
            e["staging_budget_gb"] = engine_budget_bytes / 1e9
            e["staging_within_budget"] = st["max"] <= engine_budget_bytes
        loop = c.get("loop") or {}
        if loop.get("runs"):
            base = loop["baseline_s"]
            for k in sorted({r["k"] for r in loop["runs"]}):
                ov = {r["system"]: r["total_s"] - base for r in loop["runs"] if r["k"] == k and "total_s" in r}
                if "engine_lazy" in ov:
                    pe = {p: v for p, v in ov.items() if p in PEERS}
                    if pe:
                        bp = min(pe, key=pe.get)
                        e[f"loop_k{k}_overhead_s"] = ov["engine_lazy"]
                        e[f"loop_k{k}_best_peer"] = bp
                        e[f"loop_k{k}_best_peer_overhead_s"] = pe[bp]
                        e[f"loop_k{k}_overhead_ratio"] = ov["engine_lazy"] / pe[bp] if pe[bp] > 0 else None
        res.append(e)
    if trainer and trainer.get("runs"):
        t = {"tag": "trainer"}
        ov = {r["name"]: r["total_s"] - r.get("baseline_s", trainer.get("baseline_s"))
              for r in trainer["runs"] if r.get("total_s") and r.get("baseline_s", trainer.get("baseline_s"))}
        lazy = [n for n in ov if n.startswith("datastates") and "async" in n]
        peers = [n for n in ov if not n.startswith("datastates") and ":" not in n]  # the fp32 group's peers
        if lazy and peers:
            bp = min(peers, key=ov.get)
            t.update({"trainer_overhead_s": ov[lazy[0]], "trainer_best_peer": bp,
                      "trainer_best_peer_overhead_s": ov[bp],
                      "trainer_overhead_ratio": ov[lazy[0]] / ov[bp] if ov[bp] > 0 else None})
            res.append(t)
    return res


def fmt(v, nd=3):
    if v is None:
        return "—"
    if isinstance(v, bool):
        return "yes" if v else "NO"
    if isinstance(v, float):
        return f"{v:.{nd}f}"
    return str(v)


def table_md(rs, probes, configs):
    lines = []
    for c in configs:
        gb = c["state_bytes"] / 1e9
        pr = probes.get(c["tag"], {})
        lines.append(f"\n### {gb:.2f} GB state, {c['ranks']} rank(s)  (`{c['tag']}`)\n")
        if pr:
            def g(k):
                return f"{pr[k]['gbps']:.2f} GB/s" if k in pr else "—"
            lines.append(f"Limits measured in the same run: O_DIRECT write {g('odirect_1t')} (1 thread), "
                         f"{g('odirect_4t')} (4 threads); buffered+fsync {g('buffered_fsync')}; O_DIRECT read "
                         f"{g('read_odirect_1t')} (1 thread), {g('read_odirect_4t')} (4 threads); "
                         f"memcpy {g('memcpy')}.")
            raw = c.get("restore_raw") or {}
            if raw:
                disk = c["save"].get("engine_lazy", {}).get("bytes_on_disk") or c["state_bytes"]
                lines.append("Raw read in the restore rotation (each rank reads its own engine data file, page cache "
                             "evicted; the best is the yardstick of % raw read): " + ", ".join(
                                 f"{disk / 1e9 / r['seconds']:.2f} GB/s ({_raw_read_label(k)})"
                                 for k, r in sorted(raw.items())) + ".")
            lines.append("")
        lines.append("| system | blocking s (min–max) | save() call s | durable s (min–max) | GB/s | % raw O_DIRECT "
                     "| peak extra mem GB | restore s (min–max) | restore GB/s | % raw read | verified |")
        lines.append("|---|---|---|---|---|---|---|---|---|---|---|")
        for r in rs:
            if r["tag"] != c["tag"]:
                continue
            if "error" in r:
                lines.append(f"| {LABELS[r['system']]} | failed: {r['error'][:80]} ||||||||||")
                continue
            frac = f"{100 * r['frac_raw_odirect']:.0f}%" if r["frac_raw_odirect"] else "—"
            read = f"{100 * r['restore_frac_raw_read']:.0f}%" if r["restore_frac_raw_read"] else "—"
            restore = (f"{r['restore_s']:.2f} ({r['restore_min_s']:.2f}–{r['restore_max_s']:.2f})"
                       if r["restore_s"] else "—")
            lines.append(
                f"| {LABELS[r['system']]} | {r['blocking_s']:.3f} ({r['blocking_min_s']:.3f}–{r['blocking_max_s']:.3f})"
                f" | {r['call_s']:.3f} | {r['durable_s']:.2f} ({r['durable_min_s']:.2f}–{r['durable_max_s']:.2f})"
                f" | {r['gbps']:.2f} | {frac} | {r['peak_extra_mem_gb']:.2f} | {restore}"
                f" | {fmt(r['restore_gbps'], 2)} | {read} | {fmt(r['restore_verified'])} |")
    return "\n".join(lines)


def loop_md(configs, trainer):
    lines = []
    for c in configs:
        loop = c.get("loop") or {}
        if not loop.get("runs"):
            continue
        base = loop["baseline_s"]
        ks = sorted({r["k"] for r in loop["runs"]})
        lines.append(f"\n### Compute loop: {c['state_bytes'] / 1e9:.2f} GB state, {c['ranks']} rank(s), "
                     f"{loop['iters']} iterations of ~{loop['compute_s']} s compute + in-place update of the "
                     f"whole state; no checkpoint: {base:.2f} s\n")
        lines.append("| system | " + " | ".join(f"every {k}: time s (× no-ckpt), blocked s" for k in ks) + " |")
        lines.append("|---|" + "---|" * len(ks))
        for name in ORDER:
            cells = []
            for k in ks:
                r = next((r for r in loop["runs"] if r["system"] == name and r["k"] == k), None)
                if r is None:
                    cells.append("—")
                elif "error" in r:
                    cells.append("failed")
                else:
                    cells.append(f"{r['total_s']:.2f} ({r['total_s'] / base:.2f}×), {r['blocked_s']:.2f}")
            if any(x != "—" for x in cells):
                lines.append(f"| {LABELS[name]} | " + " | ".join(cells) + " |")
    if trainer and trainer.get("runs"):
        lines.append(f"\n### Real trainer (`pretrain_gpt.py`): {trainer.get('description', '')}\n")
        lines.append("| run | total s | × no-ckpt | per-checkpoint blocking s (median) |")
        lines.append("|---|---|---|---|")
        for r in trainer["runs"]:
            base = r.get("baseline_s", trainer.get("baseline_s"))
            if r.get("total_s") is None:
                lines.append(f"| {r['name']} | failed: {r.get('error', '')[:80]} | | |")
                continue
            lines.append(f"| {r['name']} | {r['total_s']:.2f} | {fmt(r['total_s'] / base if base else None, 2)} | "
                         f"{fmt(r.get('blocking_median_s'))} |")
    return "\n".join(lines)


def ratios_md(rat):
    if not rat:
        return "\n(no engine results in this run, so no target ratios)\n"
    lines = ["| config | target | reached | met? |", "|---|---|---|---|"]
    for e in rat:
        cfg = f"{e['size_gb']:.2f} GB × {e['ranks']}" if "size_gb" in e else e["tag"]

        def add(target, val, ok):
            lines.append(f"| {cfg} | {target} | {val} | {fmt(ok)} |")

        if "blocking_vs_torch_dist_sync" in e:
            v = e["blocking_vs_torch_dist_sync"]
            add("blocking ≤ 1/20 of torch_dist sync (save+immediate fence)", f"1/{v:.1f}", v >= 20)
            v2 = e["call_vs_torch_dist_sync"]
            add("… save() call alone (fence overlapped with compute)", f"1/{v2:.1f}", v2 >= 20)
        if "blocking_vs_best_async_peer" in e:
            v = e["blocking_vs_best_async_peer"]
            add(f"blocking ≤ 1/4 of best async peer ({LABELS[e['best_async_peer']]})", f"1/{v:.1f}", v >= 4)
            v2 = e["call_vs_best_async_peer"]
            add("… save() call alone", f"1/{v2:.1f}", v2 >= 4)
        if "lazy_frac_raw_odirect" in e:
            add("throughput ≥ 90% of raw O_DIRECT (lazy)", f"{100 * e['lazy_frac_raw_odirect']:.0f}%",
                e["lazy_frac_raw_odirect"] >= 0.9)
        if "sync_frac_raw_odirect" in e:
            add("… synchronous mode", f"{100 * e['sync_frac_raw_odirect']:.0f}%", e["sync_frac_raw_odirect"] >= 0.9)
        if "restore_vs_best_peer" in e:
            v = e["restore_vs_best_peer"]
            add(f"restore ahead of the best peer ({LABELS[e['restore_best_peer']]}), every byte verified",
                f"{v:.2f}× its speed", v >= 1)
        if "restore_frac_raw_read" in e:
            add("restore ≥ 80% of raw read", f"{100 * e['restore_frac_raw_read']:.0f}%",
                e["restore_frac_raw_read"] >= 0.8)
        if "staging_within_budget" in e:
            add("peak staging ≤ budget", f"{e['peak_staging_gb']:.2f} / {e['staging_budget_gb']:.2f} GB",
                e["staging_within_budget"])
        for k in (1, 2, 3, 4, 5, 8, 10):
            if f"loop_k{k}_overhead_ratio" in e and e[f"loop_k{k}_overhead_ratio"] is None:
                lines.append(f"| {cfg} | loop overhead (ckpt every {k}) ≤ ½ best peer's "
                             f"({LABELS[e[f'loop_k{k}_best_peer']]}) | {e[f'loop_k{k}_overhead_s']:.2f} s vs "
                             f"{e[f'loop_k{k}_best_peer_overhead_s']:.2f} s: the peer's overhead is within the noise "
                             "of the no-checkpoint runs | n/a |")
            if f"loop_k{k}_overhead_ratio" in e and e[f"loop_k{k}_overhead_ratio"] is not None:
                v = e[f"loop_k{k}_overhead_ratio"]
                add(f"loop overhead (ckpt every {k}) ≤ ½ best peer's ({LABELS[e[f'loop_k{k}_best_peer']]})",
                    f"{e[f'loop_k{k}_overhead_s']:.2f} s vs {e[f'loop_k{k}_best_peer_overhead_s']:.2f} s = {v:.2f}",
                    v <= 0.5)
        if "trainer_overhead_ratio" in e and e["trainer_overhead_ratio"] is not None:
            v = e["trainer_overhead_ratio"]
            add(f"trainer overhead ≤ ½ best peer's ({e['trainer_best_peer']})",
                f"{e['trainer_overhead_s']:.2f} s vs {e['trainer_best_peer_overhead_s']:.2f} s = {v:.2f}", v <= 0.5)
    return "\n".join(lines)


def why_md(configs, probes, rat):
    """For each missed target, the measured numbers that explain it (generated, so it never goes stale)."""
    out = []
    for c, e in ((c, next((e for e in rat if e.get("tag") == c["tag"]), None)) for c in configs):
        if not e:
            continue
        s = c["save"]
        lz = s.get("engine_lazy", {})
        gb = c["state_bytes"] / 1e9
        pr = probes.get(c["tag"], {})
        mc = pr.get("memcpy", {}).get("gbps")
        raw = pr.get("raw_odirect_gbps")
        head = f"- **{gb:.2f} GB × {c['ranks']}**: "
        notes = []
        snap = lz.get("engine_snapshot_s", {}).get("median")
        if e.get("blocking_vs_torch_dist_sync", 99) < 20 or e.get("blocking_vs_best_async_peer", 99) < 4:
            t = (f"the immediate fence waits for the whole snapshot copy ({gb:.2f} GB in "
                 f"{snap:.3f} s = {gb / snap:.2f} GB/s" if snap else "the immediate fence waits for the whole copy")
            t += f"; memcpy here: {mc:.2f} GB/s)" if (snap and mc) else (")" if snap else "")
            t += (f". In a loop the fence comes after the next forward/backward, so the stall is the save() call: "
                  f"{lz['call_s']['median'] * 1e3:.1f} ms")
            if "torch_dist_async" in s:
                t += (f". megatron-core async copies nothing on CPU (fork + copy-on-write): its "
                      f"{s['torch_dist_async']['blocking_s']['median']:.3f} s stall is the fork, and its cost reappears "
                      "as page faults in the loop (see the loop table)")
            notes.append(t)
        if raw and e.get("lazy_frac_raw_odirect", 1) < 0.9:
            dur = lz["durable_s"]["median"]
            t = (f"durable in {dur:.2f} s = {gb / dur:.2f} GB/s vs raw O_DIRECT {raw:.2f} GB/s "
                 f"({gb / raw:.2f} s for the bytes alone)")
            if snap:
                t += (f"; copy ({snap:.2f} s) and writes overlap only partly on 2 cores shared by the copy thread, "
                      f"{c['ranks']} rank(s), the writer threads and neighbours' jobs")
            notes.append(t)
        ours = c["restore"].get("engine_lazy", {})
        if ours.get("seconds") and (e.get("restore_vs_best_peer", 1) < 1 or e.get("restore_frac_raw_read", 1) < 0.8):
            t = f"restore {ours['seconds']:.2f} s ({ours.get('min', 0):.2f}–{ours.get('max', 0):.2f})"
            best = c["restore"].get(e.get("restore_best_peer"), {})
            if e.get("restore_vs_best_peer", 1) < 1:
                t += (f" vs {LABELS[e['restore_best_peer']]} {best['seconds']:.2f} s "
                      f"({best.get('min', 0):.2f}–{best.get('max', 0):.2f})")
            if raw_read_gbps(c, pr):
                t += f"; the bytes alone at the raw read rate: {gb / raw_read_gbps(c, pr):.2f} s"
            notes.append(t)
        if notes:
            out.append(head + "; ".join(notes) + ".")
    return "\n".join(out)


# ------------------------------------------------------------------------------------------------ plots
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


def render(out, results_dir=None, results_md=None, command=None):
    configs, probes, meta, trainer = load(out)
    rs = rows(configs, probes)
    rat = ratios(configs, probes, trainer, meta.get("engine_buffer_bytes", 4 << 30))
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump({"meta": meta, "probes": probes, "rows": rs, "ratios": rat, "trainer": trainer}, f, indent=1)
    keys = sorted({k for r in rs for k in r}, key=lambda k: (k not in ("tag", "size_gb", "ranks", "system"), k))
    with open(os.path.join(out, "results.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        for r in rs:
            w.writerow(r)
    figdir = results_dir or os.path.join(out, "figures")
    mem = load_mem(out)
    made = plots(rs, configs, probes, trainer, figdir) + plot_mem(mem, figdir)
    for e in rat:  # the staging budget check also from the fresh-process memory phase
        m = next((r for r in mem if r["system"] == "engine_lazy" and r.get("engine_peak_staging_bytes")), None)
        if m and "peak_staging_gb" not in e and e.get("size_gb") == round(m["state_bytes"] / 1e9, 3):
            e["peak_staging_gb"] = m["engine_peak_staging_bytes"] / 1e9
            e["staging_budget_gb"] = meta.get("engine_buffer_bytes", 4 << 30) / 1e9
            e["staging_within_budget"] = m["engine_peak_staging_bytes"] <= meta.get("engine_buffer_bytes", 4 << 30)
    tbl, lp, rt = table_md(rs, probes, configs), loop_md(configs, trainer) + mem_md(mem), ratios_md(rat)
    print(tbl)
    print(lp)
    print("\nTargets (ratios reached; benchmarks never fail on time):")
    print(rt)
    if results_md:
        rel = os.path.relpath(figdir, os.path.dirname(os.path.abspath(results_md)))
        m = meta
        doc = [
            "# Checkpointing benchmark results",
            "",
            "Generated by `benchmarks/report.py` from one run of "
            f"`{command or m.get('command', 'python benchmarks/run_all.py')}`.",
            "",
            f"- Machine: {m.get('machine', platform.platform())}",
            f"- Checkpoint directory: `{m.get('ckpt_dir', '?')}` ({m.get('fs', '?')}); date {m.get('date', '?')}",
            f"- torch {m.get('torch', '?')}, megatron-core {m.get('mcore', '?')}; engine staging budget "
            f"{m.get('engine_buffer_bytes', 0) / 2**30:.1f} GiB per rank, {m.get('engine_writer_threads', '?')} "
            f"writer threads, {m.get('engine_read_threads', '?')} read threads",
            f"- {m.get('reps_note', '')}",
            "",
            "Definitions. *Blocking*: how long the training loop is stalled per checkpoint: for synchronous "
            "systems the whole save; for megatron-core async the `save()` plus scheduling (fork); for DCP "
            "`async_save` the call plus waiting for its staging future; for this engine `save()` plus an "
            "*immediate* `wait_for_snapshot()` (an upper bound: in a training loop the fence comes after the "
            "next forward/backward and is usually free; the `save() call` column is the lower bound). "
            "*Durable*: from the save call until every rank's files are fsynced (the harness fsyncs every file "
            "of every system's checkpoint afterwards, so the word means the same for all) and all ranks are done. "
            "GB/s = state bytes / durable time. *Peak extra memory*: peak PSS of the process tree (forked "
            "writers included) above its level right before the save, sampled every 20 ms. *Restore*: page "
            "cache of every system's checkpoint files evicted (POSIX_FADV_DONTNEED), loaded in place into a zeroed state "
            "(this engine verifies every chunk's crc32c as it reads), then checked against checksums outside the "
            "timing; median (min–max) of the restore rounds, systems interleaved. *% raw read*: restore GB/s "
            "over the best raw read (O_DIRECT from 1, 4 or 8 threads per rank, or one buffered stream) of the engine's own data files, taken in the "
            "same rotation as the loads (a fresh probe file can still sit in a cache below the VM). Noisy shared machine: compare ratios within one table, not "
            "absolute times across runs.",
            "",
            "## Side by side",
            tbl,
            "",
            "## End to end and memory",
            lp or "\n(no loop in this run)",
            "",
            "## Targets",
            "",
            rt,
            "",
            "## Where a target is missed, the measured reasons",
            "",
            why_md(configs, probes, rat) or "(none missed)",
            "",
            "## Figures",
            "",
        ]
        for p in made:
            doc.append(f"![{os.path.basename(p)}]({os.path.join(rel, os.path.basename(p))})")
            doc.append("")
        notes = os.path.join(out, "notes.md")
        if os.path.exists(notes):
            with open(notes) as f:
                doc += ["## Notes", "", f.read()]
        with open(results_md, "w") as f:
            f.write("\n".join(doc) + "\n")
    return rs, rat


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench_out")
    ap.add_argument("--results-dir", default=None, help="where PNGs go (default <out>/figures)")
    ap.add_argument("--results-md", default=None)
    a = ap.parse_args()
    render(a.out, a.results_dir, a.results_md)


if __name__ == "__main__":
    main()
