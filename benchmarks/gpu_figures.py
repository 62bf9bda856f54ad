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
        snap = _median(rec, "engine_snapshot_s")
        if snap:
            out["systems"][name]["snapshot_gbps"] = side["state_bytes"] / snap / 1e9
    loop = side.get("loop") or {}
    base = loop.get("baseline_s")
    for run in loop.get("runs", []):
        if base and run.get("total_s") and run["system"] in out["systems"]:
            out["systems"][run["system"]]["loop_ratio"] = run["total_s"] / base
    out["loop"] = {"iters": loop.get("iters"), "compute_s": loop.get("compute_s"), "baseline_s": base}
    out["state_bytes"] = side.get("state_bytes")
    lazy_large = large.get("save", {}).get("engine_lazy")
    if lazy_large:
        snap = _median(lazy_large, "engine_snapshot_s")
        out["large"] = {"state_bytes": large["state_bytes"], "blocking_s": _median(lazy_large, "blocking_s"),
                        "durable_s": _median(lazy_large, "durable_s"),
                        "snapshot_gbps": large["state_bytes"] / snap / 1e9 if snap else None,
                        "restored_bit_exact": large.get("restore", {}).get("engine_lazy", {}).get("verified")}
    return out


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
             f", snapshot {large['snapshot_gbps'] or 0:.1f} GB/s"]
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
    with open(a.json, "w") as f:
        json.dump(fig, f, indent=1)
    print(("SUMMARY PASS " if ok else "SUMMARY FAIL ") + line)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
