"""Replication: every part this rank publishes in memory is sent to the other members of its clique, and theirs
are kept on this node, so that a node lost entirely is recovered from its peers' memory.

The exchange runs on a background thread over a gloo group of the clique, in the order of the saves on every
rank: the training thread never waits on it. A part travels as its index and its data file, read from the
mapped pages and received into the replica's own pages in pieces of at most CHUNK_BYTES (`Replica`: no whole part
held in memory on either side), and is published once whole, refused unless its index describes that data. A failed exchange costs redundancy, never training: it is logged and
kept in `errors`.
"""
from __future__ import annotations

import datetime
import logging
import queue
import threading

import torch
import torch.distributed as dist

from .. import format as fmt
from ..paths import METADATA, data_file, join, parent, partial_dir
from ..errors import CheckpointCorruptError, CheckpointError
from ..save_root import SaveRoot
from ..storage import SharedMemoryStorage
from .node_paths import NodePaths
from .topology import cliques

log = logging.getLogger(__name__)

_STOP = object()
_NOTHING = torch.empty(0, dtype=torch.uint8)
CHUNK_BYTES = 64 << 20  # what one round of an exchange holds per clique member: replication's host memory bound


def parts_root(storage: SharedMemoryStorage, root: str) -> SaveRoot:
    """A directory of the tier holding one rank's parts (or the merged checkpoints): checkpoints published by
    their index, and no tracker (a restart lists every rank's parts)."""
    return SaveRoot(storage, root, pointer=None)


def read_part(storage: SharedMemoryStorage, final: str) -> tuple[bytes, torch.Tensor]:
    """A published part of one rank as it travels: its index, and the bytes of its data file that the index
    describes, mapped from the tier's pages."""
    index = storage.read_bytes(join(final, METADATA))
    return index, storage.mapped(join(final, data_file(0)), fmt.parse_index(index, final).part(0).data_bytes)


class Replica:
    """A part another rank sends, received in pieces straight into this node's pages (`pages`, its data file
    mapped at its full size: no copy of the whole part in memory), then published with its index. Refused before
    anything is written unless its index describes `nbytes` of data."""

    def __init__(self, storage: SharedMemoryStorage, final: str, index: bytes, nbytes: int):
        part = fmt.parse_index(index, final).part(0)
        if part.data_bytes != nbytes:
            raise CheckpointCorruptError(f"replica {final!r}: the index says {part.data_bytes} data bytes, "
                                         f"{nbytes} come")
        self.storage, self.final, self.index = storage, final, index
        self.root = parts_root(storage, parent(final))
        storage.make_dirs(parent(final))
        storage.remove(partial_dir(final))
        self.partial = self.root.stage(final)
        try:
            self.pages = storage.mapped(join(self.partial, data_file(0)), nbytes, writable=True)
        except BaseException:
            storage.remove(self.partial)
            raise

    def publish(self, keep: int) -> None:
        """Every byte arrived: the index goes last, then the newest `keep` of its save root are kept."""
        try:
            self.storage.write_bytes(join(self.partial, self.root.marker), self.index)
        except BaseException:
            self.discard()
            raise
        self.pages = _NOTHING
        for retired in self.root.publish(self.partial, self.final, None, keep):
            self.storage.remove(retired)

    def discard(self) -> None:
        self.pages = _NOTHING
        self.storage.remove(self.partial)


def join_clique(rank: int, world_size: int, factor: int, jump: int, timeout_s: float,
                nodes: tuple[int, ...]) -> tuple[list[int], dist.ProcessGroup]:
    """This rank's clique and its gloo group. Collective: every rank makes every clique's group, in one order."""
    mine = group = None
    for members in cliques(world_size, factor, jump):
        made = dist.new_group(members, backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        if rank in members:
            mine, group = members, made
    if {nodes[r] for r in mine} == {nodes[rank]}:
        log.warning("replication clique %s is on one node: a lost node loses every copy (set "
                    "--replication-jump to the ranks per node)", mine)
    return mine, group


class Replicator:
    """This rank's side of the exchange with its clique: a queue of published saves and the thread that sends
    them and keeps what the peers send. Without a group (no replication) it does nothing.

    Every member runs one exchange per save, whatever happened to its part: a part that failed, or that retention
    retired before this thread got to it (the thread fell behind the saves), is sent as nothing, so the clique's
    collectives stay in step. Only a failed collective ends replication, on this rank, for the rest of the run."""

    def __init__(self, storage: SharedMemoryStorage, paths: NodePaths, nodes: tuple[int, ...], rank: int,
                 clique: list[int], group: dist.ProcessGroup | None, keep: int):
        self.storage, self.paths, self.nodes, self.rank = storage, paths, nodes, rank
        self.clique, self.group, self.keep = clique, group, keep
        self.errors: list[BaseException] = []
        self._queue: queue.Queue = queue.Queue()
        self._thread = None
        if group is not None:
            self._thread = threading.Thread(target=self._run, name="ds-replicate", daemon=True)
            self._thread.start()

    def submit(self, iteration: int, handle) -> None:
        """Send this rank's part of `iteration` once its save (`handle`) is published."""
        if self._thread is not None:
            self._queue.put((iteration, handle))

    def drain(self) -> None:
        """Wait until every submitted part is exchanged, then stop."""
        if self._thread is not None:
            self._queue.put(_STOP)
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        stopped = False  # a collective failed: the clique's exchanges are no longer in step
        while (job := self._queue.get()) is not _STOP:
            iteration, handle = job
            handle.join()
            if stopped:
                continue
            self.storage.hold(handle.path)  # retired meanwhile, its pages are not reused while they are sent
            try:
                mine = self._mine(iteration, handle)
                try:
                    received = self._exchange(iteration, *mine)
                except BaseException as e:  # noqa: BLE001 - a lost replica costs redundancy, never training
                    log.warning("rank %d: replication to clique %s stops: the exchange of iteration %d failed: %s",
                                self.rank, self.clique, iteration, e)
                    self.errors.append(e)
                    stopped = True
                    continue
                for peer, replica in received.items():
                    self._publish(peer, iteration, replica)
            finally:
                self.storage.release(handle.path)

    def _mine(self, iteration: int, handle) -> tuple[bytes, torch.Tensor]:
        """This rank's part of `iteration` as it travels; nothing when the save failed or was retired already."""
        if handle.error is not None:
            return b"", _NOTHING
        try:
            return read_part(self.storage, handle.path)
        except (OSError, CheckpointError) as e:
            log.warning("rank %d: the memory checkpoint of iteration %d was retired before replication reached it "
                        "(saves come faster than replication): not replicated: %s", self.rank, iteration, e)
            self.errors.append(e)
            return b"", _NOTHING

    def _publish(self, peer: int, iteration: int, replica: Replica) -> None:
        try:
            replica.publish(self.keep)
        except BaseException as e:  # noqa: BLE001 - a lost replica costs redundancy, never training
            log.warning("rank %d: keeping rank %d's memory checkpoint of iteration %d failed: %s", self.rank, peer,
                        iteration, e)
            self.errors.append(e)

    def _exchange(self, iteration: int, index: bytes, data: torch.Tensor) -> dict[int, Replica]:
        """Every other node's clique member's part, received (all-gathers: the sizes, the indexes, then the data
        in pieces of at most CHUNK_BYTES a member, each landing in the replica's pages)."""
        sizes = [torch.zeros(2, dtype=torch.int64) for _ in self.clique]
        dist.all_gather(sizes, torch.tensor([len(index), data.numel()], dtype=torch.int64), group=self.group)
        mine = torch.frombuffer(bytearray(index), dtype=torch.uint8) if index else _NOTHING
        indexes = [bytes(b[:int(s[0])].numpy()) for b, s in zip(self._gather_whole(mine, sizes), sizes)]
        replicas = {}
        try:
            for peer, peer_index, size in zip(self.clique, indexes, sizes):
                if self.nodes[peer] != self.paths.node and peer_index:  # a rank of this node has it already
                    replicas[peer] = self._replica(peer, iteration, peer_index, int(size[1]))
            self._gather_data(data, [int(s[1]) for s in sizes], replicas)
        except BaseException:
            for replica in replicas.values():
                if replica is not None:
                    replica.discard()
            raise
        return {peer: replica for peer, replica in replicas.items() if replica is not None}

    def _replica(self, peer: int, iteration: int, index: bytes, nbytes: int) -> Replica | None:
        """Where `peer`'s part lands; None when it is refused (this rank still takes part in the exchange)."""
        try:
            return Replica(self.storage, self.paths.part(peer, iteration), index, nbytes)
        except BaseException as e:  # noqa: BLE001 - a lost replica costs redundancy, never training
            log.warning("rank %d: keeping rank %d's memory checkpoint of iteration %d failed: %s", self.rank, peer,
                        iteration, e)
            self.errors.append(e)
            return None

    def _gather_whole(self, mine: torch.Tensor, sizes: list[torch.Tensor]) -> list[torch.Tensor]:
        longest = max(int(s[0]) for s in sizes)
        if longest == 0:
            return [_NOTHING] * len(self.clique)
        if mine.numel() != longest:  # all-gather wants one size: pad
            mine = torch.cat([mine, torch.zeros(longest - mine.numel(), dtype=torch.uint8)])
        out = [torch.empty(longest, dtype=torch.uint8) for _ in self.clique]
        dist.all_gather(out, mine, group=self.group)
        return out

    def _gather_data(self, data: torch.Tensor, sizes: list[int], replicas: dict[int, Replica | None]) -> None:
        """The members' data, piece by piece: a piece that fits in a replica's pages is received there, the rest
        (this rank's own, a refused replica, past a shorter part's end) into one scratch piece per member."""
        longest = max(sizes)
        if longest == 0:
            return
        chunk = min(CHUNK_BYTES, longest)
        scratch = torch.empty(len(self.clique), chunk, dtype=torch.uint8)
        for off in range(0, longest, chunk):
            n = min(chunk, longest - off)
            mine = data[off:off + n]
            if mine.numel() < n:  # all-gather wants one size: pad
                mine = torch.cat([mine, torch.zeros(n - mine.numel(), dtype=torch.uint8)])
            out, tails = [], []
            for k, peer in enumerate(self.clique):
                replica = replicas.get(peer)
                if replica is not None and off + n <= sizes[k]:
                    out.append(replica.pages[off:off + n])
                    continue
                out.append(scratch[k, :n])
                if replica is not None and off < sizes[k]:
                    tails.append((replica.pages[off:sizes[k]], scratch[k, :sizes[k] - off]))
            dist.all_gather(out, mine, group=self.group)
            for pages, piece in tails:
                pages.copy_(piece)
