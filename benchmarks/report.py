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

from figures import plot_mem, plots
from labels import ASYNC_PEERS, ORDER, PEERS
from tables import loop_md, mem_md, ratios_md, raw_read_gbps, table_md, why_md


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
            "writers included) above its level right before the save, sampled every 20 ms or, where reading it "
            "takes longer (about 10 ms a GB), with at most a tenth of a core, so that the sampling does not take "
            "the CPU the saves measured need. *Restore*: page "
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
        # measured by run_all.py and memory_tier.py beside the tree before a change (snapshot.md), run_all.py with a
        # staging below the state (staging.md), elastic.py's rendezvous (rendezvous.md), object_store.py,
        # compression.py, hf_export.py, trainer_e2e.py's FSDP2 rows (fsdp2.md), rl_weights.py (rl_weights.md) and
        # on a GPU machine by scripts/gpu_check.sh (gpu_figures.py --markdown), not by run_all.py: their sections are
        # kept beside this script
        for kept in ("snapshot.md", "staging.md", "rendezvous.md", "object_store.md", "compression.md",
                     "hf_export.md", "fsdp2.md", "rl_weights.md", "gpu.md"):
            path = os.path.join(os.path.dirname(os.path.abspath(__file__)), kept)
            if os.path.exists(path):
                with open(path) as f:
                    doc += ["", f.read()]
        with open(results_md, "w") as f:
            f.write("\n".join(doc) + "\n")
    return rs, rat


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench_out")
    ap.add_argument("--results-dir", default=None, help="where PNGs go (default <out>/figures)")
    ap.add_argument("--results-md", default=None)
    a = ap.parse_args(argv)
    render(a.out, a.results_dir, a.results_md)


if __name__ == "__main__":
    main()
