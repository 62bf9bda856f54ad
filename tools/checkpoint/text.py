"""inspect_checkpoint's text output, and the progress bar the tools show while they read."""
from __future__ import annotations

import logging
import os
import sys
import time

from datastates import Box, box_str

log = logging.getLogger("tools.checkpoint")


def human(n: int | float) -> str:
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


class _NoProgress:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def progress(total: int, desc: str):
    """tqdm's bar (off when not a terminal) when the `tools` extra is installed; without tqdm, no bar."""
    try:
        from tqdm import tqdm
    except ImportError:
        log.info("%s: no progress bar (tqdm is not installed: pip install -e '.[tools]')", desc)
        return _NoProgress()
    return tqdm(total=total, unit="B", unit_scale=True, desc=desc, disable=None)


def print_iteration(rep: dict, out=None) -> None:
    w = (out or sys.stdout).write
    state = "published" if rep["published"] else "NOT PUBLISHED"
    created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(rep["created_unix"])) if rep["created_unix"] else "-"
    w(f"checkpoint {rep['path']}\n  iteration {rep['iteration']}, {state}, world size {rep['world_size']}, "
      f"{human(rep['bytes'])} of data{_compressed(rep['bytes'], rep['raw_bytes'], rep['ranks'])}, created "
      f"{created}\n")
    w("ranks:\n")
    for r in rep["ranks"]:
        w(f"  rank {r['rank']}: {os.path.basename(r['data_file'])} {human(r['data_bytes'])}"
          f"{_compressed(r['data_bytes'], r['raw_bytes'], [r])}{' (O_DIRECT)' if r['direct_io'] else ''}; {r['tensors_written']} tensors and {r['objects_written']} "
          f"objects written, {r['replicas_not_written']} replicas held but written by another rank\n")
    _print_optimizer(rep.get("optimizer"), w)
    _print_experts(rep.get("experts"), w)
    _print_tensors(rep, w)
    _print_objects(rep["objects"], w)
    if "verify" in rep:
        v = rep["verify"]
        w(f"verify: read {human(v['bytes_read'])} in {v['chunks']} checksummed chunks in {v['seconds']:.2f} s "
          f"({v['bytes_read'] / max(v['seconds'], 1e-9) / 1e9:.2f} GB/s)\n")


def _compressed(stored: int, raw: int, ranks: list[dict]) -> str:
    """The raw size and codec of compressed data files (`--ckpt-compress`); nothing for raw ones."""
    codecs = sorted({c for r in ranks for c in r["codecs"]})
    return f" ({human(raw)} raw, {', '.join(codecs)}: {raw / max(stored, 1):.2f}x)" if codecs else ""


def _kinds(by_kind: dict) -> str:
    return ", ".join(f"{k} {human(n)}" for k, n in sorted(by_kind.items()))


def _print_optimizer(opt: dict | None, w) -> None:
    if not opt:
        return
    where = (f"{opt['domains']} domain(s), {opt['buckets']} bucket(s)" if "domains" in opt
             else f"{opt['parameters']} parameters")
    w(f"optimizer state: {opt['layout']}; {where}; {_kinds(opt['bytes_by_kind'])}\n")
    chain = opt.get("chain")
    if chain:
        w(f"chained optimizer: {chain['parts']} parts\n")
        for part, by_kind in chain["bytes_by_part"].items():
            w(f"  {part}: {_kinds(by_kind)}\n")


def _print_experts(experts: dict | None, w) -> None:
    if not experts:
        return
    w(f"experts: {experts['experts']} per MoE layer, {experts['moe_layers']} MoE layer(s), expert parallel "
      f"{experts['expert_parallel']}; {experts['tensors']} expert tensors, {human(experts['bytes'])}\n")
    for block in experts["placement"]:
        lo, hi = block["experts"]
        w(f"  experts {lo}..{hi - 1}: written by rank(s) {block['written_by']}, held by rank(s) "
          f"{block['held_by']}\n")


def _print_tensors(rep: dict, w) -> None:
    w(f"tensors ({len(rep['tensors'])} global):\n")
    for name, t in rep["tensors"].items():
        w(f"  {name}  {t['dtype']} {tuple(t['global_shape'])}  {human(t['nbytes'])}\n")
        for s in t["shards"]:
            how = "written" if s["write"] else "replica, not written here"
            w(f"      {box_str(Box(s['offset'], s['shape']))}  rank {s['rank']}  {how}\n")
    if rep["local_tensors"]:
        w(f"rank-local tensors ({len(rep['local_tensors'])}):\n")
        for t in rep["local_tensors"]:
            w(f"  rank {t['rank']}  {t['id']}  {t['dtype']} {tuple(t['shape'])}  {human(t['nbytes'])}\n")


def _print_objects(objs: dict, w) -> None:
    w(f"objects ({len(objs['global'])} global, {len(objs['local'])} rank-local):\n")
    for name, where in sorted(objs["global"].items()):
        ws = ", ".join(f"rank {x['rank']}{'' if x['write'] else ' (not written)'}" for x in where)
        w(f"  {name}  {human(max(x['nbytes'] for x in where))}  {ws}\n")
    for o in objs["local"]:
        w(f"  rank {o['rank']}  {o['id']}  {human(o['nbytes'])}\n")


def print_root(rep: dict, out=None) -> None:
    w = (out or sys.stdout).write
    w(f"save root {rep['root']}\n  tracker: {rep['tracker']!r}, latest published iteration: {rep['latest']}\n")
    if not rep["entries"]:
        w("  (no checkpoints)\n")
    for e in rep["entries"]:
        extra = ""
        if e.get("state") == "published":
            extra = f"  world size {e.get('world_size')}, {human(e.get('bytes') or 0)}"
        elif "ranks_done" in e:
            extra = f"  ranks with a manifest: {e['ranks_done']}"
        w(f"  {e['name']:<28} {e['state']}{extra}{'  <- latest' if e.get('latest') else ''}\n")
