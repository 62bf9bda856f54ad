"""The public reader: one checkpoint read by name, whatever layout wrote it (the tools, users' scripts).

Global tensors are read as boxes of their global shape, assembled from whichever ranks' shards hold them; global
objects by name; the common state as rank 0 saved it, less its sharded part. Every chunk's crc32c is verified,
and each read takes a `Problems` to collect damage instead of stopping at the first.
"""
from __future__ import annotations

import copy
import functools
from typing import Any

import torch

from . import format as fmt
from .errors import CheckpointError
from .load_reads import Reads
from .names import common_path
from .open_checkpoint import OpenCheckpoint
from .problems import Problems
from .providers import unflatten
from .schema import Box, Item, Kind, Scope, dtype_from_name


class CheckpointReader:
    """Tensors, objects and the common state of one published checkpoint, by name."""

    def __init__(self, checkpoint: OpenCheckpoint):
        self.checkpoint = checkpoint
        self.path = checkpoint.path

    @classmethod
    def open(cls, path: str, threads: int = 4, staging_bytes: int = 256 << 20) -> "CheckpointReader":
        """A reader of its own, for a process that only reads: the storage `path` names (a checkpoint or a save
        root, whose latest is read) with `threads` readers, host staging of `staging_bytes`; `close()` (or
        leaving a `with` block) frees them."""
        return cls(OpenCheckpoint.standalone(path, threads, staging_bytes))

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.checkpoint.close()

    def tensors(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Every global tensor: name -> (global shape, dtype), from the index alone."""
        return {name: (tuple(shards[0].global_shape), dtype_from_name(shards[0].dtype))
                for name, shards in self.checkpoint.global_index().items() if shards[0].kind == Kind.TENSOR}

    def objects(self) -> list[str]:
        """The names of every global object, sorted."""
        return sorted(name for name, shards in self.checkpoint.global_index().items()
                      if shards[0].kind == Kind.OBJECT)

    @torch.no_grad()
    def tensor(self, name: str, offset: tuple[int, ...] | None = None, shape: tuple[int, ...] | None = None,
               out: torch.Tensor | None = None, problems: Problems | None = None) -> torch.Tensor:
        """The box (`offset`, `shape`) of the global tensor `name`, whole by default, assembled from whichever
        ranks' shards hold it, every chunk's crc32c verified: a new CPU tensor, or `out` filled (a buffer a
        reader of many boxes reuses). Where no shard holds part of a new tensor, that part is zero, not whatever the
        allocator left there, so two reads of one checkpoint never differ. With `problems`, a damaged read is
        reported there and the box's damaged part is undefined."""
        found = self.tensors().get(name)
        if found is None:
            raise CheckpointError(f"checkpoint {self.path!r} has no tensor named {name!r}")
        global_shape, dtype = found
        box = _box_within(name, global_shape, offset, shape)
        dst = out if out is not None else torch.zeros(box.shape, dtype=dtype)
        if tuple(dst.shape) != box.shape or dst.dtype != dtype:
            raise ValueError(f"out is {dst.dtype} {tuple(dst.shape)}, the box of {name!r} is {dtype} {box.shape}")
        with Reads(self.checkpoint, problems) as reads:
            for read in self.checkpoint.plan_box(name, box, global_shape, dst):
                self.checkpoint.execute(read, dst, reads)
        return dst

    def object(self, name: str, problems: Problems | None = None) -> Any:
        """The global object `name` (rank 0's copy when it wrote one), verified and unpickled. With `problems`, a
        damaged one is reported there and None is returned."""
        return self.checkpoint.read_object(*self.checkpoint.global_object(name, 0), problems)

    @torch.no_grad()
    def common(self, problems: Problems | None = None) -> Any:
        """The common state: the state rank 0 saved, less its sharded part. Its common values (the objects
        `names.common_name(path)`, which `datastates.megatron.Common` saves) and its rank-local items stay in the
        saved structure; global tensors, other global objects and the containers left empty by dropping them go.
        With `problems`, a damaged value is reported there and is None."""
        ckpt = self.checkpoint
        own = ckpt.items(0)
        skeleton = ckpt.skeleton(0)
        wanted = [item for item in own.values() if _in_common(item)]
        values: dict[str, Any] = {}
        with Reads(ckpt, problems) as reads:
            for item in wanted:
                if item.kind == Kind.OBJECT:
                    saved_rank, saved = ckpt.saved_object(item, own, 0, False)
                    ckpt.queue_object(saved_rank, saved, reads, ckpt.unpickler(
                        saved_rank, saved, reads.problems, functools.partial(values.__setitem__, item.id)))
                else:
                    values[item.id] = dst = torch.empty(item.shape, dtype=dtype_from_name(item.dtype))
                    ckpt.read_whole(0, item, dst, reads)
        ids, dropped = {item.id for item in wanted}, object()  # dropped: a sharded item, until pruned
        return _pruned(unflatten(skeleton, lambda key: values.get(key) if key in ids else dropped), dropped)


def _box_within(name: str, global_shape: tuple, offset, shape) -> Box:
    """The box (`offset`, `shape`) of the tensor `name`, checked to lie within its global shape; by default from
    `offset` (default the origin) to the end of every axis."""
    offset = tuple(offset) if offset is not None else (0,) * len(global_shape)
    shape = tuple(shape) if shape is not None else tuple(g - o for g, o in zip(global_shape, offset))
    if not (len(offset) == len(shape) == len(global_shape)
            and all(0 <= o and 0 <= n and o + n <= g for o, n, g in zip(offset, shape, global_shape))):
        raise ValueError(f"box at offset {offset} of shape {shape} is not within {name!r} of global shape "
                         f"{tuple(global_shape)}")
    return Box(offset, shape)


def _in_common(item: Item) -> bool:
    """Whether rank 0's `item` is part of the common state: a rank-local item or a common value."""
    return item.id != fmt.SKELETON_ID and (item.scope == Scope.LOCAL or (
        item.kind == Kind.OBJECT and common_path(item.name) is not None))


def _pruned(state: Any, dropped: object) -> Any:
    """`state` without the values that are `dropped`, nor the containers of it that held only such values."""
    if not isinstance(state, (dict, list, tuple)):
        return state
    kept = []
    for key, value in state.items() if isinstance(state, dict) else enumerate(state):
        pruned = _pruned(value, dropped)
        if pruned is not dropped and not (isinstance(value, (dict, list, tuple)) and value and not pruned):
            kept.append((key, pruned))
    if isinstance(state, dict):
        out = copy.copy(state)  # of the same mapping type (an OrderedDict, a defaultdict)
        out.clear()
        out.update(kept)
        return out
    values = [v for _, v in kept]
    if isinstance(state, list):
        return values
    return type(state)(*values) if hasattr(state, "_fields") else tuple(values)
