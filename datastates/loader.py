"""The engine's load: a saved state rebuilt, or a template filled in place from whatever layout was saved.

A template's tensors are read through the load plan (`load_plan`), resharded from the saved shards they overlap;
its objects are unpickled. With an `Exchange` (--ckpt-fully-parallel-load), every rank of its group loads at once
and each saved byte several ranks want is read by one of them and passed to the others. A load stops at the
first problem unless it is given a `Problems` to collect them in.
"""
from __future__ import annotations

import functools
from typing import Any

import torch

from . import format as fmt
from .errors import CheckpointError
from .exchange import Exchange
from .load_plan import BoxRead, plan_whole
from .load_reads import Reads
from .open_checkpoint import OpenCheckpoint
from .problems import Problems
from .providers import ProviderRegistry, unflatten
from .schema import Box, Item, Kind, Scope, dtype_from_name


class CheckpointLoader:
    """Loads of one open checkpoint into the states the `registry`'s providers flatten."""

    def __init__(self, checkpoint: OpenCheckpoint, registry: ProviderRegistry):
        self.checkpoint = checkpoint
        self.registry = registry

    @torch.no_grad()
    def load(self, rank: int, template: Any = None, problems: Problems | None = None,
             exchange: Exchange | None = None) -> Any:
        """The state `rank` saved, or `template` filled in place from any layout. With `problems`, a damaged
        read is reported there and the load goes on: the damaged part of its target is undefined (an object
        is None). With `exchange` (a template's load, on every rank of its group at once) each saved byte
        that several ranks want is read by one of them and passed to the others."""
        ckpt = self.checkpoint
        values: dict[str, Any] = {}
        get = values.__getitem__ if problems is None else values.get
        problems = problems if problems is not None else Problems.stop()
        try:
            skeleton, tensors, objects = self._plan(rank, template, values, problems, exchange is not None)
        except CheckpointError as e:
            if exchange is None:
                raise
            exchange.agree(ckpt, [], [], e)  # raises on every rank, naming this one
        if exchange is None:
            with Reads(ckpt, problems) as reads:
                for read, dst in tensors:
                    ckpt.execute(read, dst, reads)
                for saved_rank, item, take in objects:
                    ckpt.queue_object(saved_rank, item, reads, take)
        else:
            plan, error = exchange.agree(ckpt, tensors, objects), None
            try:
                with Reads(ckpt, problems) as reads:
                    for read, dst, span in plan.local_tensors:
                        ckpt.execute(read, dst, reads, span)
                    for saved_rank, item, take in plan.local_objects:
                        ckpt.queue_object(saved_rank, item, reads, take)
            except CheckpointError as e:
                error = e
            exchange.move(ckpt, plan, error)
        return unflatten(skeleton, get)

    def _plan(self, rank: int, template: Any, values: dict, problems: Problems, shared: bool):
        """(skeleton, tensor reads, object reads) of a load; `values` receives each target (an object once it is
        read). `shared`: every rank reads a global object from the same saved copy (the exchange passes it)."""
        ckpt = self.checkpoint
        # a rank beyond the saved world (loading into more ranks) can still fill global items
        own = ckpt.items(rank) if template is None or rank < ckpt.world_size else {}
        if template is None:
            skeleton = ckpt.skeleton(rank)
            wanted = [(it, torch.empty(it.shape, dtype=dtype_from_name(it.dtype)) if it.kind == Kind.TENSOR else None)
                      for it in own.values() if it.id != fmt.SKELETON_ID]
        else:
            skeleton, entries = self.registry.flatten(template)
            wanted = [(e.item, _writable(e.source) if e.item.kind == Kind.TENSOR else None) for e in entries]
        tensors: list[tuple[BoxRead, torch.Tensor]] = []
        objects = []
        for target, dst in wanted:
            if target.kind == Kind.OBJECT:
                saved_rank, item = ckpt.saved_object(target, own, rank, shared)
                objects.append((saved_rank, item, ckpt.unpickler(
                    saved_rank, item, problems, functools.partial(values.__setitem__, target.id))))
                continue
            values[target.id] = dst
            if target.scope == Scope.GLOBAL:
                reads = ckpt.plan_box(target.name, Box(tuple(target.global_offset), tuple(dst.shape)),
                                      target.global_shape, dst)
            else:
                reads = plan_whole(rank, self._saved_tensor(target, own, rank))
            tensors.extend((read, dst) for read in reads)
        return skeleton, tensors, objects

    def _saved_tensor(self, target: Item, own: dict[str, Item], rank: int) -> Item:
        saved = self.checkpoint.item(own, target.id, rank)
        if (saved.kind, saved.dtype, saved.shape) != (target.kind, target.dtype, target.shape):
            raise CheckpointError(
                f"checkpoint {self.checkpoint.path!r} item {target.id!r} is {saved.kind} {saved.dtype} "
                f"{saved.shape}, the target wants {target.kind} {target.dtype} {target.shape}")
        return saved


def _writable(t: torch.Tensor) -> torch.Tensor:
    """The template tensor itself, unless it cannot be written in place (an expanded view): then a new one."""
    if any(st == 0 and n > 1 for st, n in zip(t.stride(), t.shape)):
        return torch.empty(t.shape, dtype=t.dtype, device=t.device)
    return t
