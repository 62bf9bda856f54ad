"""The node-local memory tier: every rank's newest checkpoints in memory that outlives the training processes.

A software failure, the common case, kills the processes but not the node: their memory tier in `/dev/shm`
survives, and the restart loads from it in seconds instead of from the parallel file system. Each rank saves
its own part as a self-contained checkpoint (same format, checksums and atomic publication as on storage, no
fsync) with its own `CheckpointEngine` on shared-memory storage (`storage.SharedMemoryStorage`): the snapshot is
copied straight into the tier's pages, and a storage save of the same iteration writes from those pages
(`CheckpointEngine.save(pages=)`). The tier keeps the newest `keep` parts. With replication, each part is
also sent to the F-1 peers of the rank's clique on other nodes, so that a node lost entirely is recovered from
its peers' memory.

Layout (one directory per job, so that a job never loads another job's tier; `job.json` says whose it is):

    <base>/<job id>/job.json
    <base>/<job id>/node_00001/rank_00005/iter_0000007/     rank 5's part, held by node 1 (its own or a replica)

Nodes: torchrun's GROUP_RANK / LOCAL_WORLD_SIZE (or Slurm's SLURM_NODEID) name the node of a rank. On one
machine, `DATASTATES_RANKS_PER_NODE=k` simulates nodes of k consecutive ranks, each with a directory of its own.

Replication follows Megatron-LM's cliques: with factor F and jump J, ranks {i, i+J, ..., i+(F-1)J} (within
blocks of F*J ranks) hold each other's parts; J defaults to the ranks per node, so the peers are on other nodes.
The exchange runs on a background thread over a gloo group of the clique, in the order of the saves on every
rank: the training thread never waits on it. A part travels as its index and its data file, and is published
on arrival through the same storage (`SharedMemoryStorage.receive`).

Restart (`choose`, collective): every rank lists the parts its node holds; the newest iteration whose part of
every rank is held somewhere (and that is newer than storage's) wins; a part missing from a rank's node is sent
by a holder; every rank verifies its part (every checksum) before anything is loaded, and if one cannot, all
fall back to storage together.
"""
from __future__ import annotations

import datetime
import hashlib
import json
import logging
import os
import queue
import threading

import torch
import torch.distributed as dist

from . import format as fmt
from .layout import checkpoint_dir, join
from .engine import CheckpointEngine
from .errors import CheckpointError
from .storage import SharedMemoryStorage

log = logging.getLogger(__name__)

JOB_FILE = "job.json"
_STOP = object()


def job_id(save_dir: str | None) -> str:
    """The job a memory tier belongs to: DATASTATES_JOB_ID, else Slurm's job id, else the save directory (a
    restart of the same training run writes to the same place)."""
    explicit = os.environ.get("DATASTATES_JOB_ID") or os.environ.get("SLURM_JOB_ID")
    if explicit:
        return "".join(c if c.isalnum() or c in "-_." else "_" for c in explicit)
    where = os.path.abspath(save_dir) if save_dir else os.getcwd()
    return "save-" + hashlib.sha1(where.encode()).hexdigest()[:16]


def node_of(rank: int, world_size: int) -> tuple[int, int]:
    """(node index, ranks per node) of `rank`."""
    simulated = os.environ.get("DATASTATES_RANKS_PER_NODE")
    if simulated:
        per_node = int(simulated)
        if per_node < 1 or world_size % per_node:
            raise CheckpointError(f"DATASTATES_RANKS_PER_NODE={simulated} does not divide the world size "
                                  f"{world_size}")
        return rank // per_node, per_node
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    node = os.environ.get("GROUP_RANK", os.environ.get("SLURM_NODEID", rank // max(per_node, 1)))
    return int(node), per_node


def cliques(world_size: int, factor: int, jump: int) -> list[list[int]]:
    """Megatron-LM's replication cliques: groups of `factor` ranks `jump` apart."""
    if factor < 1 or jump < 1:
        raise CheckpointError(f"--replication-factor {factor} and --replication-jump {jump} must be positive")
    if world_size % (factor * jump):
        raise CheckpointError(f"--replication-factor {factor} x --replication-jump {jump} = {factor * jump} does "
                              f"not divide the world size {world_size}")
    return [[base + i + k * jump for k in range(factor)]
            for base in range(0, world_size, factor * jump) for i in range(jump)]


def _rank_dir(node_dir: str, rank: int) -> str:
    return join(node_dir, f"rank_{rank:05d}")


_NOTHING = torch.empty(0, dtype=torch.uint8)


class LocalTier:
    """One rank's side of the memory tier of one job."""

    def __init__(self, base_dir: str, job: str, rank: int, world_size: int, layout: list, *, keep: int = 2,
                 replication_factor: int = 1, replication_jump: int | None = None, timeout_s: float = 600.0,
                 **engine_kwargs):
        """Collective when the default group is initialised (every rank builds its tier at the same point).
        `layout` describes how the state is split (e.g. TP, PP, DP sizes): a tier of another layout is
        cleared, never loaded."""
        self.rank, self.world_size, self.keep, self.job = rank, world_size, keep, job
        self.node, per_node = node_of(rank, world_size)
        self.root = join(base_dir, job)
        self.node_dir = join(self.root, f"node_{self.node:05d}")
        self.storage = SharedMemoryStorage()
        self.dir = _rank_dir(self.node_dir, rank)
        self._marker = {"job": job, "world_size": world_size, "layout": list(layout)}
        distributed = dist.is_available() and dist.is_initialized()
        # Every rank's node, as that rank sees it: GROUP_RANK and SLURM_NODEID name the node of the process that
        # reads them, not another rank's
        self._nodes = [node_of(r, world_size)[0] for r in range(world_size)]
        if distributed:
            dist.all_gather_object(self._nodes, self.node)
        stale = self._read_marker() not in (None, self._marker)
        if distributed:
            dist.barrier()  # every rank has read the marker before any rank rewrites it
        if rank == min(r for r in range(world_size) if self.node_of_rank(r) == self.node):
            if stale:
                _notice(f"memory tier {self.node_dir} holds checkpoints of another layout: cleared")
                self.storage.remove_tree(self.node_dir)
            for name in self.storage.list(self.node_dir):
                self.storage.clean_leftovers(join(self.node_dir, name))  # what killed saves left
        if stale or not self.storage.exists(join(self.root, JOB_FILE)):
            self.storage.make_dirs(self.root)
            self.storage.replace_file(join(self.root, JOB_FILE), fmt.encode_json(self._marker))
        if distributed:
            dist.barrier()  # cleared before any rank writes again
        self.storage.make_dirs(self.dir)
        self.engine = CheckpointEngine(rank=0, world_size=1, keep_last=keep, storage=self.storage, **engine_kwargs)
        self._clique, self._group = [rank], None
        if replication_factor > 1:
            jump = replication_jump or per_node
            for members in cliques(world_size, replication_factor, jump):  # every rank makes every group
                group = dist.new_group(members, backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
                if rank in members:
                    self._clique, self._group = members, group
            if {self.node_of_rank(r) for r in self._clique} == {self.node}:
                log.warning("replication clique %s is on one node: a lost node loses every copy (set "
                            "--replication-jump to the ranks per node)", self._clique)
        self._queue: queue.Queue = queue.Queue()
        self._thread = None
        if self._group is not None:
            self._thread = threading.Thread(target=self._replicator, name="ds-replicate", daemon=True)
            self._thread.start()
        self.errors: list[BaseException] = []

    def _read_marker(self) -> dict | None:
        try:
            return json.loads(self.storage.read_bytes(join(self.root, JOB_FILE)))
        except (OSError, ValueError):
            return None

    def node_of_rank(self, rank: int) -> int:
        return self._nodes[rank]

    def path(self, iteration: int) -> str:
        """Where this rank saves its part of `iteration` (give it to `self.engine.save`, then `replicate`)."""
        return checkpoint_dir(self.dir, iteration)

    # ----- replication -----

    def replicate(self, iteration: int, handle) -> None:
        """Send this rank's part of `iteration` to its clique once the save is published (background)."""
        if self._thread is not None:
            self._queue.put((iteration, handle))

    def _replicator(self) -> None:
        while (job := self._queue.get()) is not _STOP:
            iteration, handle = job
            try:
                handle.join()
                mine = self.storage.part(self.path(iteration)) if handle.error is None else (b"", _NOTHING)
                parts = self._exchange(*mine)
                for peer, (index, data) in zip(self._clique, parts):
                    if self.node_of_rank(peer) != self.node and index:  # a rank of this node has it already
                        peer_dir = _rank_dir(self.node_dir, peer)
                        self.storage.make_dirs(peer_dir)
                        self.storage.receive(checkpoint_dir(peer_dir, iteration), index, data, self.keep)
            except BaseException as e:  # noqa: BLE001 - a lost replica costs redundancy, never training
                log.warning("rank %d: replicating the memory checkpoint of iteration %d failed: %s", self.rank,
                            iteration, e)
                self.errors.append(e)

    def _exchange(self, index: bytes, data: torch.Tensor) -> list[tuple[bytes, torch.Tensor]]:
        """Every clique member's part (all-gather of the sizes, then of the indexes and the data, padded)."""
        sizes = [torch.zeros(2, dtype=torch.int64) for _ in self._clique]
        dist.all_gather(sizes, torch.tensor([len(index), data.numel()], dtype=torch.int64), group=self._group)
        indexes = [bytes(b[:int(s[0])].numpy()) for b, s in zip(self._gather(
            torch.frombuffer(bytearray(index), dtype=torch.uint8) if index else _NOTHING, sizes, 0), sizes)]
        datas = [b[:int(s[1])] for b, s in zip(self._gather(data, sizes, 1), sizes)]
        return list(zip(indexes, datas))

    def _gather(self, mine: torch.Tensor, sizes: list[torch.Tensor], which: int) -> list[torch.Tensor]:
        longest = max(int(s[which]) for s in sizes)
        if longest == 0:
            return [_NOTHING] * len(self._clique)
        if mine.numel() != longest:  # all-gather wants one size: pad (parts of one layout rarely differ)
            mine = torch.cat([mine, torch.zeros(longest - mine.numel(), dtype=torch.uint8)])
        out = [torch.empty(longest, dtype=torch.uint8) for _ in self._clique]
        dist.all_gather(out, mine, group=self._group)
        return out

    def drain(self) -> None:
        """Wait until every queued replication is done."""
        if self._thread is not None:
            self._queue.put(_STOP)
            self._thread.join()
            self._thread = None

    # ----- restart -----

    def _inventory(self) -> dict[int, list[int]]:
        """rank -> published iterations this node holds, for this job only."""
        if self._read_marker() != self._marker:
            return {}
        held = {}
        for name in self.storage.list(self.node_dir):
            if name.startswith("rank_") and name[5:].isdigit():
                its = self.storage.published(join(self.node_dir, name))
                if its:
                    held[int(name[5:])] = its
        return held

    def choose(self, newer_than: int | None) -> str | None:
        """Collective over the default group: the directory of this rank's part of the newest memory checkpoint
        that every rank can load and verify and that is newer than storage's `newer_than`; None when storage is
        the one to load (told in a notice when the tier had something)."""
        everyone: list = [None] * self.world_size
        dist.all_gather_object(everyone, (self.node, self._inventory()))
        holders: dict[tuple[int, int], list[int]] = {}
        for r, (node, held) in enumerate(everyone):
            for part, its in held.items():
                for it in its:
                    holders.setdefault((part, it), []).append(r)
        complete = sorted({it for (_, it) in holders
                           if all((p, it) in holders for p in range(self.world_size))}, reverse=True)
        best = next((it for it in complete if newer_than is None or it > newer_than), None)
        if best is None:
            if holders:
                newest = max(it for _, it in holders)
                why = (f"storage's iteration {newer_than} is as new" if complete and newer_than is not None
                       else "no iteration has every rank's part")
                _notice(f"memory tier has checkpoints up to iteration {newest}, not used: {why}")
            return None
        self._fetch_missing(best, everyone, holders)
        path = self.path(best)
        ok = torch.tensor([1], dtype=torch.int32)
        try:
            self.engine.reader(path).verify(0)
        except (CheckpointError, OSError) as e:
            log.warning("rank %d: memory checkpoint %s does not verify: %s", self.rank, path, e)
            ok.zero_()
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        if not ok.item():
            _notice(f"memory checkpoint of iteration {best} failed verification on some rank: loading from "
                    f"storage instead")
            return None
        return path

    def _fetch_missing(self, iteration: int, everyone: list, holders: dict) -> None:
        """Parts of `iteration` missing from a rank's node are sent to it by the first rank whose node holds
        them (the same plan on every rank, point-to-point over the default group)."""
        for part in range(self.world_size):
            if self.node_of_rank(part) in {everyone[r][0] for r in holders[(part, iteration)]}:
                continue
            sender = holders[(part, iteration)][0]
            if self.rank == sender:
                index, data = self.storage.part(checkpoint_dir(_rank_dir(self.node_dir, part), iteration))
                dist.send(torch.tensor([len(index), data.numel()], dtype=torch.int64), part)
                dist.send(torch.frombuffer(bytearray(index), dtype=torch.uint8), part)
                dist.send(data, part)
            elif self.rank == part:
                sizes = torch.zeros(2, dtype=torch.int64)
                dist.recv(sizes, sender)
                index, data = (torch.empty(int(n), dtype=torch.uint8) for n in sizes)
                dist.recv(index, sender)
                dist.recv(data, sender)
                self.storage.receive(self.path(iteration), bytes(index.numpy()), data, self.keep)
                _notice(f"rank {part}: memory checkpoint of iteration {iteration} recovered from rank "
                        f"{sender}'s replica (node {everyone[sender][0]})", any_rank=True)

    # ----- end -----

    def close(self) -> None:
        """Finish the queued replications and stop."""
        self.drain()
        self.engine.close()

    def remove(self) -> None:
        """The job finished: delete this node's tier (after every rank of the node closed its tier)."""
        self.storage.remove_tree(self.node_dir)
        for path in (join(self.root, JOB_FILE), self.root):  # unless another node's directory is there
            self.storage.remove_empty(path)


def _notice(msg: str, any_rank: bool = False) -> None:
    log.info("NOTICE: " + msg, extra={"any_rank": any_rank})


def check_fits(base_dir: str, need_bytes: int) -> None:
    """Fail before any work when the tier cannot fit in the memory file system it lives on."""
    free = SharedMemoryStorage().free_bytes(base_dir)
    if need_bytes > free:
        raise CheckpointError(f"the memory tier needs about {need_bytes / 2**30:.2f} GiB in {base_dir!r} but only "
                              f"{free / 2**30:.2f} GiB are free there: lower --replication-factor, or point "
                              f"--non-persistent-local-ckpt-dir at a larger memory file system")
