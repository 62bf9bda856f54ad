"""The Markdown tables of a benchmark run: side by side, loop and trainer, memory, targets and the reasons a
target is missed."""
from __future__ import annotations

from labels import LABELS, ORDER


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


def _floor_note(loop: dict) -> str:
    f = loop.get("floor_inputs")
    return "" if not f else (f"; per checkpoint a plain copy of the state takes {f['copy_s']:.3f} s and a plain "
                             f"write of it {f['write_s']:.3f} s, which set each run's floor (`worker.loop_floor`)")


def _loop_cell(r: dict, base: float) -> str:
    """A loop run: its time against the loop without checkpoints and against its floor, and where it was held
    (runs from before the floor was measured show their blocked seconds alone)."""
    if "floor_s" not in r:
        return f"{r['total_s']:.2f} ({r['total_s'] / base:.2f}×), {r['blocked_s']:.2f}"
    return (f"{r['total_s']:.2f} ({r['total_s'] / base:.2f}×, {r['total_s'] / r['floor_s']:.2f}×), "
            f"{r['fence_s']:.2f} / {r['call_s']:.2f} / {r['wait_s']:.2f} / {r['drain_s']:.2f}")


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
                     f"whole state; no checkpoint: {base:.2f} s" + _floor_note(loop) + "\n")
        lines.append("| system | " + " | ".join(f"every {k}: time s (× no-ckpt, × floor), held s: fence / call / "
                                                 f"wait for the last / drain" for k in ks) + " |")
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
                    cells.append(_loop_cell(r, base))
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
