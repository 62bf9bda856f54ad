"""The GPU check's part (c) in one line and one JSON, from two `run_all.py --device cuda` runs' raw results.

    python benchmarks/gpu_figures.py SIDE_BY_SIDE_OUT LARGE_OUT --json FIGURES.json
    python benchmarks/gpu_figures.py --markdown OUT/figures.json > benchmarks/gpu.md   (the check's whole figures.json)

SIDE_BY_SIDE_OUT: every system on the 1 GB state, with the loop; LARGE_OUT: this engine alone on the large state.
Prints `SUMMARY PASS ...` when both engine modes saved, the lazy engine's checkpoints of both states loaded back
bit for bit and its loop ran; else `SUMMARY FAIL ...` naming what is missing. Never fails on time.
`--markdown` renders a GPU check's figures.json as one card's part of the GPU section of benchmarks/RESULTS.md
(benchmarks/gpu.md, which report.py appends), naming the card, driver and torch of every figure.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys

ENGINE = ("engine_lazy", "engine_sync")


def _raw(out: str) -> dict:
    found = sorted(glob.glob(os.path.join(out, "raw", "*.json")))
    if not found:
        return {}
    with open(found[0]) as f:
        return json.load(f)


def _median(rec: dict, key: str):
    return rec.get(key, {}).get("median")


def figures(side: dict, large: dict) -> dict:
    out = {"d2h_pinned_gbps": side.get("d2h_pinned_gbps") or large.get("d2h_pinned_gbps"), "systems": {},
           "errors": {**side.get("errors", {}), **{f"large {k}": v for k, v in large.get("errors", {}).items()}}}
    for name, rec in side.get("save", {}).items():
        out["systems"][name] = {"blocking_s": _median(rec, "blocking_s"), "durable_s": _median(rec, "durable_s"),
                                "call_s": _median(rec, "call_s"),
                                "restore_s": side.get("restore", {}).get(name, {}).get("seconds"),
                                "restore_samples": side.get("restore", {}).get(name, {}).get("samples"),
                                "restored_bit_exact": side.get("restore", {}).get(name, {}).get("verified")}
        out["systems"][name].update(_snapshot_figures(rec, side["state_bytes"]))
    loop = side.get("loop") or {}
    base = loop.get("baseline_s")
    for run in loop.get("runs", []):
        if base and run.get("total_s") and run["system"] in out["systems"]:
            out["systems"][run["system"]]["loop_ratio"] = run["total_s"] / base
            if run.get("floor_s"):
                out["systems"][run["system"]]["loop_floor_ratio"] = run["total_s"] / run["floor_s"]
    out["loop"] = {"iters": loop.get("iters"), "compute_s": loop.get("compute_s"), "baseline_s": base,
                   **(loop.get("floor_inputs") or {})}
    out["state_bytes"] = side.get("state_bytes")
    lazy_large = large.get("save", {}).get("engine_lazy")
    if lazy_large:
        out["large"] = {"state_bytes": large["state_bytes"], "blocking_s": _median(lazy_large, "blocking_s"),
                        "durable_s": _median(lazy_large, "durable_s"),
                        "restored_bit_exact": large.get("restore", {}).get("engine_lazy", {}).get("verified"),
                        **_snapshot_figures(lazy_large, large["state_bytes"])}
    return out


def _snapshot_figures(rec: dict, nbytes: int) -> dict:
    """The engine's snapshot GB/s (median, the first timed save's and the later ones'), and its pinned staging
    at each save."""
    samples = rec.get("engine_snapshot_s", {}).get("samples") or []
    if not samples:
        return {}
    gbps = [nbytes / s / 1e9 for s in samples]
    return {"snapshot_gbps": nbytes / _median(rec, "engine_snapshot_s") / 1e9, "snapshot_first_gbps": gbps[0],
            "snapshot_later_gbps": sorted(gbps[1:])[len(gbps[1:]) // 2] if len(gbps) > 1 else None,
            "blocking_samples_s": rec.get("blocking_s", {}).get("samples"),
            "pinned_bytes_samples": rec.get("engine_staging_pinned_bytes", {}).get("samples")}


def targets(fig: dict) -> list[str]:
    """Issue 58's targets, one line each, met or not (figures, never a failure of the check)."""
    d2h, lines = fig.get("d2h_pinned_gbps"), []
    runs = [(f"{fig.get('state_bytes', 0) / 1e9:.0f} GB", fig["systems"].get("engine_lazy", {}), fig.get("state_bytes")),
            (f"{(fig.get('large') or {}).get('state_bytes', 0) / 1e9:.0f} GB", fig.get("large") or {},
             (fig.get("large") or {}).get("state_bytes"))]
    for name, r, nbytes in runs:
        if not (d2h and r.get("snapshot_first_gbps")):
            continue
        snaps = [r["snapshot_first_gbps"]] + ([r["snapshot_later_gbps"]] if r.get("snapshot_later_gbps") else [])
        lines.append(_target(f"{name}: snapshot >= 80% of the plain copy ({d2h:.1f} GB/s), first and later saves",
                             ", ".join(f"{g:.1f} GB/s ({100 * g / d2h:.0f}%)" for g in snaps),
                             min(snaps) >= 0.8 * d2h))
        plain_s = nbytes / d2h / 1e9
        block = r.get("blocking_samples_s") or []
        if block:
            lines.append(_target(f"{name}: blocking <= 1.25x the plain copy's {plain_s:.3f} s",
                                 ", ".join(f"{b:.3f} s" for b in block), max(block) <= 1.25 * plain_s))
        pinned = [p for p in r.get("pinned_bytes_samples") or [] if p is not None]
        if pinned:
            lines.append(_target(f"{name}: pinned staging the same at every save (made at start)",
                                 ", ".join(f"{p / 2**30:.2f} GiB" for p in pinned), len(set(pinned)) == 1))
    lazy = fig["systems"].get("engine_lazy", {})
    if lazy.get("loop_floor_ratio"):
        lines.append(_target("the loop <= 1.05x its floor", f"{lazy['loop_floor_ratio']:.3f}x",
                             lazy["loop_floor_ratio"] <= 1.05))
    return lines


def _target(what: str, measured: str, met: bool) -> str:
    return f"TARGET {what}: {measured}: {'met' if met else 'NOT met'}"


def verdict(fig: dict) -> tuple[bool, str]:
    s = fig["systems"]
    missing = [n for n in ENGINE if n not in s]
    if missing:
        return False, f"no figures for {', '.join(missing)}"
    lazy = s["engine_lazy"]
    if not lazy.get("restored_bit_exact"):
        return False, "the lazy engine's 1 GB checkpoint did not load back bit for bit"
    large = fig.get("large")
    if not large or not large.get("restored_bit_exact"):
        return False, "the large state was not saved and loaded back bit for bit"
    if "loop_ratio" not in lazy:
        return False, "the loop did not run for the lazy engine"
    peers = {n: v for n, v in s.items() if n not in ENGINE}
    best = min((n for n in peers if "loop_ratio" in peers[n]), key=lambda n: peers[n]["loop_ratio"], default=None)
    d2h = fig.get("d2h_pinned_gbps")
    parts = [f"{fig['state_bytes'] / 1e9:.2f} GB: lazy stall {lazy['blocking_s']:.3f} s, durable "
             f"{lazy['durable_s']:.3f} s, snapshot {lazy.get('snapshot_gbps', 0):.1f} GB/s"
             + (f" (device->pinned copy {d2h:.1f} GB/s)" if d2h else ""),
             f"sync engine {s['engine_sync']['blocking_s']:.3f} s",
             "peers' stall " + ", ".join(f"{n} {v['blocking_s']:.3f} s" for n, v in peers.items()),
             f"loop ratio lazy {lazy['loop_ratio']:.2f}"
             + (f", best peer {best} {peers[best]['loop_ratio']:.2f}" if best else ", no peer's loop"),
             f"{large['state_bytes'] / 1e9:.1f} GB: stall {large['blocking_s']:.3f} s, durable {large['durable_s']:.2f} s"
             f", snapshot {large.get('snapshot_gbps') or 0:.1f} GB/s"]
    if fig["errors"]:
        parts.append("failed: " + ", ".join(fig["errors"]))
    return True, "; ".join(parts)


def markdown(check: dict) -> str:
    dev, fig = check.get("device", {}), check.get("c_bench", {})
    card = f"{dev.get('card', '?')} ({dev.get('memory_gib', '?')} GiB), driver {dev.get('driver', '?')}, torch " \
           f"{dev.get('torch', '?')} (CUDA {dev.get('cuda', '?')}), Python {dev.get('python', '?')}, megatron-core " \
           f"{dev.get('megatron_core', '?')}"
    out = [f"### {dev.get('card', '?')}", "",
           f"Measured by `bash scripts/gpu_check.sh` on one {card}. Every figure below is that card's.",
           "", *[f"- {line}" for line in check.get("summary", [])], ""]
    if fig.get("systems"):
        d2h = fig.get("d2h_pinned_gbps")
        out += [f"{(fig.get('state_bytes') or 0) / 1e9:.2f} GB state on the GPU; a plain device-to-pinned-host copy: "
                + (f"{d2h:.1f} GB/s" if d2h else "not measured") + "; the loop: "
                f"{fig['loop'].get('iters')} steps of ~{fig['loop'].get('compute_s')} s of bf16 matrix products, a "
                f"checkpoint every step, against {fig['loop'].get('baseline_s') or 0:.2f} s without.", "",
                "| system | stall s | durable s | restore s | snapshot GB/s | loop ratio |", "|---|---|---|---|---|---|"]

        def cell(v, f="{:.3f}"):
            return f.format(v) if isinstance(v, (int, float)) else "—"
        for name, v in fig["systems"].items():
            out.append(f"| {name} | {cell(v.get('blocking_s'))} | {cell(v.get('durable_s'))} | "
                       f"{cell(v.get('restore_s'))} | {cell(v.get('snapshot_gbps'), '{:.1f}')} | "
                       f"{cell(v.get('loop_ratio'), '{:.2f}')} |")
        large = fig.get("large")
        if large:
            out += ["", f"This engine alone on {large['state_bytes'] / 1e9:.1f} GB (a staging budget that holds it): stall "
                    f"{cell(large.get('blocking_s'))} s, durable {cell(large.get('durable_s'), '{:.2f}')} s, snapshot "
                    f"{cell(large.get('snapshot_gbps'), '{:.1f}')} GB/s."]
        restores = {n: v["restore_samples"] for n, v in fig["systems"].items() if len(v.get("restore_samples") or []) > 1}
        if restores:
            out += ["", "Each restore, in the order they ran (the second round runs the systems in reverse): "
                    + "; ".join(f"{n} " + " / ".join(f"{x:.3f}" for x in v) + " s" for n, v in restores.items()) + "."]
    if fig.get("targets"):
        out += ["", "Issue 58's targets on this card:", "", *[f"- {t[len('TARGET '):]}" for t in fig["targets"]]]
    out += _profile_markdown(check.get("d_snapshot_profile")) + _codecs_markdown(check.get("d_gpu_codecs"))
    return "\n".join(out) + "\n"


def _profile_markdown(prof: dict | None) -> list[str]:
    if not prof or not prof.get("steps"):
        return []
    out = ["", f"Where the snapshot's time goes (`benchmarks/snapshot_profile.py`, {prof['state_bytes'] / 1e9:.1f} GB in "
           f"{prof['tensors']} tensors, slots of {prof.get('slot_bytes', 0) >> 20} MiB):", "",
           "| step | s | GB/s | more |", "|---|---|---|---|"]
    for step, v in prof["steps"].items():
        more = ", ".join(f"{k} {x:.3f}" if isinstance(x, float) else f"{k} {x}" for k, x in v.items()
                         if k not in ("seconds", "gbps"))
        out.append(f"| {step} | {v['seconds']:.3f} | {v['gbps']:.1f} | {more} |")
    return out


def _codecs_markdown(codecs: dict | None) -> list[str]:
    if not codecs or not codecs.get("kinds"):
        return []
    out = ["", f"nvCOMP {codecs.get('nvcomp')} on the trained state of part (b) (`benchmarks/gpu_codecs.py`); a "
           f"plain copy to the host costs {1000 * codecs['plain_s_per_gb']:.1f} ms per raw GB; 'snapshot' is what "
           f"compressing on the device and copying the result would cost:", "",
           "| kind | codec | ratio | compress GB/s | decompress GB/s | snapshot ms/GB |", "|---|---|---|---|---|---|"]
    for kind, rows in codecs["kinds"].items():
        for name, r in sorted(rows.items(), key=lambda kv: -kv[1].get("ratio", 0)):
            if "ratio" in r:
                out.append(f"| {kind} | {name} | {r['ratio']:.3f} | {r['compress_gbps']:.1f} | "
                           f"{r['decompress_gbps']:.1f} | {1000 * r['snapshot_s_per_gb']:.1f} |")
            else:
                out.append(f"| {kind} | {name} | {r.get('error')} | | | |")
    if codecs.get("errors"):
        out += ["", "Not measured: " + "; ".join(f"{k}: {e}" for k, e in codecs["errors"].items())]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("side_by_side", nargs="?")
    ap.add_argument("large", nargs="?")
    ap.add_argument("--json")
    ap.add_argument("--markdown", metavar="FIGURES_JSON", help="print a GPU check's figures as Markdown")
    a = ap.parse_args()
    if a.markdown:
        with open(a.markdown) as f:
            print(markdown(json.load(f)), end="")
        return 0
    if not (a.side_by_side and a.large and a.json):
        ap.error("give SIDE_BY_SIDE_OUT LARGE_OUT --json FIGURES.json, or --markdown FIGURES_JSON")
    fig = figures(_raw(a.side_by_side), _raw(a.large))
    ok, line = verdict(fig)
    fig["targets"] = targets(fig) if ok else []
    with open(a.json, "w") as f:
        json.dump(fig, f, indent=1)
    for target in fig["targets"]:
        print(target)
    print(("SUMMARY PASS " if ok else "SUMMARY FAIL ") + line)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
