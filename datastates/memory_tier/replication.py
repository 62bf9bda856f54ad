"""Replication: every part this rank publishes in memory is sent to the other members of its clique, and theirs
are kept on this node, so that a node lost entirely is recovered from its peers' memory.

The exchange runs on a background thread over a gloo group of the clique, in the order of the saves on every
rank: the training thread never waits on it. A part travels as its index and its data file (read from the
mapped pages), and is published on arrival through the same storage (`receive`), which refuses one whose index
does not verify. A failed exchange costs redundancy, never training: it is logged and
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


def parts_root(storage: SharedMemoryStorage, root: str) -> SaveRoot:
    """A directory of the tier holding one rank's parts (or the merged checkpoints): checkpoints published by
    their index, and no tracker (a restart lists every rank's parts)."""
    return SaveRoot(storage, root, pointer=None)


def read_part(storage: SharedMemoryStorage, final: str) -> tuple[bytes, torch.Tensor]:
    """A published part of one rank as it travels: its index, and the bytes of its data file that the index
    describes, mapped from the tier's pages."""
    index = storage.read_bytes(join(final, METADATA))
    return index, storage.mapped(join(final, data_file(0)), fmt.parse_index(index, final).part(0).data_bytes)


def receive(storage: SharedMemoryStorage, final: str, index: bytes, data: torch.Tensor, keep: int) -> None:
    """Publish a checkpoint another rank sent (a replica): its data file and its index, refused unless the index
    verifies and describes that data; then keep the newest `keep` of its save root."""
    root = parts_root(storage, parent(final))
    storage.remove(partial_dir(final))
    partial = root.stage(final)
    try:
        part = fmt.parse_index(index, final).part(0)
        if part.data_bytes != data.numel():
            raise CheckpointCorruptError(f"replica {final!r}: the index says {part.data_bytes} data bytes, "
                                         f"{data.numel()} came")
        storage.write_bytes(join(partial, data_file(0)), data.numpy())
        storage.write_bytes(join(partial, root.marker), index)
    except BaseException:
        storage.remove(partial)
        raise
    for retired in root.publish(partial, final, None, keep):
        storage.remove(retired)


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
                    received = self._exchange(*mine)
                except BaseException as e:  # noqa: BLE001 - a lost replica costs redundancy, never training
                    log.warning("rank %d: replication to clique %s stops: the exchange of iteration %d failed: %s",
                                self.rank, self.clique, iteration, e)
                    self.errors.append(e)
                    stopped = True
                    continue
                for peer, (index, data) in zip(self.clique, received):
                    if self.nodes[peer] != self.paths.node and index:  # a rank of this node has it already
                        self._keep(peer, iteration, index, data)
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

    def _keep(self, peer: int, iteration: int, index: bytes, data: torch.Tensor) -> None:
        """Publish `peer`'s part of `iteration` on this node."""
        try:
            self.storage.make_dirs(self.paths.rank_dir(peer))
            receive(self.storage, self.paths.part(peer, iteration), index, data, self.keep)
        except BaseException as e:  # noqa: BLE001 - a lost replica costs redundancy, never training
            log.warning("rank %d: keeping rank %d's memory checkpoint of iteration %d failed: %s", self.rank, peer,
                        iteration, e)
            self.errors.append(e)

    def _exchange(self, index: bytes, data: torch.Tensor) -> list[tuple[bytes, torch.Tensor]]:
        """Every clique member's part (all-gather of the sizes, then of the indexes and the data, padded)."""
        sizes = [torch.zeros(2, dtype=torch.int64) for _ in self.clique]
        dist.all_gather(sizes, torch.tensor([len(index), data.numel()], dtype=torch.int64), group=self.group)
        indexes = [bytes(b[:int(s[0])].numpy()) for b, s in zip(self._gather(
            torch.frombuffer(bytearray(index), dtype=torch.uint8) if index else _NOTHING, sizes, 0), sizes)]
        datas = [b[:int(s[1])] for b, s in zip(self._gather(data, sizes, 1), sizes)]
        return list(zip(indexes, datas))

    def _gather(self, mine: torch.Tensor, sizes: list[torch.Tensor], which: int) -> list[torch.Tensor]:
        longest = max(int(s[which]) for s in sizes)
        if longest == 0:
            return [_NOTHING] * len(self.clique)
        if mine.numel() != longest:  # all-gather wants one size: pad (parts of one layout rarely differ)
            mine = torch.cat([mine, torch.zeros(longest - mine.numel(), dtype=torch.uint8)])
        out = [torch.empty(longest, dtype=torch.uint8) for _ in self.clique]
        dist.all_gather(out, mine, group=self.group)
        return out
