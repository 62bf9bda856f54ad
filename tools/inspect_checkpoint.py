#!/usr/bin/env python
"""Inspect (and verify) datastates checkpoints.

    python tools/inspect_checkpoint.py SAVE_ROOT                 # iterations, latest, unpublished leftovers
    python tools/inspect_checkpoint.py SAVE_ROOT --iteration 100 # one iteration of a save root
    python tools/inspect_checkpoint.py SAVE_ROOT/iter_0000100     # ranks, bytes, tensors and their shard layout
    python tools/inspect_checkpoint.py PATH --verify              # read every data byte, check every checksum
    python tools/inspect_checkpoint.py PATH --json                # the same, machine-readable

For an iteration directory it shows the ranks (data bytes, items), every logical (global) tensor with its global
shape and which rank holds which global box (and the replicas a rank holds but does not write), rank-local
tensors, and objects with their sizes.

The structural checks always run: metadata.json present and listing every rank, each manifest intact (its own
crc32c, and the one metadata.json published for it), data files at their recorded size, item extents inside
them, and every global tensor fully covered by written shards. `--verify` also reads every data byte through the
native reader pool (in parallel, a crc32c per checksummed chunk) and compares it with the manifest.

Exit status: 0 when no problem was found; 1 when any problem was found (each printed with the file it concerns,
on stderr, also in the "problems" list of --json); 2 for a path that is not a checkpoint or a usage error.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
import time

if __package__ in (None, ""):  # run as `python tools/inspect_checkpoint.py`: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from datastates import _native, commit  # noqa: E402
from datastates import format as fmt  # noqa: E402
from datastates.errors import CheckpointError  # noqa: E402
from datastates.logs import setup_logging  # noqa: E402
from datastates.plan import ALIGN  # noqa: E402
from datastates.schema import Index, Manifest  # noqa: E402

log = logging.getLogger("tools.inspect_checkpoint")
RANK_FILE_RE = re.compile(r"^rank_(\d{5,})\.(data|manifest\.json)$")


class UsageError(Exception):
    """The path is not something this tool can describe (exit status 2)."""


# ----- helpers -----

def human(n: int | float) -> str:
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def box_str(offset, shape) -> str:
    return "[" + ", ".join(f"{o}:{o + n}" for o, n in zip(offset, shape)) + "]"


def volume(shape) -> int:
    v = 1
    for s in shape:
        v *= int(s)
    return v


def _overlaps(a_off, a_shape, b_off, b_shape) -> bool:
    return len(a_off) == len(b_off) and all(max(ao, bo) < min(ao + an, bo + bn)
                                            for ao, an, bo, bn in zip(a_off, a_shape, b_off, b_shape))


class Problems:
    """Problems found, each with the file it concerns. Any problem makes the exit status 1."""

    def __init__(self):
        self.items: list[dict] = []
        self.warnings: list[dict] = []

    def add(self, path: str, message: str) -> None:
        self.items.append({"file": path, "problem": message})

    def warn(self, path: str, message: str) -> None:
        self.warnings.append({"file": path, "warning": message})

    def __bool__(self):
        return bool(self.items)


# ----- one iteration directory -----

class Scan:
    """Everything the index and the manifests of one checkpoint directory say, read tolerantly: every problem is
    collected (the records are parsed and validated by `datastates.schema`, as a load does)."""

    def __init__(self, path: str, problems: Problems | None = None):
        self.path = os.path.normpath(path)
        self.problems = problems if problems is not None else Problems()
        self.index: Index | None = None
        self.world_size = 0
        self.ranks: dict[int, dict] = {}  # rank -> {"manifest": Manifest, "items": [Item], "data_size": int, ...}
        self._scan()

    # -- reading --
    def _scan(self) -> None:
        p, path = self.problems, self.path
        if not os.path.isdir(path):
            raise UsageError(f"{path!r} is not a directory")
        names = set(os.listdir(path))
        if path.endswith(commit.PARTIAL):
            p.add(path, "checkpoint is not published: a '.partial' directory is a save in progress or one that was "
                        "killed or failed before every rank finished")
        meta_path = os.path.join(path, fmt.METADATA)
        if fmt.METADATA in names:
            try:
                self.index = fmt.read_index(meta_path)
            except CheckpointError as e:
                p.add(meta_path, str(e))
        elif not path.endswith(commit.PARTIAL):
            p.add(meta_path, "checkpoint is not published: metadata.json is missing (an unfinished or failed save)")

        rank_files: dict[int, set] = {}
        for n in names:
            m = RANK_FILE_RE.match(n)
            if m:
                rank_files.setdefault(int(m.group(1)), set()).add(m.group(2))
        self.world_size = self.index.world_size if self.index is not None else self._unpublished_world(rank_files)
        if self.world_size <= 0:
            p.add(path, "no rank files (rank_XXXXX.data / rank_XXXXX.manifest.json) in this directory")
        if self.index is not None:
            extra = sorted(set(self.index.manifest_crcs) - set(range(self.world_size)))
            if extra:
                p.add(meta_path, f"metadata lists manifests of rank(s) {extra} beyond world size {self.world_size}")
        for r in range(self.world_size):
            self._scan_rank(r)
        for r in sorted(rank_files):
            if r >= self.world_size and self.world_size > 0:
                p.warn(os.path.join(path, f"rank_{r:05d}.*"), f"files of rank {r}, beyond world size "
                                                             f"{self.world_size}: not part of this checkpoint")
        if self.index is not None and len(self.ranks) == self.world_size:
            total = sum(r["manifest"].data_bytes for r in self.ranks.values())
            if total != self.index.bytes:
                p.add(meta_path, f"metadata says {self.index.bytes} data bytes, the manifests say {total}")

    def _unpublished_world(self, rank_files: dict[int, set]) -> int:
        """Without an index: the world size the manifests say, else the rank files present."""
        sizes = []
        for r in sorted(rank_files):
            try:
                sizes.append(fmt.read_manifest(os.path.join(self.path, fmt.manifest_file(r))).world_size)
            except CheckpointError:
                pass
        return max(sizes + [max(rank_files, default=-1) + 1])

    def _scan_rank(self, r: int) -> None:
        p = self.problems
        mpath = os.path.join(self.path, fmt.manifest_file(r))
        dpath = os.path.join(self.path, fmt.data_file(r))
        published = self.index.manifest_crcs.get(r) if self.index is not None else None
        if self.index is not None and published is None:
            p.add(os.path.join(self.path, fmt.METADATA), f"metadata does not list rank {r}'s manifest")
        if not os.path.exists(mpath):
            p.add(mpath, f"manifest of rank {r} is missing (world size {self.world_size})")
            return
        try:
            manifest = fmt.read_manifest(mpath)
        except CheckpointError as e:
            p.add(mpath, str(e))
            return
        self._compare_with_index(r, manifest, mpath, published)
        if manifest.rank != r or manifest.world_size != self.world_size:
            p.add(mpath, f"manifest says rank {manifest.rank} of world size {manifest.world_size}, expected "
                         f"rank {r} of {self.world_size}")
        items, problems = manifest.checked_items()
        for problem in problems:
            p.add(mpath, f"manifest has a malformed item: {problem}")
        try:
            data_size = os.path.getsize(dpath)
        except OSError as e:
            p.add(dpath, f"data file of rank {r} is missing or unreadable: {e.strerror}")
            data_size = None
        if data_size is not None and data_size != manifest.data_bytes:
            what = "truncated" if data_size < manifest.data_bytes else "longer than recorded"
            p.add(dpath, f"data file is {what}: {data_size} bytes, manifest says {manifest.data_bytes}")
        if fmt.SKELETON_ID not in items:
            p.add(mpath, "manifest has no state skeleton item")
        self.ranks[r] = {"manifest": manifest, "items": list(items.values()), "data_size": data_size,
                         "data_bytes": manifest.data_bytes, "manifest_path": mpath, "data_path": dpath}

    def _compare_with_index(self, r: int, manifest: Manifest, mpath: str, published: int | None) -> None:
        """The manifest is the rank's proof: it must be the one the index published, and say what the index says."""
        if published is not None and published != manifest.crc32c:
            self.problems.add(mpath, f"manifest crc32c {manifest.crc32c} differs from the one metadata.json "
                                     f"published for rank {r} ({published}): it is not the manifest of this "
                                     f"checkpoint")
        if self.index is None or self.index.schema_version < 2:
            return
        try:
            entry = self.index.part(r)
        except CheckpointError as e:
            self.problems.add(os.path.join(self.path, fmt.METADATA), str(e))
            return
        if not entry.same_record(manifest):
            self.problems.add(mpath, f"manifest of rank {r} differs from rank {r}'s entry in the index "
                                     f"(metadata.json)")

    # -- views --
    def global_tensors(self) -> dict[str, dict]:
        """name -> {"dtype", "global_shape", "shards": [{rank, offset, shape, write, id}]}, with coverage checked."""
        out: dict[str, dict] = {}
        for r, info in sorted(self.ranks.items()):
            for it in info["items"]:
                if it.kind != "tensor" or it.scope != "global":
                    continue
                t = out.setdefault(it.name, {"dtype": it.dtype, "global_shape": tuple(it.global_shape or ()),
                                             "shards": []})
                if (it.dtype, tuple(it.global_shape or ())) != (t["dtype"], t["global_shape"]):
                    self.problems.add(info["manifest_path"],
                                      f"tensor {it.name!r}: shard {it.id!r} is {it.dtype} of global shape "
                                      f"{tuple(it.global_shape or ())}, other shards say {t['dtype']} "
                                      f"{t['global_shape']}")
                t["shards"].append({"rank": r, "offset": tuple(it.global_offset or ()), "shape": tuple(it.shape),
                                    "write": it.write, "id": it.id, "nbytes": it.nbytes})
        return out

    def check_coverage(self, tensors: dict[str, dict]) -> None:
        if len(self.ranks) != self.world_size:
            return  # a missing manifest is already reported; coverage would only repeat it per tensor
        for name, t in tensors.items():
            written = [s for s in t["shards"] if s["write"]]
            gshape = t["global_shape"]
            covered = 0
            for i, s in enumerate(written):
                if len(s["offset"]) != len(gshape) or any(o < 0 or o + n > g for o, n, g in
                                                          zip(s["offset"], s["shape"], gshape)):
                    self.problems.add(self._mpath(s["rank"]), f"tensor {name!r}: shard {box_str(s['offset'], s['shape'])}"
                                                              f" lies outside its global shape {gshape}")
                    continue
                covered += volume(s["shape"])
                for other in written[:i]:
                    if _overlaps(s["offset"], s["shape"], other["offset"], other["shape"]):
                        self.problems.add(self._mpath(s["rank"]),
                                          f"tensor {name!r}: box {box_str(s['offset'], s['shape'])} is written by "
                                          f"rank {s['rank']} and (overlapping) by rank {other['rank']}")
            if covered < volume(gshape):
                self.problems.add(self.path, f"tensor {name!r} (global shape {gshape}) is not fully saved: "
                                             f"{covered} of {volume(gshape)} elements written (missing shards)")

    def objects(self) -> dict:
        glob: dict[str, list] = {}
        local: list = []
        for r, info in sorted(self.ranks.items()):
            for it in info["items"]:
                if it.kind != "object":
                    continue
                if it.scope == "global":
                    glob.setdefault(it.name, []).append({"rank": r, "write": it.write, "nbytes": it.nbytes})
                elif it.id != fmt.SKELETON_ID:
                    local.append({"rank": r, "id": it.id, "nbytes": it.nbytes})
        for name, where in glob.items():
            if not any(w["write"] for w in where):
                self.problems.add(self.path, f"object {name!r} is held by rank(s) {[w['rank'] for w in where]} "
                                             f"but written by none")
        return {"global": glob, "local": local}

    def local_tensors(self) -> list:
        return [{"rank": r, "id": it.id, "dtype": it.dtype, "shape": tuple(it.shape), "nbytes": it.nbytes}
                for r, info in sorted(self.ranks.items()) for it in info["items"]
                if it.kind == "tensor" and it.scope == "local"]

    def _mpath(self, r: int) -> str:
        return os.path.join(self.path, fmt.manifest_file(r))


# ----- reading every byte -----

class _NoProgress:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(total: int):
    """tqdm's bar (off when not a terminal) when the `tools` extra is installed; without tqdm, --verify works
    the same with no bar."""
    try:
        from tqdm import tqdm
    except ImportError:
        log.info("verify: no progress bar (tqdm is not installed: pip install -e '.[tools]')")
        return _NoProgress()
    return tqdm(total=total, unit="B", unit_scale=True, desc="verify", disable=None)


def verify_data(scan: Scan, threads: int = 4, budget_bytes: int = 256 << 20, request_bytes: int = 64 << 20) -> dict:
    """Read every written item of every rank through the native pool and compare each chunk's crc32c.

    Each data file is read as one buffered stream, its pages dropped behind (the engine's default read mode, see
    datastates.restore), on `threads` native readers with at most `budget_bytes` of buffers in flight."""
    p = scan.problems
    pool = _native.IOPool(threads)
    total = sum(it.nbytes for info in scan.ranks.values() for it in info["items"] if it.write)
    bar = _progress(total)
    stats = {"bytes_read": 0, "chunks": 0, "seconds": 0.0}
    t0 = time.perf_counter()
    pending: list = []
    in_flight = 0

    def settle(entry):
        ticket, path, item, indices, buf = entry
        bar.update(buf.numel())
        try:
            crcs = pool.wait(ticket)
        except OSError as e:
            p.add(path, f"reading item {item.id!r} failed: {e.strerror or e}")
            return
        for index, crc in zip(indices, crcs):
            stats["chunks"] += 1
            if crc != item.crcs[index]:
                p.add(path, f"checksum mismatch: item {item.id!r} chunk {index} (file offset "
                            f"{item.offset + item.chunks()[index][0]}) reads crc32c {crc:#010x}, manifest says "
                            f"{item.crcs[index]:#010x}")

    try:
        for r, info in sorted(scan.ranks.items()):
            if info["data_size"] is None:
                continue
            try:
                f = _native.File(info["data_path"], "r", "off", stream=True)
            except OSError as e:
                p.add(info["data_path"], f"cannot open: {e.strerror or e}")
                continue
            for it in info["items"]:
                if not it.write or it.nbytes == 0 or len(it.crcs) != len(it.chunks()):
                    continue
                chunks = it.chunks()
                i = 0
                while i < len(chunks):  # group whole chunks into requests of about request_bytes
                    j, start = i + 1, chunks[i][0]
                    while j < len(chunks) and chunks[j][0] + chunks[j][1] - start <= request_bytes:
                        j += 1
                    nbytes = chunks[j - 1][0] + chunks[j - 1][1] - start
                    while pending and in_flight + nbytes > budget_bytes:
                        done = pending.pop(0)
                        in_flight -= done[4].numel()
                        settle(done)
                    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8)
                    skip = (-raw.data_ptr()) % ALIGN
                    buf = raw[skip:skip + nbytes]
                    segments = [(s - start, n) for s, n in chunks[i:j]]
                    ticket = pool.submit_read(f, buf.data_ptr(), nbytes, it.offset + start, segments)
                    pending.append((ticket, info["data_path"], it, list(range(i, j)), buf))
                    in_flight += nbytes
                    stats["bytes_read"] += nbytes
                    i = j
            # files stay referenced by their pending tickets; the pool keeps them alive
        for entry in pending:
            settle(entry)
    finally:
        pool.close()
        bar.close()
    stats["seconds"] = time.perf_counter() - t0
    return stats


# ----- a save root -----

def scan_root(root: str, problems: Problems) -> dict:
    root = os.path.normpath(root)
    tracker_path = os.path.join(root, commit.TRACKER)
    try:
        found = commit.find_latest(root)
        tracker, latest = found.tracker, found.iteration
    except CheckpointError as e:
        problems.add(tracker_path, str(e))
        tracker, latest = None, None
    entries = []
    for name in sorted(os.listdir(root)):
        full = os.path.join(root, name)
        if not os.path.isdir(full):
            continue
        base = name[:-len(commit.PARTIAL)] if name.endswith(commit.PARTIAL) else name
        it = commit.iteration_of(base)
        if commit.DELETING in name:
            entries.append({"name": name, "iteration": it, "state": "being deleted (leftover of retention)"})
            continue
        if it is None:
            continue
        e = {"name": name, "iteration": it}
        ranks = sorted({int(m.group(1)) for n in os.listdir(full) if (m := RANK_FILE_RE.match(n))})
        if name.endswith(commit.PARTIAL):
            done = sum(os.path.exists(os.path.join(full, fmt.manifest_file(r))) for r in ranks)
            e["state"] = "UNPUBLISHED leftover (.partial)"
            e["ranks_done"] = done
        elif commit.is_published(full):
            try:
                index = fmt.read_index(os.path.join(full, fmt.METADATA))
                e.update(state="published", world_size=index.world_size, bytes=index.bytes,
                         created_unix=index.created_unix)
            except CheckpointError as err:
                e["state"] = "published, unreadable metadata"
                problems.add(os.path.join(full, fmt.METADATA), str(err))
        else:
            e["state"] = "UNPUBLISHED (no metadata.json)"
        e["latest"] = it == latest and e["state"] == "published"
        entries.append(e)
    if tracker is not None and tracker != str(latest):
        problems.warn(tracker_path, f"tracker says {tracker!r} but the latest published iteration is {latest}; "
                                    "loads use the latest published one")
    return {"root": root, "tracker": tracker, "latest": latest, "entries": entries}


# ----- output -----

_DIST_OPT = re.compile(r"^optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_\d+\.dtype_.*\.bucket_idx_\d+\.(\w+)$")
_MODEL_SPACE = re.compile(r"^optimizer\.state\.(\w+)\.(.+)$")


def optimizer_summary(tensors: dict[str, dict]) -> dict | None:
    """What the optimizer state is, from the tensor names megatron-core gives it: the distributed optimizer's
    dp_reshardable flat buckets (per TP x PP domain), or model-shaped state per parameter (fully_reshardable, or a
    non-distributed optimizer); with the bytes of each kind of state (main params, moments)."""
    kinds: dict[str, int] = {}
    domains, buckets, params = set(), 0, set()
    layout = None
    for name, t in tensors.items():
        nbytes = sum(s["nbytes"] for s in t["shards"] if s["write"])
        if m := _DIST_OPT.match(name):
            layout, kind = "distributed optimizer, dp_reshardable (flat bucket shards per TP x PP domain)", m[2]
            domains.add(m[1])
            buckets += 1
        elif m := _MODEL_SPACE.match(name):
            layout = layout or "model-shaped (fully_reshardable distributed optimizer, or a non-distributed one)"
            kind = m[1]
            params.add(m[2])
        else:
            continue
        kinds[kind] = kinds.get(kind, 0) + nbytes
    if not kinds:
        return None
    out = {"layout": layout, "bytes_by_kind": kinds}
    if domains:
        out.update(domains=len(domains), buckets=buckets // max(1, len(kinds)))
    else:
        out["parameters"] = len(params)
    return out


def iteration_report(scan: Scan, verify: bool, threads: int) -> dict:
    tensors = scan.global_tensors()
    scan.check_coverage(tensors)
    objects = scan.objects()
    index = scan.index
    report = {"path": scan.path, "published": index is not None,
              "iteration": index.iteration if index is not None else commit.iteration_of(scan.path),
              "world_size": scan.world_size, "bytes": sum((r["data_bytes"] for r in scan.ranks.values()), 0),
              "created_unix": index.created_unix if index is not None else None,
              "ranks": [{"rank": r, "data_file": info["data_path"], "data_bytes": info["data_bytes"],
                         "file_bytes": info["data_size"], "direct_io": info["manifest"].direct_io,
                         "items": len(info["items"]),
                         "tensors_written": sum(1 for i in info["items"] if i.kind == "tensor" and i.write),
                         "objects_written": sum(1 for i in info["items"] if i.kind == "object" and i.write),
                         "replicas_not_written": sum(1 for i in info["items"] if not i.write)}
                        for r, info in sorted(scan.ranks.items())],
              "tensors": {name: {"dtype": t["dtype"], "global_shape": list(t["global_shape"]),
                                 "nbytes": sum(s["nbytes"] for s in t["shards"] if s["write"]),
                                 "shards": [dict(s, offset=list(s["offset"]), shape=list(s["shape"]))
                                            for s in t["shards"]]}
                          for name, t in sorted(tensors.items())},
              "local_tensors": [dict(t, shape=list(t["shape"])) for t in scan.local_tensors()],
              "objects": objects, "optimizer": optimizer_summary(tensors)}
    if verify:
        report["verify"] = verify_data(scan, threads)
    return report


def print_iteration(rep: dict, out=None) -> None:
    w = (out or sys.stdout).write
    state = "published" if rep["published"] else "NOT PUBLISHED"
    created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(rep["created_unix"])) if rep["created_unix"] else "-"
    w(f"checkpoint {rep['path']}\n  iteration {rep['iteration']}, {state}, world size {rep['world_size']}, "
      f"{human(rep['bytes'])} of data, created {created}\n")
    w("ranks:\n")
    for r in rep["ranks"]:
        w(f"  rank {r['rank']}: {os.path.basename(r['data_file'])} {human(r['data_bytes'])}"
          f"{' (O_DIRECT)' if r['direct_io'] else ''}; {r['tensors_written']} tensors and {r['objects_written']} "
          f"objects written, {r['replicas_not_written']} replicas held but written by another rank\n")
    opt = rep.get("optimizer")
    if opt:
        where = (f"{opt['domains']} domain(s), {opt['buckets']} bucket(s)" if "domains" in opt
                 else f"{opt['parameters']} parameters")
        w(f"optimizer state: {opt['layout']}; {where}; "
          + ", ".join(f"{k} {human(n)}" for k, n in sorted(opt["bytes_by_kind"].items())) + "\n")
    w(f"tensors ({len(rep['tensors'])} global):\n")
    for name, t in rep["tensors"].items():
        w(f"  {name}  {t['dtype']} {tuple(t['global_shape'])}  {human(t['nbytes'])}\n")
        for s in t["shards"]:
            how = "written" if s["write"] else "replica, not written here"
            w(f"      {box_str(s['offset'], s['shape'])}  rank {s['rank']}  {how}\n")
    if rep["local_tensors"]:
        w(f"rank-local tensors ({len(rep['local_tensors'])}):\n")
        for t in rep["local_tensors"]:
            w(f"  rank {t['rank']}  {t['id']}  {t['dtype']} {tuple(t['shape'])}  {human(t['nbytes'])}\n")
    objs = rep["objects"]
    w(f"objects ({len(objs['global'])} global, {len(objs['local'])} rank-local):\n")
    for name, where in sorted(objs["global"].items()):
        ws = ", ".join(f"rank {x['rank']}{'' if x['write'] else ' (not written)'}" for x in where)
        w(f"  {name}  {human(max(x['nbytes'] for x in where))}  {ws}\n")
    for o in objs["local"]:
        w(f"  rank {o['rank']}  {o['id']}  {human(o['nbytes'])}\n")
    if "verify" in rep:
        v = rep["verify"]
        w(f"verify: read {human(v['bytes_read'])} in {v['chunks']} checksummed chunks in {v['seconds']:.2f} s "
          f"({v['bytes_read'] / max(v['seconds'], 1e-9) / 1e9:.2f} GB/s)\n")


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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="inspect_checkpoint.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("path", help="a save root (holding iter_XXXXXXX/ and the tracker) or an iteration directory")
    ap.add_argument("--iteration", type=int, help="with a save root: describe this iteration")
    ap.add_argument("--verify", action="store_true",
                    help="read every data byte and check every checksum (with a save root: its latest iteration, "
                         "or --iteration)")
    ap.add_argument("--json", action="store_true", help="print one JSON document instead of text")
    ap.add_argument("--threads", type=int, default=4, help="native reader threads for --verify [4]")
    args = ap.parse_args(argv)
    setup_logging(rank=0)

    problems = Problems()
    path = os.path.normpath(args.path)
    out: dict = {}
    try:
        if not os.path.exists(path):
            raise UsageError(f"{path!r} does not exist")
        if not os.path.isdir(path):
            raise UsageError(f"{path!r} is not a directory (a save root or an iteration directory)")
        is_iteration = commit.iteration_of(path) is not None or path.endswith(commit.PARTIAL) or \
            os.path.exists(os.path.join(path, fmt.METADATA)) or \
            any(RANK_FILE_RE.match(n) for n in os.listdir(path))
        target = None
        if is_iteration:
            if args.iteration is not None:
                raise UsageError("--iteration goes with a save root, not an iteration directory")
            target = path
        else:
            out["root"] = scan_root(path, problems)
            if args.iteration is not None:
                target = commit.checkpoint_dir(path, args.iteration)
                if not os.path.isdir(target):
                    if os.path.isdir(commit.partial_dir(target)):
                        target = commit.partial_dir(target)
                    else:
                        raise UsageError(f"{path!r} has no iteration {args.iteration} ({target!r} does not exist)")
            elif args.verify:
                if out["root"]["latest"] is None:
                    problems.add(path, "no published checkpoint to verify under this save root")
                else:
                    target = commit.checkpoint_dir(path, out["root"]["latest"])
        if target is not None:
            scan = Scan(target, problems)
            out["checkpoint"] = iteration_report(scan, args.verify, args.threads)
    except UsageError as e:
        log.error("%s", e)
        return 2

    out["problems"] = problems.items
    out["warnings"] = problems.warnings
    out["ok"] = not problems
    if args.json:
        json.dump(out, sys.stdout, indent=1, default=str)
        sys.stdout.write("\n")
    else:
        if "root" in out:
            print_root(out["root"])
        if "checkpoint" in out:
            print_iteration(out["checkpoint"])
    for wng in problems.warnings:
        log.warning("%s: %s", wng["file"], wng["warning"])
    for prob in problems.items:
        log.error("PROBLEM %s: %s", prob["file"], prob["problem"])
    if not args.json:
        if problems:
            log.error("%d problem(s) found", len(problems.items))
        elif args.verify:
            print("verify: OK, every checksum matches")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
