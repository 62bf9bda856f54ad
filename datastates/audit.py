"""Check a checkpoint directory and collect every problem in one run: the engine's answer to "is this intact?".

`audit_checkpoint(path)` reads the index and every rank's manifest tolerantly (parsed and validated by `schema`, as a load
does) and checks that the index lists every rank, each manifest is intact and is the one the index published,
each data file has its recorded size, every item lies inside its file, and every global tensor is covered by
written shards that agree on dtype and global shape and do not overlap. With `verify=True` it also reads every
data byte through the engine's verifier (`CheckpointVerifier.verify_all`: the load's own read pipeline) and checks
every chunk's crc32c. Nothing stops at the first problem: each is recorded in `Audit.problems` with its file and,
where known, its rank, item and file offset. A load, by contrast, stops at the first (`loader`).
"""
from __future__ import annotations

import time
from typing import Callable

from . import format as fmt
from . import paths
from .errors import CheckpointError
from .open_checkpoint import OpenCheckpoint
from .problems import Problems
from .schema import Box, Index, Kind, Manifest, Scope, volume
from .storage import Storage, storage_for
from .verifier import CheckpointVerifier

RANK_FILE_RE = paths.RANK_FILE_RE


class NotACheckpointError(CheckpointError):
    """The path is not a directory that could hold a checkpoint."""


def audit_checkpoint(path: str, verify: bool = False, threads: int = 4,
                     progress: Callable[[int], None] | None = None) -> "Audit":
    """Every problem of the checkpoint directory `path`: its structure, and with `verify` every data byte."""
    found = Audit(path)
    if verify:
        found.verify(threads, progress)
    return found


class Audit:
    """What the index and the manifests of one checkpoint directory say, and every problem found in them."""

    def __init__(self, path: str, problems: Problems | None = None, storage: Storage | None = None):
        self.storage = storage or storage_for(path)
        self.path = paths.normalize(path)
        self.problems = problems if problems is not None else Problems()
        self.index: Index | None = None
        self.world_size = 0
        self.ranks: dict[int, dict] = {}  # rank -> {"manifest": Manifest, "items": [Item], "data_size": int, ...}
        self.stats: dict | None = None  # what `verify` read
        self._scan()

    def _scan(self) -> None:
        names = set(self.storage.list(self.path))
        if not names and not self.storage.exists(self.path):
            raise NotACheckpointError(f"{self.path!r} is not a directory")
        self._read_index(names)
        rank_files: dict[int, set] = {}
        for n in names:
            if m := RANK_FILE_RE.match(n):
                rank_files.setdefault(int(m.group(1)), set()).add(m.group(2))
        self.world_size = self.index.world_size if self.index is not None else self._unpublished_world(rank_files)
        if self.world_size <= 0:
            self.problems.add(self.path, "no rank files (rank_XXXXX.data / rank_XXXXX.manifest.json) in this "
                                         "directory")
        if self.index is not None:
            extra = sorted(set(self.index.manifest_crcs) - set(range(self.world_size)))
            if extra:
                self.problems.add(self._meta, f"metadata lists manifests of rank(s) {extra} beyond world size "
                                              f"{self.world_size}")
        for r in range(self.world_size):
            self._scan_rank(r)
        for r in sorted(rank_files):
            if r >= self.world_size > 0:
                self.problems.warn(paths.join(self.path, f"rank_{r:05d}.*"),
                                   f"files of rank {r}, beyond world size {self.world_size}: not part of this "
                                   f"checkpoint")
        if self.index is not None and len(self.ranks) == self.world_size:
            total = sum(r["manifest"].data_bytes for r in self.ranks.values())
            if total != self.index.bytes:
                self.problems.add(self._meta, f"metadata says {self.index.bytes} data bytes, the manifests say "
                                              f"{total}")
        self._tensors = self._global_tensors()
        self.check_coverage(self._tensors)
        self._objects = self._collect_objects()

    @property
    def _meta(self) -> str:
        return paths.join(self.path, paths.METADATA)

    def _read_index(self, names: set) -> None:
        partial = self.path.endswith(paths.PARTIAL)
        if partial:
            self.problems.add(self.path, "checkpoint is not published: a '.partial' directory is a save in "
                                         "progress or one that was killed or failed before every rank finished")
        if paths.METADATA in names:
            try:
                self.index = fmt.read_index(self.storage, self.path)
            except CheckpointError as e:
                self.problems.add(self._meta, str(e))
        elif not partial:
            self.problems.add(self._meta, "checkpoint is not published: metadata.json is missing (an unfinished "
                                          "or failed save)")

    def _unpublished_world(self, rank_files: dict[int, set]) -> int:
        """Without an index: the world size the manifests say, else the rank files present."""
        sizes = []
        for r in sorted(rank_files):
            try:
                sizes.append(fmt.read_manifest(self.storage, self._mpath(r)).world_size)
            except CheckpointError:
                pass
        return max(sizes + [max(rank_files, default=-1) + 1])

    def _scan_rank(self, r: int) -> None:
        p = self.problems
        mpath, dpath = self._mpath(r), paths.join(self.path, paths.data_file(r))
        published = self.index.manifest_crcs.get(r) if self.index is not None else None
        if self.index is not None and published is None:
            p.add(self._meta, f"metadata does not list rank {r}'s manifest", rank=r)
        if not self.storage.exists(mpath):
            p.add(mpath, f"manifest of rank {r} is missing (world size {self.world_size})", rank=r)
            return
        try:
            manifest = fmt.read_manifest(self.storage, mpath)
        except CheckpointError as e:
            p.add(mpath, str(e), rank=r)
            return
        self._compare_with_index(r, manifest, mpath, published)
        if manifest.rank != r or manifest.world_size != self.world_size:
            p.add(mpath, f"manifest says rank {manifest.rank} of world size {manifest.world_size}, expected "
                         f"rank {r} of {self.world_size}", rank=r)
        items, problems = manifest.checked_items()
        for problem in problems:
            p.add(mpath, f"manifest has a malformed item: {problem}", rank=r)
        try:
            data_size = self.storage.size(dpath)
        except OSError as e:
            p.add(dpath, f"data file of rank {r} is missing or unreadable: {e.strerror}", rank=r)
            data_size = None
        if data_size is not None and data_size != manifest.data_bytes:
            p.add(dpath, fmt.data_size_problem(dpath, data_size, manifest.data_bytes), rank=r,
                  offset=min(data_size, manifest.data_bytes))
        if fmt.SKELETON_ID not in items:
            p.add(mpath, "manifest has no state skeleton item", rank=r)
        self.ranks[r] = {"manifest": manifest, "items": list(items.values()), "data_size": data_size,
                         "data_bytes": manifest.data_bytes, "manifest_path": mpath, "data_path": dpath}

    def _compare_with_index(self, r: int, manifest: Manifest, mpath: str, published: int | None) -> None:
        """The manifest is the rank's proof: it must be the one the index published, and say what the index says."""
        if published is not None and published != manifest.crc32c:
            self.problems.add(mpath, f"manifest crc32c {manifest.crc32c} differs from the one metadata.json "
                                     f"published for rank {r} ({published}): it is not the manifest of this "
                                     f"checkpoint", rank=r)
        if self.index is None or self.index.schema_version < 2:
            return
        try:
            entry = self.index.part(r)
        except CheckpointError as e:
            self.problems.add(self._meta, str(e), rank=r)
            return
        if not entry.same_record(manifest):
            self.problems.add(mpath, f"manifest of rank {r} differs from rank {r}'s entry in the index "
                                     f"(metadata.json)", rank=r)

    # ----- what the checkpoint holds -----

    def global_tensors(self) -> dict[str, dict]:
        """name -> {"dtype", "global_shape", "shards": [{rank, offset, shape, write, id, nbytes}]}."""
        return self._tensors

    def objects(self) -> dict:
        """{"global": name -> [{rank, write, nbytes}], "local": [{rank, id, nbytes}]}."""
        return self._objects

    def _global_tensors(self) -> dict[str, dict]:
        """The global tensors from every rank's items; shards that disagree on dtype or global shape are
        problems."""
        out: dict[str, dict] = {}
        for r, info in sorted(self.ranks.items()):
            for it in info["items"]:
                if it.kind != Kind.TENSOR or it.scope != Scope.GLOBAL:
                    continue
                gshape = tuple(it.global_shape or ())
                t = out.setdefault(it.name, {"dtype": it.dtype, "global_shape": gshape, "shards": []})
                if (it.dtype, gshape) != (t["dtype"], t["global_shape"]):
                    self.problems.add(info["manifest_path"], f"tensor {it.name!r}: shard {it.id!r} is {it.dtype} of "
                                                             f"global shape {gshape}, other shards say {t['dtype']} "
                                                             f"{t['global_shape']}", rank=r, item=it.id)
                t["shards"].append({"rank": r, "offset": tuple(it.global_offset or ()), "shape": tuple(it.shape),
                                    "write": it.write, "id": it.id, "nbytes": it.nbytes})
        return out

    def check_coverage(self, tensors: dict[str, dict]) -> None:
        """Every global tensor's written shards: inside its global shape, not overlapping, covering it whole
        (run by the audit itself; again, it repeats no problem)."""
        if len(self.ranks) != self.world_size:
            return  # a missing manifest is already reported; coverage would only repeat it per tensor
        for name, t in tensors.items():
            written = [s for s in t["shards"] if s["write"]]
            covered = 0
            for i, s in enumerate(written):
                if self._outside(name, s, t["global_shape"]):
                    continue
                covered += volume(s["shape"])
                box = Box(s["offset"], s["shape"])
                for other in written[:i]:
                    if box.overlap(Box(other["offset"], other["shape"])) is not None:
                        self.problems.add(self._mpath(s["rank"]),
                                          f"tensor {name!r}: box {box_str(box)} is written by rank {s['rank']} and "
                                          f"(overlapping) by rank {other['rank']}", rank=s["rank"], item=s["id"])
            if covered < volume(t["global_shape"]):
                self.problems.add(self.path, f"tensor {name!r} (global shape {t['global_shape']}) is not fully "
                                             f"saved: {covered} of {volume(t['global_shape'])} elements written "
                                             f"(missing shards)")

    def _outside(self, name: str, shard: dict, gshape: tuple) -> bool:
        off, shape = shard["offset"], shard["shape"]
        if len(off) == len(gshape) and all(0 <= o and o + n <= g for o, n, g in zip(off, shape, gshape)):
            return False
        self.problems.add(self._mpath(shard["rank"]), f"tensor {name!r}: shard {box_str(Box(off, shape))} lies "
                                                      f"outside its global shape {gshape}", rank=shard["rank"],
                          item=shard["id"])
        return True

    def _collect_objects(self) -> dict:
        """The objects of every rank; a global object no rank wrote is a problem."""
        glob: dict[str, list] = {}
        local: list = []
        for r, info in sorted(self.ranks.items()):
            for it in info["items"]:
                if it.kind != Kind.OBJECT:
                    continue
                if it.scope == Scope.GLOBAL:
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
                if it.kind == Kind.TENSOR and it.scope == Scope.LOCAL]

    def _mpath(self, r: int) -> str:
        return paths.join(self.path, paths.manifest_file(r))

    # ----- every byte -----

    def verify(self, threads: int = 4, progress: Callable[[int], None] | None = None) -> None:
        """Read every written byte of every rank whose data file exists (its manifest need not), through the
        engine's verifier, and record each bad chunk (a published checkpoint only: an unpublished one is already a
        problem)."""
        if self.index is None:
            self.problems.warn(self.path, "data not verified: the engine's verifier reads published checkpoints "
                                          "(this one has no valid metadata.json)")
            return
        t0 = time.perf_counter()
        ranks = [r for r in range(self.world_size) if self.storage.exists(paths.join(self.path, paths.data_file(r)))]
        try:
            with OpenCheckpoint.standalone(self.path, threads=threads) as checkpoint:
                self.stats = CheckpointVerifier(checkpoint).verify_all(self.problems, ranks, progress)
        except CheckpointError as e:
            self.problems.add(self.path, str(e))
            return
        self.stats["seconds"] = time.perf_counter() - t0


def box_str(box: Box) -> str:
    return "[" + ", ".join(f"{o}:{o + n}" for o, n in zip(box.offset, box.shape)) + "]"
