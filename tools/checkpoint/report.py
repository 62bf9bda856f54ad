"""inspect_checkpoint's reports, as JSON-ready dicts: one checkpoint (from the engine's `audit`) or a save root."""
from __future__ import annotations

import os

from datastates import Audit, CheckpointError, Problems, Storage, find_latest, is_published, read_index, storage_for
from datastates.paths import (DELETING, METADATA, PARTIAL, RANK_FILE_RE, TRACKER, iteration_of, manifest_file,
                              normalize as normalize_path, scheme as url_scheme)

from .summary import experts_summary, optimizer_summary


def iteration_report(found: Audit) -> dict:
    """What one checkpoint holds, rank by rank and tensor by tensor."""
    tensors, objects = found.global_tensors(), found.objects()
    index = found.index
    report = {"path": found.path, "published": index is not None,
              "iteration": index.iteration if index is not None else iteration_of(found.path),
              "world_size": found.world_size, "bytes": sum((r["data_bytes"] for r in found.ranks.values()), 0),
              "raw_bytes": sum((_raw_bytes(r["items"]) for r in found.ranks.values()), 0),
              "created_unix": index.created_unix if index is not None else None,
              "ranks": [_rank_report(r, info) for r, info in sorted(found.ranks.items())],
              "tensors": {name: {"dtype": t["dtype"], "global_shape": list(t["global_shape"]),
                                 "nbytes": sum(s["nbytes"] for s in t["shards"] if s["write"]),
                                 "shards": [dict(s, offset=list(s["offset"]), shape=list(s["shape"]))
                                            for s in t["shards"]]}
                          for name, t in sorted(tensors.items())},
              "local_tensors": [dict(t, shape=list(t["shape"])) for t in found.local_tensors()],
              "objects": objects, "optimizer": optimizer_summary(tensors, objects),
              "experts": experts_summary(tensors)}
    if found.stats is not None:
        report["verify"] = found.stats
    return report


def _raw_bytes(items) -> int:
    """The written items' bytes before compression (a data file also holds alignment padding)."""
    return sum(i.nbytes for i in items if i.write)


def _rank_report(r: int, info: dict) -> dict:
    items = info["items"]
    return {"rank": r, "data_file": info["data_path"], "data_bytes": info["data_bytes"],
            "raw_bytes": _raw_bytes(items), "codecs": sorted({i.codec for i in items if i.write and i.codec}),
            "file_bytes": info["data_size"], "direct_io": info["manifest"].direct_io, "items": len(items),
            "tensors_written": sum(1 for i in items if i.kind == "tensor" and i.write),
            "objects_written": sum(1 for i in items if i.kind == "object" and i.write),
            "replicas_not_written": sum(1 for i in items if not i.write)}


def scan_root(root: str, problems: Problems) -> dict:
    """The iterations under a save root: published, unpublished leftovers, being deleted; the latest."""
    storage = storage_for(root)
    root = normalize_path(root)
    tracker_path = os.path.join(root, TRACKER)
    try:
        found = find_latest(root, storage)
        tracker, latest = found.tracker, found.iteration
    except CheckpointError as e:
        problems.add(tracker_path, str(e))
        tracker, latest = None, None
    entries = []
    for name in sorted(storage.list(root)):
        entry = _root_entry(storage, root, name, latest, problems)
        if entry is not None:
            entries.append(entry)
    if tracker is not None and tracker != str(latest):
        problems.warn(tracker_path, f"tracker says {tracker!r} but the latest published iteration is {latest}; "
                                    "loads use the latest published one")
    return {"root": root, "tracker": tracker, "latest": latest, "entries": entries}


def _root_entry(storage: Storage, root: str, name: str, latest: int | None, problems: Problems) -> dict | None:
    full = os.path.join(root, name)
    if not (os.path.isdir(full) if url_scheme(full) is None else storage.list(full)):  # a prefix holds objects
        return None
    it = iteration_of(name[:-len(PARTIAL)] if name.endswith(PARTIAL) else name)
    if DELETING in name:
        return {"name": name, "iteration": it, "state": "being deleted (leftover of retention)"}
    if it is None:
        return None
    e = {"name": name, "iteration": it}
    if name.endswith(PARTIAL):
        ranks = {int(m.group(1)) for n in storage.list(full) if (m := RANK_FILE_RE.match(n))}
        e["state"] = "UNPUBLISHED leftover (.partial)"
        e["ranks_done"] = sum(storage.exists(os.path.join(full, manifest_file(r))) for r in ranks)
    elif is_published(full, storage):
        try:
            index = read_index(full)
            e.update(state="published", world_size=index.world_size, bytes=index.bytes,
                     created_unix=index.created_unix)
        except CheckpointError as err:
            e["state"] = "published, unreadable metadata"
            problems.add(os.path.join(full, METADATA), str(err))
    else:
        e["state"] = "UNPUBLISHED (no metadata.json)"
    e["latest"] = it == latest and e["state"] == "published"
    return e
