"""--save-hf's weights taken from what the save staged (`SaveHandle.kept`): no second device-to-host copy, no read
back from storage.

Each rank kept the model weights it wrote: its TP / PP / EP pieces. Which rank holds which piece is gathered from
the kept items themselves (`layout`, on the export's group), not read from the checkpoint's index, so an export
reads no file of the checkpoint and --ckpt-keep-last may retire it before the export starts. The export's plan
(the offline tool's, `datastates.hf.export.plan_source`) puts each transformers tensor in a safetensors file, and a
file's rank (the one that keeps most of its bytes, as many files a rank as round robin gives) needs the
megatron-core units (a layer, a layer's expert) its tensors are split from. From the pieces and the plan alone
every rank computes the same schedule: for each unit in plan order, each kept piece of it goes to each rank whose
files need it, one message with its own tag, over a gloo group of the export's own (never the training thread's).
A rank posts all its sends at once (views of its kept bytes, nothing copied), then receives unit by unit in the
writer's order, the next unit's receives posted before this one is written, and assembles each unit as the tool's
reader assembles it from the checkpoint: the same tensors, so the same bytes.
"""
from __future__ import annotations

import collections
from typing import NamedTuple

import torch

from datastates import Box, CheckpointError, aligned_empty, dtype_from_name


class Piece(NamedTuple):
    """A kept item of `rank`: what the checkpoint's index lists of it (picklable: gathered to every rank)."""
    rank: int
    id: str
    name: str
    dtype: str
    box: Box
    global_shape: tuple


def layout(kept, rank: int) -> list[Piece]:
    """This rank's kept pieces."""
    return [Piece(rank, it.id, it.name, it.dtype, Box(tuple(it.global_offset or ()), tuple(it.shape or ())),
                  tuple(it.global_shape or ())) for it in kept.items()]


class Pieces:
    """Every rank's kept pieces, by tensor: which hold a megatron-core unit, and which rank writes each file."""

    def __init__(self, pieces: list[Piece]):
        self.by_name: dict[str, list[Piece]] = collections.defaultdict(list)
        self.tensors: dict[str, tuple] = {}  # name: (global shape, dtype)
        # a stacked tensor's pieces by their first index (a layer), and those that span more than one
        self._by_first: dict[str, dict[int, list[Piece]]] = collections.defaultdict(
            lambda: collections.defaultdict(list))
        self._spanning: dict[str, list[Piece]] = collections.defaultdict(list)
        for piece in pieces:
            self.by_name[piece.name].append(piece)
            self.tensors[piece.name] = (piece.global_shape, dtype_from_name(piece.dtype))
            if piece.box.shape and piece.box.shape[0] == 1:
                self._by_first[piece.name][piece.box.offset[0]].append(piece)
            else:
                self._spanning[piece.name].append(piece)

    def unit(self, name: str, index: tuple) -> Box:
        """The box of the megatron-core unit `index` (a layer, a layer's expert) of tensor `name`."""
        shape = self.tensors[name][0]
        return Box(tuple(index) + (0,) * (len(shape) - len(index)), (1,) * len(index) + tuple(shape[len(index):]))

    def overlaps(self, name: str, unit: Box) -> list:
        """(piece, the box of the unit it holds) of every written piece of the unit."""
        near = self._by_first[name].get(unit.offset[0], []) + self._spanning[name] \
            if unit.shape and unit.shape[0] == 1 else self.by_name[name]
        return [(p, b) for p in near if (b := p.box.overlap(unit)) is not None]

    def owners(self, plan, shards: list, world_size: int) -> list[int]:
        """The rank that writes each file: as many files a rank as round robin gives (within one), each where most
        of the bytes its units are made of are kept already, so that the fewest bytes pass between ranks (PP stages
        write their own layers; DP replicas' weights are spread over the ranks by the save). The same on every
        rank: from the plan and the gathered pieces alone."""
        return balanced_owners(self.held(plan, shards), len(shards), world_size)

    def held(self, plan, shards: list, by=lambda piece: piece.rank) -> dict:
        """{(file, `by` of a piece): bytes of the file's units that these pieces hold} (by rank, unless told)."""
        file_of = {e.name: k for k, shard in enumerate(shards) for e in shard}
        out = collections.defaultdict(int)
        for rule, index in plan.units():
            name = rule.megatron
            if name not in self.tensors:
                continue
            unit = self.unit(name, tuple(rule.at) + tuple(index))
            for k in {file_of[x] for x in rule.names(index) if x in file_of}:
                for piece, box in self.overlaps(name, unit):
                    out[(k, by(piece))] += box.volume() * self.tensors[name][1].itemsize
        return out


def balanced_owners(held: dict, n: int, ranks: int) -> list[int]:
    """Each of `n` files' rank: as many files a rank as round robin gives (within one), each where most of its
    bytes are (`held`: {(file, rank): bytes}, largest first; ties: lowest file, then rank); a file with none on a
    rank with room goes to the lowest rank with room, so that such files fall in runs of consecutive ones."""
    low, extra = divmod(n, ranks)  # every rank takes `low` files, `extra` of the ranks one more
    count, owners = [0] * ranks, [None] * n

    def room(r: int) -> bool:
        return count[r] < low or (count[r] == low and sum(c > low for c in count) < extra)

    def take(k: int, r: int) -> None:
        owners[k], count[r] = r, count[r] + 1
    for (k, r), _ in sorted(held.items(), key=lambda kv: (-kv[1], kv[0])):
        if owners[k] is None and room(r):
            take(k, r)
    for k in range(n):
        if owners[k] is None:
            take(k, next(r for r in range(ranks) if room(r)))
    return owners


class StagedSource:
    """The export source interface of `datastates.hf` (`tensors`, `args()`, `path`, `read(name, index)`, `close`) over
    the ranks' kept weights: `start(plan, shards)` on every rank, then `read` the units of this rank's files.
    `pieces`: every rank's `layout`, in rank order (the same on every rank)."""

    def __init__(self, ckpt_dir: str, kept, pieces: list[Piece], saved_args, rank: int, world_size: int, group):
        self.path, self._kept, self._args = ckpt_dir, kept, saved_args
        self.rank, self.world_size, self.group = rank, world_size, group
        self._pieces = Pieces(pieces)
        self.tensors = self._pieces.tensors
        self._incoming: collections.deque = collections.deque()  # ((name, unit index), its messages): read order
        self._posted = None  # ((name, unit index), its receives posted): the unit read next
        self._sends: list = []
        self.owners: list[int] = []  # each file's rank (`start`)
        self.received = 0  # bytes of other ranks' pieces this rank received

    def args(self):
        return self._args

    def start(self, plan, shards: list) -> None:
        """Choose each file's rank (`owners`), post every send of this rank, note every message it is to receive
        in the schedule all ranks share, and post the first unit's receives."""
        self.owners = self._pieces.owners(plan, shards, self.world_size)
        owner = {e.name: self.owners[k] for k, shard in enumerate(shards) for e in shard}
        tag = 0
        for rule, index in plan.units():
            name, at = rule.megatron, tuple(rule.at) + tuple(index)
            unit = self._pieces.unit(name, at)
            wanting = sorted({owner[n] for n in rule.names(index)})
            messages = []
            for shard, box in self._pieces.overlaps(name, unit):
                for dst in wanting:
                    if shard.rank == dst:
                        continue
                    if shard.rank == self.rank:
                        data = self._kept.tensor(shard.id)[box.index(shard.box.offset)].contiguous()
                        data = data.reshape(-1).view(torch.uint8)
                        self._sends.append((torch.distributed.isend(data, dst, group=self.group, tag=tag), data))
                    elif dst == self.rank:
                        messages.append((shard, box, tag))
                    tag += 1
            if self.rank in wanting:
                self._incoming.append(((name, at), messages))
        self._post_next()  # the first unit's receives

    def read(self, name: str, index: tuple = ()) -> torch.Tensor:
        """One unit (as the checkpoint reader's `read`): this rank's own pieces copied, the others received; the
        next unit's receives are posted before this one is assembled, so that its bytes travel while this one is
        written. A unit stays valid after the next read (kept pages, or a tensor of its own), until `close`."""
        shape, dtype = self.tensors[name]
        index = tuple(index)
        unit = self._pieces.unit(name, index)
        key, pending = self._posted or (None, [])
        if key != (name, index):
            raise CheckpointError(f"{self.path!r}: unit {index} of {name!r} read out of the plan's order")
        self._posted = None
        self._post_next()
        overlaps = self._pieces.overlaps(name, unit)
        if not pending and len(overlaps) == 1 and overlaps[0][0].rank == self.rank and overlaps[0][0].box == unit:
            # the unit is one piece this rank kept: its pages, not a copy (the export's splits change nothing in place)
            return self._kept.tensor(overlaps[0][0].id).reshape(shape[len(index):])
        out = aligned_empty(unit.volume() * dtype.itemsize).view(dtype).reshape(unit.shape)
        covered = 0
        for shard, box in overlaps:
            covered += box.volume()
            if shard.rank == self.rank:
                out[box.index(unit.offset)] = self._kept.tensor(shard.id)[box.index(shard.box.offset)]
        if covered != unit.volume():
            raise CheckpointError(f"{self.path!r}: the written pieces of {name!r} cover {covered} of the "
                                  f"{unit.volume()} elements of its unit {index}")
        for work, data, box in pending:
            work.wait()
            out[box.index(unit.offset)] = data.view(dtype).reshape(box.shape)
        return out.reshape(shape[len(index):])

    def _post_next(self) -> None:
        """Post the receives of the next unit this rank reads (`_posted`), if there is one."""
        if self._incoming:
            key, messages = self._incoming.popleft()
            self._posted = (key, [self._receive(*message) for message in messages])

    def _receive(self, shard, box: Box, tag: int) -> tuple:
        """(the receive posted, its buffer, the box it fills)."""
        data = torch.empty(box.volume() * dtype_from_name(shard.dtype).itemsize, dtype=torch.uint8)
        self.received += data.numel()
        return torch.distributed.irecv(data, shard.rank, group=self.group, tag=tag), data, box

    def close(self) -> None:
        """Take what was sent to this rank and not read (an export that stopped early: no sender waits on it), wait
        for every send, and give the kept bytes back."""
        try:
            if self._posted is not None:
                for work, _, _ in self._posted[1]:
                    work.wait()
            for _, messages in self._incoming:
                for message in messages:
                    self._receive(*message)[0].wait()
            for work, _ in self._sends:
                work.wait()
        finally:
            self._incoming.clear()
            self._posted = None
            self._sends = []
            self._kept.release()
