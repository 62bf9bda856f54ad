"""Read a published checkpoint back: verify, and reshard into whatever layout the target asks for.

Everything a load needs to know is in one file, the global index in metadata.json (schema 2; schema 1
checkpoints are read through their per-rank manifests). Rank-local items are found by id among the same rank's
items. Global items (shards of a logical tensor) are indexed by name across every rank's items; each target
shard reads exactly the rows of the saved shards it overlaps, widened to whole checksum chunks so every byte
read is verified. Only the data files holding wanted bytes are opened. Reads go through the native pool in
parallel, straight into the target tensor when its layout allows.
"""
from __future__ import annotations

import os
from typing import Any, NamedTuple

import torch

from . import _native
from . import commit
from . import format as fmt
from .errors import CheckpointCorruptError, CheckpointError
from .plan import ALIGN, Item, dtype_from_name, dtype_name
from .providers import ProviderRegistry, unflatten



def resolve_checkpoint(path: str) -> str:
    """An iteration directory, or a save root whose latest published iteration is meant."""
    path = os.path.normpath(path)
    if commit.is_published(path):
        return path
    if os.path.isdir(path) and commit.iteration_of(path) is None:
        latest = commit.read_latest(path)
        if latest is not None:
            return commit.checkpoint_dir(path, latest)
        raise CheckpointError(f"no published checkpoint under {path!r}")
    if os.path.isdir(commit.partial_dir(path)) or (os.path.isdir(path) and not commit.is_published(path)):
        raise CheckpointError(f"checkpoint {path!r} is not published (an unfinished or failed save): "
                              f"it cannot be loaded")
    raise CheckpointError(f"no checkpoint at {path!r}")


def _aligned_empty(nbytes: int) -> torch.Tensor:
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8)
    skip = (-raw.data_ptr()) % ALIGN
    return raw[skip:skip + nbytes]


class _Reads:
    """A batch of pending reads: submitted at once, then verified and placed."""

    def __init__(self, reader: "CheckpointReader"):
        self.reader = reader
        self.pending: list[tuple[int, int, Item, list[int], int, Any]] = []

    def read_chunks(self, rank: int, item: Item, first: int, last: int, dst: torch.Tensor, then=None):
        """Read chunks [first, last) of a stored item into the uint8 tensor `dst` and verify them."""
        chunks = item.chunks()[first:last]
        start = chunks[0][0]
        nbytes = chunks[-1][0] + chunks[-1][1] - start
        if nbytes > dst.numel() * dst.element_size():
            raise CheckpointCorruptError(f"item {item.id!r} in {self.reader.data_path(rank)!r}: {nbytes} bytes "
                                         f"do not fit the {dst.numel() * dst.element_size()}-byte destination")
        segments = [(s - start, n) for s, n in chunks]
        f = self.reader.data_file(rank)
        ticket = self.reader.io.submit_read(f, dst.data_ptr(), nbytes, item.offset + start, segments)
        self.pending.append((ticket, rank, item, list(range(first, last)), dst, then))

    def finish(self) -> None:
        pending, self.pending = self.pending, []
        errors = []
        for ticket, rank, item, indices, dst, then in pending:
            try:
                crcs = self.reader.io.wait(ticket)
            except OSError as e:
                errors.append(CheckpointCorruptError(
                    f"reading item {item.id!r} from {self.reader.data_path(rank)!r} failed: {e.strerror or e}"))
                continue
            for index, crc in zip(indices, crcs):
                if crc != item.crcs[index]:
                    errors.append(CheckpointCorruptError(
                        f"checksum mismatch in {self.reader.data_path(rank)!r}: item {item.id!r} chunk {index} "
                        f"(file offset {item.offset + item.chunks()[index][0]}) reads crc32c {crc:#010x}, "
                        f"manifest says {item.crcs[index]:#010x}"))
            if then is not None and not errors:
                then(dst)
        if errors:
            raise errors[0]


class CheckpointReader:
    def __init__(self, path: str, io: _native.IOPool, budget_bytes: int, registry: ProviderRegistry):
        self.path = resolve_checkpoint(path)
        self.io = io
        self.budget_bytes = budget_bytes
        self.registry = registry
        meta_path = os.path.join(self.path, fmt.METADATA)
        self.metadata = fmt.read_metadata(meta_path)
        self.world_size = self.metadata.get("world_size")
        if type(self.world_size) is not int or self.world_size < 1:
            raise CheckpointCorruptError(f"checkpoint metadata {meta_path!r} has no valid world_size")
        self._manifests: dict[int, dict[str, Item]] = {}
        self._data_bytes: dict[int, int] = {}
        self._files: dict[int, _native.File] = {}
        self._v1_manifests: dict[int, dict] = {}
        self._global: dict[str, list[Shard]] | None = None

    # ----- manifests and files -----

    def _rank_doc(self, rank: int) -> tuple[str, dict]:
        """Where a rank's items are described (for messages), and the description: its entry in the index
        (schema 2), or its manifest (schema 1)."""
        if not 0 <= rank < self.world_size:
            raise CheckpointError(f"checkpoint {self.path!r} was saved by {self.world_size} rank(s); "
                                  f"it has no rank {rank}")
        if self.metadata["schema_version"] >= 2:
            where = f"checkpoint index {os.path.join(self.path, fmt.METADATA)!r} (rank {rank})"
            ranks = self.metadata.get("ranks")
            doc = ranks.get(str(rank)) if isinstance(ranks, dict) else None
            if not isinstance(doc, dict):
                raise CheckpointCorruptError(f"{where} is missing")
            return where, doc
        path = os.path.join(self.path, fmt.manifest_file(rank))
        if rank not in self._v1_manifests:
            doc = fmt.read_manifest(path)
            expected = self.metadata.get("manifests", {}).get(str(rank))
            if expected is not None and expected != doc["manifest_crc32c"]:
                raise CheckpointCorruptError(f"manifest {path!r} is not the one this checkpoint published")
            self._v1_manifests[rank] = doc
        return f"manifest {path!r}", self._v1_manifests[rank]

    def items(self, rank: int) -> dict[str, Item]:
        """A rank's items, parsed and validated (only for the ranks a load actually reads from)."""
        if rank not in self._manifests:
            self._manifests[rank] = self._parse_items(rank, *self._rank_doc(rank))
        return self._manifests[rank]

    def _parse_items(self, rank: int, where: str, doc: dict) -> dict[str, Item]:
        """A rank's items, each checked against itself: a checksummed index can still have been forged, and
        nothing it says may make a read overrun its destination (the data file's size is checked on open)."""
        try:
            data_bytes = doc["data_bytes"]
            if type(data_bytes) is not int or data_bytes < 0:
                raise ValueError(f"data_bytes {data_bytes!r}")
            items = {}
            for d in doc["items"]:
                it = Item.from_json(d)
                it.validate(data_bytes)
                if it.id in items:
                    raise ValueError(f"duplicate item id {it.id!r}")
                items[it.id] = it
        except (KeyError, TypeError, ValueError, OverflowError, AttributeError) as e:
            raise CheckpointCorruptError(f"{where} is malformed: {type(e).__name__}: {e}") from None
        self._data_bytes[rank] = data_bytes
        return items

    def close(self) -> None:
        """Close the data files this reader opened."""
        for f in self._files.values():
            f.close()
        self._files = {}

    def data_path(self, rank: int) -> str:
        return os.path.join(self.path, fmt.data_file(rank))

    def data_file(self, rank: int) -> _native.File:
        if rank not in self._files:
            self.items(rank)  # its data size, from the index
            data = self.data_path(rank)
            try:
                f = _native.File(data, "r")
                size = f.size()
            except OSError as e:
                raise CheckpointError(f"cannot open {data!r}: {e.strerror or e}") from None
            expected = self._data_bytes[rank]
            if size < expected:
                f.close()
                raise CheckpointCorruptError(f"data file {data!r} is truncated: {size} bytes, the checkpoint's "
                                             f"index says {expected}")
            self._files[rank] = f
        return self._files[rank]

    def global_index(self) -> dict[str, list[Shard]]:
        """Every written global item by name, from the raw index: O(items) lookups, no parsing; the shards a
        load reads are parsed and validated with their rank's items (`shard_item`)."""
        if self._global is None:
            index: dict[str, list[Shard]] = {}
            for r in range(self.world_size):
                where, doc = self._rank_doc(r)
                try:
                    for d in doc["items"]:
                        if d.get("scope") == "global" and d.get("write", True):
                            index.setdefault(d["name"], []).append(Shard(
                                r, d["id"], d["kind"], d.get("dtype"), tuple(d.get("shape") or ()),
                                tuple(d.get("global_shape") or ()), tuple(d.get("global_offset") or ())))
                except (KeyError, TypeError, AttributeError) as e:
                    raise CheckpointCorruptError(f"{where} is malformed: {type(e).__name__}: {e}") from None
            self._global = index
        return self._global

    def shard_item(self, shard: "Shard") -> Item:
        """The validated item behind a shard of the global index."""
        return self.items(shard.rank)[shard.id]

    # ----- load -----

    @torch.no_grad()
    def load(self, rank: int, template: Any = None) -> Any:
        # a rank beyond the saved world (loading into more ranks) can still fill global items
        own = self.items(rank) if template is None or rank < self.world_size else {}
        if template is None:
            skeleton = self._read_object(rank, self._item(own, fmt.SKELETON_ID, rank))
            wanted = [(it, torch.empty(it.shape, dtype=dtype_from_name(it.dtype)) if it.kind == "tensor" else None)
                      for it in own.values() if it.id != fmt.SKELETON_ID]
        else:
            skeleton, entries = self.registry.flatten(template)
            wanted = [(e.item, _writable(e.source) if e.item.kind == "tensor" else None) for e in entries]
        values: dict[str, Any] = {}
        reads, staged = _Reads(self), 0
        for target, dst in wanted:
            if target.kind == "object":
                values[target.id] = self._read_object(*self._saved_object(target, own, rank))
                continue
            values[target.id] = dst
            if target.scope == "global":
                staged += self._read_global(target, dst, reads)
            else:
                staged += self._read_whole(rank, self._saved_tensor(target, own, rank), dst, reads)
            if staged >= self.budget_bytes:  # bound the temporary memory of resharding reads
                reads.finish()
                staged = 0
        reads.finish()
        return unflatten(skeleton, values.__getitem__)

    def _item(self, items: dict[str, Item], key: str, rank: int) -> Item:
        if rank >= self.world_size:
            raise CheckpointError(f"checkpoint {self.path!r} was saved by {self.world_size} rank(s): rank {rank} "
                                  f"has no rank-local item {key!r} there (only global items reshard)")
        if key not in items:
            raise CheckpointError(f"checkpoint {self.path!r} (rank {rank}) has no item {key!r}")
        return items[key]

    def _saved_object(self, target: Item, own: dict[str, Item], rank: int) -> tuple[int, Item]:
        if target.scope == "local":
            saved = self._item(own, target.id, rank)
            if saved.kind != "object":
                raise CheckpointError(f"checkpoint {self.path!r} item {target.id!r} is a {saved.kind}, "
                                      f"the target wants an object")
            return rank, saved
        holders = [sh for sh in self.global_index().get(target.name, []) if sh.kind == "object"]
        if not holders:
            raise CheckpointError(f"checkpoint {self.path!r} has no object named {target.name!r}")
        shard = min(holders, key=lambda sh: sh.rank != rank)  # this rank's own copy when it wrote one
        return shard.rank, self.shard_item(shard)

    def _saved_tensor(self, target: Item, own: dict[str, Item], rank: int) -> Item:
        saved = self._item(own, target.id, rank)
        if (saved.kind, saved.dtype, saved.shape) != (target.kind, target.dtype, target.shape):
            raise CheckpointError(
                f"checkpoint {self.path!r} item {target.id!r} is {saved.kind} {saved.dtype} {saved.shape}, "
                f"the target wants {target.kind} {target.dtype} {target.shape}")
        return saved

    @torch.no_grad()
    def read_item(self, rank: int, item: Item) -> Any:
        """One stored item of `rank`, verified: a new CPU tensor, or the unpickled object."""
        if item.kind == "object":
            return self._read_object(rank, item)
        dst = torch.empty(item.shape, dtype=dtype_from_name(item.dtype))
        reads = _Reads(self)
        self._read_whole(rank, item, dst, reads)
        reads.finish()
        return dst

    def verify(self, rank: int) -> None:
        """Read every item `rank` saved and check every checksum (raises on the first damage); nothing is kept."""
        for item in self.items(rank).values():
            self.read_item(rank, item)

    def _read_object(self, rank: int, item: Item) -> Any:
        buf = _aligned_empty(item.nbytes)
        reads = _Reads(self)
        reads.read_chunks(rank, item, 0, len(item.chunks()), buf)
        reads.finish()
        return fmt.loads(buf.numpy().tobytes(), f"{item.id!r} in {self.data_path(rank)!r}")

    def _read_whole(self, rank: int, saved: Item, dst: torch.Tensor, reads: _Reads) -> int:
        """Read a stored tensor item entirely into `dst`; returns the temporary bytes it holds."""
        if saved.nbytes == 0:
            return 0
        n = len(saved.chunks())
        if dst.device.type == "cpu" and dst.is_contiguous():
            reads.read_chunks(rank, saved, 0, n, dst.view(-1).view(torch.uint8) if dst.dim() else
                              dst.view(1).view(torch.uint8))
            return 0
        dtype, shape = dtype_from_name(saved.dtype), saved.shape
        reads.read_chunks(rank, saved, 0, n, _aligned_empty(saved.nbytes),
                          then=lambda buf: dst.copy_(buf.view(dtype).view(shape)))
        return saved.nbytes

    def _read_global(self, target: Item, dst: torch.Tensor, reads: _Reads) -> int:
        """Fill the target shard `dst` (box target.global_offset + dst.shape) from every saved shard it overlaps."""
        shards = self.global_index().get(target.name)
        if not shards:
            raise CheckpointError(f"checkpoint {self.path!r} has no tensor named {target.name!r}")
        t_off, t_shape = tuple(target.global_offset), tuple(dst.shape)
        covered, staged = 0, 0
        for shard in shards:
            if shard.global_shape != tuple(target.global_shape) or shard.dtype != dtype_name(dst.dtype):
                raise CheckpointError(
                    f"checkpoint {self.path!r}: {target.name!r} is {shard.dtype} with global shape "
                    f"{shard.global_shape}, the target wants {dtype_name(dst.dtype)} {tuple(target.global_shape)}")
            try:
                box = _overlap(t_off, t_shape, shard.global_offset, shard.shape)
            except TypeError as e:  # a forged index; the item itself is validated below only if it overlaps
                raise CheckpointCorruptError(f"checkpoint {self.path!r}: shard {shard.id!r} of rank {shard.rank} "
                                             f"has a malformed box: {e}") from None
            if box is None:
                continue
            rank, saved = shard.rank, self.shard_item(shard)
            covered += _volume(box[1])
            if tuple(saved.global_offset) == t_off and tuple(saved.shape) == t_shape:
                staged += self._read_whole(rank, saved, dst, reads)
                continue
            staged += self._read_overlap(rank, saved, box, t_off, dst, reads)
        if covered != _volume(t_shape):
            raise CheckpointError(f"checkpoint {self.path!r} does not cover {target.name!r} at offset {t_off} "
                                  f"shape {t_shape}: {covered} of {_volume(t_shape)} elements saved")
        return staged

    def _read_overlap(self, rank, saved: Item, box, t_off, dst, reads) -> int:
        """Read the rows of `saved` that hold `box`, widened to whole checksum chunks, then copy the box."""
        (b_off, b_shape), s_off, s_shape = box, tuple(saved.global_offset), tuple(saved.shape)
        dtype = dtype_from_name(saved.dtype)
        esize = torch.empty((), dtype=dtype).element_size()
        row_bytes = esize * _volume(s_shape[1:])
        r0 = b_off[0] - s_off[0]
        r1 = r0 + b_shape[0]
        cb = saved.chunk_bytes or saved.nbytes
        first, last = r0 * row_bytes // cb, -(-(r1 * row_bytes) // cb)
        base = first * cb
        end = min(last * cb, saved.nbytes)
        buf = _aligned_empty(end - base)

        def place(buf):
            rows = buf[r0 * row_bytes - base:r1 * row_bytes - base].view(dtype).view((r1 - r0,) + s_shape[1:])
            src = rows[(slice(None),) + tuple(slice(o - so, o - so + n) for o, so, n in
                                               zip(b_off[1:], s_off[1:], b_shape[1:]))]
            dst[tuple(slice(o - to, o - to + n) for o, to, n in zip(b_off, t_off, b_shape))].copy_(src)
        reads.read_chunks(rank, saved, first, last, buf, then=place)
        return end - base


class Shard(NamedTuple):
    """One written global item as the index lists it, before validation."""

    rank: int
    id: str
    kind: str
    dtype: str | None
    shape: tuple
    global_shape: tuple
    global_offset: tuple


def _writable(t: torch.Tensor) -> torch.Tensor:
    """The template tensor itself, unless it cannot be written in place (an expanded view): then a new one."""
    if any(st == 0 and n > 1 for st, n in zip(t.stride(), t.shape)):
        return torch.empty(t.shape, dtype=t.dtype, device=t.device)
    return t


def _overlap(a_off, a_shape, b_off, b_shape):
    if len(a_off) != len(b_off):
        return None
    off, shape = [], []
    for ao, an, bo, bn in zip(a_off, a_shape, b_off, b_shape):
        lo, hi = max(ao, bo), min(ao + an, bo + bn)
        if hi <= lo:
            return None
        off.append(lo)
        shape.append(hi - lo)
    return tuple(off), tuple(shape)


def _volume(shape) -> int:
    v = 1
    for s in shape:
        v *= s
    return v
