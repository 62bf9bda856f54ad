"""Restart from memory: which iteration every rank can load, and the recovery of the parts a node lacks.

Collective over the default group: every rank lists the parts its node holds; the newest iteration whose part
of every rank is held somewhere (and that is newer than storage's) wins; a part missing from a rank's node (a
replaced node) is sent by a rank whose node holds a replica; every rank verifies its part (every checksum)
before anything is loaded, and if one cannot, all fall back to storage together. Every case where memory is
not used, or a part was recovered, is told in a notice.
"""
from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from ..engine import CheckpointEngine
from ..errors import CheckpointError
from ..save_root import published
from ..storage import SharedMemoryStorage
from ..verifier import CheckpointVerifier
from .identity import read_owner
from .notices import notice
from .node_paths import NodePaths, rank_of
from .replication import receive

log = logging.getLogger(__name__)

Holders = dict[tuple[int, int], list[int]]  # (part's rank, iteration) -> the ranks whose node holds it


def held_parts(storage: SharedMemoryStorage, paths: NodePaths, owner: dict) -> dict[int, list[int]]:
    """rank -> the published iterations of its parts this node holds; nothing when `owner` did not write them."""
    if read_owner(storage, paths.job_file) != owner:
        return {}
    held = {}
    for name in storage.list(paths.node_dir):
        rank = rank_of(name)
        if rank is not None and (its := published(storage, paths.rank_dir(rank))):
            held[rank] = its
    return held


def choose(*, storage: SharedMemoryStorage, paths: NodePaths, nodes: tuple[int, ...], rank: int, keep: int,
           engine: CheckpointEngine, held: dict[int, list[int]], newer_than: int | None) -> str | None:
    """The directory of this rank's part of the newest memory checkpoint that every rank can load and verify and
    that is newer than storage's `newer_than`; None when storage is the one to load."""
    everyone: list = [None] * len(nodes)
    dist.all_gather_object(everyone, held)
    holders: Holders = {}
    for r, held_by_r in enumerate(everyone):
        for part, its in held_by_r.items():
            for it in its:
                holders.setdefault((part, it), []).append(r)
    best = _newest_complete(holders, len(nodes), newer_than)
    if best is None:
        return None
    _recover_missing(best, holders, nodes=nodes, storage=storage, paths=paths, rank=rank, keep=keep)
    path = paths.part(rank, best)
    if not _verified_everywhere(engine, path, rank):
        notice(f"memory checkpoint of iteration {best} failed verification on some rank: loading from storage "
               f"instead")
        return None
    return path


def _newest_complete(holders: Holders, world_size: int, newer_than: int | None) -> int | None:
    """The newest iteration whose part of every rank is held somewhere and that is newer than `newer_than`; when
    there is none but the tier had something, a notice says why memory is not used."""
    complete = sorted({it for (_, it) in holders if all((p, it) in holders for p in range(world_size))},
                      reverse=True)
    best = next((it for it in complete if newer_than is None or it > newer_than), None)
    if best is None and holders:
        newest = max(it for _, it in holders)
        why = (f"storage's iteration {newer_than} is as new" if complete and newer_than is not None
               else "no iteration has every rank's part")
        notice(f"memory tier has checkpoints up to iteration {newest}, not used: {why}")
    return best


def _recover_missing(iteration: int, holders: Holders, *, nodes: tuple[int, ...], storage: SharedMemoryStorage,
                     paths: NodePaths, rank: int, keep: int) -> None:
    """Parts of `iteration` missing from a rank's node are sent to it by the first rank whose node holds them
    (the same plan on every rank, point-to-point over the default group)."""
    for part in range(len(nodes)):
        if nodes[part] in {nodes[r] for r in holders[(part, iteration)]}:
            continue
        sender = holders[(part, iteration)][0]
        if rank == sender:
            index, data = storage.part(paths.part(part, iteration))
            dist.send(torch.tensor([len(index), data.numel()], dtype=torch.int64), part)
            dist.send(torch.frombuffer(bytearray(index), dtype=torch.uint8), part)
            dist.send(data, part)
        elif rank == part:
            sizes = torch.zeros(2, dtype=torch.int64)
            dist.recv(sizes, sender)
            index, data = (torch.empty(int(n), dtype=torch.uint8) for n in sizes)
            dist.recv(index, sender)
            dist.recv(data, sender)
            receive(storage, paths.part(rank, iteration), bytes(index.numpy()), data, keep)
            notice(f"rank {part}: memory checkpoint of iteration {iteration} recovered from rank {sender}'s "
                   f"replica (node {nodes[sender]})", any_rank=True)


def _verified_everywhere(engine: CheckpointEngine, path: str, rank: int) -> bool:
    """Whether every rank's part reads back with every checksum right (agreed by an all-reduce)."""
    ok = torch.tensor([1], dtype=torch.int32)
    try:
        CheckpointVerifier(engine.checkpoint(path)).verify(0)
    except (CheckpointError, OSError) as e:
        log.warning("rank %d: memory checkpoint %s does not verify: %s", rank, path, e)
        ok.zero_()
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    return bool(ok.item())

