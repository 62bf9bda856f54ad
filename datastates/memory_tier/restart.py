"""Restart from memory: which iteration every rank can load, and the recovery of the parts a node lacks.

Collective over the default group: every rank lists the parts its node holds; the newest iteration whose part
of every rank is held somewhere (and that is newer than storage's) wins; a part missing from a rank's node (a
replaced node) is sent by a rank whose node holds a replica; every rank verifies its part (every checksum)
before anything is loaded, and if one cannot, all fall back to storage together. Every case where memory is
not used, or a part was recovered, is told in a notice.

After a change of layout (`choose_before`), the same over the parts set apart in the old one: every node gets
every old rank's part of the chosen iteration, verifies them, and links them into one checkpoint that its ranks
read like a storage checkpoint of the old layout (resharded into the new one).
"""
from __future__ import annotations

import json
import logging

import torch
import torch.distributed as dist

from .. import format as fmt
from ..engine import CheckpointEngine
from ..errors import CheckpointError
from ..paths import data_file, join, parent
from ..storage import SharedMemoryStorage
from ..verifier import CheckpointVerifier
from .identity import read_owner
from .notices import notice
from .node_paths import NodePaths, rank_of
from .replication import CHUNK_BYTES, Replica, parts_root, read_part

log = logging.getLogger(__name__)

Holders = dict[tuple[int, int], list[int]]  # (part's rank, iteration) -> the ranks whose node holds it


def held_parts(storage: SharedMemoryStorage, paths: NodePaths, owner: dict) -> dict[int, list[int]]:
    """rank -> the published iterations of its parts this node holds; nothing when `owner` did not write them."""
    if read_owner(storage, paths.job_file) != owner:
        return {}
    return node_parts(storage, paths)


def node_parts(storage: SharedMemoryStorage, paths: NodePaths) -> dict[int, list[int]]:
    """rank -> the published iterations of its parts under this node's directory, whoever wrote them."""
    held = {}
    for name in storage.list(paths.node_dir):
        rank = rank_of(name)
        if rank is not None and (its := parts_root(storage, paths.rank_dir(rank)).published()):
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
    missing = [(part, holders[(part, best)][0], part) for part in range(len(nodes))
               if nodes[part] not in {nodes[r] for r in holders[(part, best)]}]
    _send_parts(missing, best, nodes=nodes, storage=storage, paths=paths, rank=rank, keep=keep)
    path = paths.part(rank, best)
    if not _verified_everywhere(engine, [path], rank, best):
        return None
    return path


def choose_before(*, storage: SharedMemoryStorage, paths: NodePaths, nodes: tuple[int, ...], rank: int, keep: int,
                  engine: CheckpointEngine, newer_than: int | None, merge: bool) -> str | None:
    """After a change of layout: the newest iteration of the parts set apart under `paths` (the layout before)
    of which every old rank's part is held by some node now and that is newer than storage's `newer_than`; each
    node is sent the parts it lacks, verifies them (its ranks share the work) and its first rank (`merge`) makes
    them one checkpoint, whose directory is returned (None: storage is the one to load)."""
    owner = read_owner(storage, paths.job_file)
    everyone: list = [None] * len(nodes)
    dist.all_gather_object(everyone, (owner, held_parts(storage, paths, owner) if owner else {}))
    owners = {json.dumps(o, sort_keys=True) for o, held in everyone if held}
    if len(owners) != 1:  # nothing set apart, or parts of different layouts: storage
        return None
    old = json.loads(owners.pop())
    holders: Holders = {}
    for r, (_, held_by_r) in enumerate(everyone):
        for part, its in held_by_r.items():
            for it in its:
                holders.setdefault((part, it), []).append(r)
    best = _newest_complete(holders, old["world_size"], newer_than)
    if best is None:
        return None
    firsts = {n: min(r for r in range(len(nodes)) if nodes[r] == n) for n in set(nodes)}
    missing = [(part, holders[(part, best)][0], first) for part in range(old["world_size"])
               for n, first in sorted(firsts.items()) if n not in {nodes[r] for r in holders[(part, best)]}]
    _send_parts(missing, best, nodes=nodes, storage=storage, paths=paths, rank=rank, keep=keep)
    dist.barrier()  # a node's first rank received its parts before the node's other ranks verify them
    mine = [r for r in range(len(nodes)) if nodes[r] == nodes[rank]]
    share = [paths.part(p, best) for p in range(old["world_size"]) if p % len(mine) == mine.index(rank)]
    if not _verified_everywhere(engine, share, rank, best):
        return None
    merged = paths.merged(best)
    if merge:
        _merge(storage, paths, old["world_size"], best)
    dist.barrier()  # every node's merged checkpoint is published before any rank reads it
    return merged


def _merge(storage: SharedMemoryStorage, paths: NodePaths, world_size: int, iteration: int) -> None:
    """The node's parts of every rank of `iteration` as one checkpoint: each part's data file linked under its
    rank's name (no copy), and an index of them all."""
    final = paths.merged(iteration)
    root = parts_root(storage, parent(final))
    storage.remove(final)
    partial = root.stage(final)
    indexes = {}
    for part in range(world_size):
        src = paths.part(part, iteration)
        indexes[part] = fmt.read_index(storage, src)
        storage.link(join(src, data_file(0)), join(partial, data_file(part)))
    root.commit(partial, final, fmt.encode_json(fmt.merged_index(indexes, iteration)))


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


def _send_parts(plan: list[tuple[int, int, int]], iteration: int, *, nodes: tuple[int, ...],
                storage: SharedMemoryStorage, paths: NodePaths, rank: int, keep: int) -> None:
    """Each (part, sender, receiver) of `plan`: the sender's node's copy of that rank's part of `iteration` is
    sent to the receiver, whose node lacks it (the same plan on every rank, point-to-point over the default
    group), in pieces of at most CHUNK_BYTES read from the sender's pages and received into the receiver's."""
    for part, sender, receiver in plan:
        if rank == sender:
            index, data = read_part(storage, paths.part(part, iteration))
            dist.send(torch.tensor([len(index), data.numel()], dtype=torch.int64), receiver)
            dist.send(torch.frombuffer(bytearray(index), dtype=torch.uint8), receiver)
            for off in range(0, data.numel(), CHUNK_BYTES):
                dist.send(data[off:off + CHUNK_BYTES], receiver)
        elif rank == receiver:
            sizes = torch.zeros(2, dtype=torch.int64)
            dist.recv(sizes, sender)
            index = torch.empty(int(sizes[0]), dtype=torch.uint8)
            dist.recv(index, sender)
            _receive_part(storage, paths.part(part, iteration), bytes(index.numpy()), int(sizes[1]), sender, keep)
            notice(f"rank {receiver}: memory checkpoint of iteration {iteration} of rank {part} recovered from rank "
                   f"{sender}'s replica (node {nodes[sender]})", any_rank=True)


def _receive_part(storage: SharedMemoryStorage, final: str, index: bytes, nbytes: int, sender: int,
                  keep: int) -> None:
    """`sender`'s pieces of a part, into its replica's pages, published once whole; a refused replica's pieces
    are still received (into one scratch piece), so that the plan's later sends stay in step, then it raises."""
    try:
        replica = Replica(storage, final, index, nbytes)
    except BaseException:
        scratch = torch.empty(min(CHUNK_BYTES, nbytes), dtype=torch.uint8)
        for off in range(0, nbytes, CHUNK_BYTES):
            dist.recv(scratch[:min(CHUNK_BYTES, nbytes - off)], sender)
        raise
    try:
        for off in range(0, nbytes, CHUNK_BYTES):
            dist.recv(replica.pages[off:off + CHUNK_BYTES], sender)
    except BaseException:
        replica.discard()
        raise
    replica.publish(keep)


def _verified_everywhere(engine: CheckpointEngine, parts: list[str], rank: int, iteration: int) -> bool:
    """Whether every rank's `parts` read back with every checksum right (agreed by an all-reduce); when not, a
    notice says storage is loaded instead."""
    ok = torch.tensor([1], dtype=torch.int32)
    for path in parts:
        try:
            CheckpointVerifier(engine.checkpoint(path)).verify(0)
        except (CheckpointError, OSError) as e:
            log.warning("rank %d: memory checkpoint %s does not verify: %s", rank, path, e)
            ok.zero_()
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    if not ok.item():
        notice(f"memory checkpoint of iteration {iteration} failed verification on some rank: loading from storage "
               f"instead")
    return bool(ok.item())

