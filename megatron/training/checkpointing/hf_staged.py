"""--save-hf's weights taken from what the save staged (`SaveHandle.kept`): no second device-to-host copy, no read
back from storage.

Each rank kept the model weights it wrote: its TP / PP / EP pieces. Which rank holds which piece is gathered from
the kept items themselves (`layout`, on the export's group), not read from the checkpoint's index, so an export
reads no file of the checkpoint and --ckpt-keep-last may retire it before the export starts. The export's plan
(the offline tool's, `tools.hf.export.plan_source`) puts each transformers tensor in a safetensors file, and file
k's rank (k mod world) needs the megatron-core units (a layer, a layer's expert) its tensors are split from. From
the pieces and the plan alone every rank computes the same schedule: for each unit in plan order, each kept piece
of it goes to each rank whose files need it, one message with its own tag, over a gloo group of the export's own
(never the training thread's). A rank posts all its sends at once (views of its kept bytes, nothing copied), then
receives unit by unit as the tool's writer asks for them, and assembles each unit as the tool's reader assembles
it from the checkpoint: the same tensors, so the same bytes.
"""
from __future__ import annotations

import collections
from typing import NamedTuple

import torch

from datastates import Box, CheckpointError, dtype_from_name


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


class StagedSource:
    """The export source interface of `tools.hf` (`tensors`, `args()`, `path`, `read(name, index)`, `close`) over
    the ranks' kept weights: `start(plan, shards)` on every rank, then `read` the units of this rank's files.
    `pieces`: every rank's `layout`, in rank order (the same on every rank)."""

    def __init__(self, ckpt_dir: str, kept, pieces: list[Piece], saved_args, rank: int, world_size: int, group):
        self.path, self._kept, self._args = ckpt_dir, kept, saved_args
        self.rank, self.world_size, self.group = rank, world_size, group
        self._pieces: dict[str, list] = collections.defaultdict(list)
        self.tensors: dict[str, tuple] = {}
        for shard in pieces:
            self._pieces[shard.name].append(shard)
            self.tensors[shard.name] = (shard.global_shape, dtype_from_name(shard.dtype))
        self._incoming: dict[tuple, collections.deque] = collections.defaultdict(collections.deque)
        self._sends: list = []

    def args(self):
        return self._args

    def _unit(self, name: str, index: tuple) -> Box:
        shape = self.tensors[name][0]
        return Box(tuple(index) + (0,) * (len(shape) - len(index)), (1,) * len(index) + tuple(shape[len(index):]))

    def _overlaps(self, name: str, unit: Box) -> list:
        """(shard, the box of the unit it holds) of every written piece of the unit."""
        return [(s, b) for s in self._pieces[name] if (b := s.box.overlap(unit)) is not None]

    def start(self, plan, shards: list) -> None:
        """Post every send of this rank and note every message it is to receive, in the schedule all ranks share."""
        owner = {e.name: k % self.world_size for k, shard in enumerate(shards) for e in shard}
        tag = 0
        for rule, index in plan.units():
            name, at = rule.megatron, tuple(rule.at) + tuple(index)
            unit = self._unit(name, at)
            wanting = sorted({owner[n] for n in rule.names(index)})
            messages = []
            for shard, box in self._overlaps(name, unit):
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
                self._incoming[(name, at)].append(messages)

    def read(self, name: str, index: tuple = ()) -> torch.Tensor:
        """One unit (as the checkpoint reader's `read`): this rank's own pieces copied, the others received."""
        shape, dtype = self.tensors[name]
        index = tuple(index)
        unit = self._unit(name, index)
        out = torch.empty(unit.shape, dtype=dtype)
        pending = [self._receive(*message) for message in self._incoming[(name, index)].popleft()]
        covered = 0
        for shard, box in self._overlaps(name, unit):
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

    def _receive(self, shard, box: Box, tag: int) -> tuple:
        """(the receive posted, its buffer, the box it fills)."""
        data = torch.empty(box.volume() * dtype_from_name(shard.dtype).itemsize, dtype=torch.uint8)
        return torch.distributed.irecv(data, shard.rank, group=self.group, tag=tag), data, box

    def close(self) -> None:
        """Take what was sent to this rank and not read (an export that stopped early: no sender waits on it), wait
        for every send, and give the kept bytes back."""
        try:
            for messages in self._incoming.values():
                for pending in messages:
                    for message in pending:
                        self._receive(*message)[0].wait()
            for work, _ in self._sends:
                work.wait()
        finally:
            self._incoming.clear()
            self._sends = []
            self._kept.release()
