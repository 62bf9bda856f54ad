"""Read once, pass on: each saved byte that several ranks of a load need is read from storage by one of them and
passed to the others over a process group (gloo on CPU ranks; NCCL on GPUs, from the device after the
host-to-device copy), as megatron-core's fully parallel load does for torch_dist.

A rank knows only what its own template asks for, so the ranks first agree on who needs what: one all-gather of
each rank's wanted chunk ranges (O(items) per rank, from the load plan and the index: no I/O). From that every
rank computes the same assignment with no further message: the saved chunks that two or more ranks need are cut
wherever one rank's range starts or ends, in pieces of at most a staging slot, and each piece goes to the
least-loaded of the ranks that need it, by bytes (as `megatron.ReplicaOwnership` spreads the save's replicas).
What only one rank needs, it reads alone, as without the exchange.

The pieces move in rounds that fit every rank's staging budget (a piece a rank reads or receives holds one of
its slots until it is placed): the readers read theirs through `Reads` (each chunk's crc32c checked where it is
read), every rank says whether its reads succeeded (one all-reduce: on a failure every rank raises, naming the
rank and its cause), then each piece goes point-to-point to the ranks that need it, which place it into their
targets with the load plan's copies. Every wait on another rank is bounded by `timeout_s`.

A compressed item's pieces travel as stored: the reader reads and verifies the stored bytes and passes them as
they are, and every rank that needs them checks each chunk's crc32c over those bytes and decodes them itself, so
the exchange moves the stored sizes, not the raw ones. A rank then holds both a piece's stored and its raw
bytes, which `rounds` counts against its staging.
"""
from __future__ import annotations

import dataclasses
import datetime
import pickle
from collections import defaultdict
from concurrent import futures
from typing import Any, Callable, NamedTuple

import torch
import torch.distributed as dist

from .errors import CheckpointError, CheckpointTimeoutError
from .load_plan import BoxRead
from .load_reads import Reads, decode_passed, decoders
from .save_plan import aligned_empty
from .schema import Item

TensorRead = tuple[BoxRead, torch.Tensor]  # a read of the load plan and the target it fills
ObjectRead = tuple[int, Item, Callable[[torch.Tensor], None]]  # a saved object and what takes its verified bytes


class Want(NamedTuple):
    """Chunks [first, last) of the saved item `id` in the data file of `rank`, which a rank of the load needs."""

    rank: int
    id: str
    first: int
    last: int
    chunk_bytes: int
    nbytes: int  # the item's
    whole: bool  # an object: it moves in one piece

    def bytes_of(self, first: int, last: int) -> int:
        return min(last * self.chunk_bytes, self.nbytes) - first * self.chunk_bytes


class Member(NamedTuple):
    """What a rank tells the others before a load: its rank, its staging, what it wants, or why it cannot load."""

    rank: int
    slot_bytes: int
    slots: int
    wants: tuple
    error: str | None


class Transfer(NamedTuple):
    """Chunks [first, last) (`nbytes`) of a saved item, read by the member `reader`, needed by `members`."""

    rank: int
    id: str
    first: int
    last: int
    nbytes: int
    reader: int
    members: tuple
    stored: int | None = None  # a compressed item's piece: what it takes stored, the bytes passed (`stored_sizes`)


def assign(members: list[Member]) -> list[Transfer]:
    """Every piece of saved bytes that two or more members want, with its reader, in file order: the same on every
    rank. Pieces are taken by decreasing size and each goes to the least-loaded member that wants it."""
    piece_bytes = min(m.slot_bytes for m in members)
    wanted: dict[tuple, list[tuple[int, Want]]] = defaultdict(list)
    for index, member in enumerate(members):
        for want in member.wants:
            wanted[(want.rank, want.id)].append((index, want))
    pieces = []
    for key in sorted(wanted):
        entries = wanted[key]
        if len({index for index, _ in entries}) < 2:
            continue
        cuts = sorted({c for _, w in entries for c in (w.first, w.last)})
        for a, b in zip(cuts, cuts[1:]):
            needers = tuple(sorted({index for index, w in entries if w.first <= a and b <= w.last}))
            if len(needers) > 1:
                want = entries[0][1]
                step = b - a if want.whole else max(1, piece_bytes // want.chunk_bytes)
                pieces.extend((key, f, min(b, f + step), want.bytes_of(f, min(b, f + step)), needers)
                              for f in range(a, b, step))
    load = [0] * len(members)
    readers = {}
    for n in sorted(range(len(pieces)), key=lambda n: -pieces[n][3]):
        readers[n] = reader = min(pieces[n][4], key=lambda index: (load[index], index))
        load[reader] += pieces[n][3]
    return [Transfer(*key, f, last, nbytes, readers[n], needers)
            for n, (key, f, last, nbytes, needers) in enumerate(pieces)]


def rounds(transfers: list[Transfer], members: list[Member]) -> list[list[Transfer]]:
    """The transfers in order, cut into rounds in which no member reads or receives more than its staging slots
    hold (a transfer larger than a slot counts the slots its bytes fill; one alone always makes a round)."""
    out: list[list[Transfer]] = []
    current: list[Transfer] = []
    used: dict[int, int] = {}
    for t in transfers:
        cost = {i: -(-t.nbytes // members[i].slot_bytes) + -(-(t.stored or 0) // members[i].slot_bytes)
                for i in t.members}
        if current and any(used.get(i, 0) + c > members[i].slots for i, c in cost.items()):
            out.append(current)
            current, used = [], {}
        current.append(t)
        for i, c in cost.items():
            used[i] = used.get(i, 0) + c
    return out + [current] if current else out


@dataclasses.dataclass
class Plan:
    """One rank's part of an agreed load: what it reads alone, and the rounds of pieces passed between ranks."""

    members: list[Member]
    me: int
    rounds: list[list[Transfer]]
    local_tensors: list[tuple[BoxRead, torch.Tensor, tuple[int, int]]]  # (read, target, chunk span)
    local_objects: list[ObjectRead]
    places: dict[tuple, list[Any]]  # (rank, id) -> the TensorReads and object takers fed by passed pieces


class Exchange:
    """The collective side of a load over `group` (default: the world): `agree` on who reads what, then `move`
    the shared pieces. Every rank of the group calls both, at the same point of its load."""

    def __init__(self, group=None, timeout_s: float = 600.0):
        self.group = group
        self.timeout_s = timeout_s
        nccl = dist.get_backend(group) == "nccl"
        self.device = torch.device("cuda", torch.cuda.current_device()) if nccl else None
        self.me = dist.get_rank(group)

    def agree(self, checkpoint, tensors: list[TensorRead], objects: list[ObjectRead],
              error: BaseException | None = None) -> Plan:
        """Every rank's wants gathered, the pieces assigned (the same plan on every rank) and this rank's share.
        A rank that could not plan its load (`error`) fails the load on every rank here."""
        wants = () if error is not None else tuple(_wants(tensors, objects))
        members = self._gather(Member(dist.get_rank(), checkpoint.pool.slot_bytes, checkpoint.pool.max_slots, wants,
                                      None if error is None else str(error)))
        causes = [f"rank {m.rank}: {m.error}" for m in members if m.error]
        if causes:
            raise CheckpointError(f"the load failed on {len(causes)} rank(s): {'; '.join(causes)}") from error
        transfers = stored_sizes(checkpoint, assign(members))
        shared: dict[tuple, list[tuple[int, int]]] = defaultdict(list)
        for t in transfers:
            if self.me in t.members:
                shared[(t.rank, t.id)].append((t.first, t.last))
        places = defaultdict(list)
        local_tensors = []
        for read, dst in tensors:
            key = (read.rank, read.item.id)
            if key in shared:
                places[key].append((read, dst))
            local_tensors.extend((read, dst, span) for span in _outside(read.span(), shared.get(key, ())))
        local_objects = []
        for rank, item, take in objects:
            if (rank, item.id) in shared:
                places[(rank, item.id)].append(take)
            else:
                local_objects.append((rank, item, take))
        return Plan(members, self.me, rounds(transfers, members), local_tensors, local_objects, dict(places))

    def move(self, checkpoint, plan: Plan, error: BaseException | None = None) -> None:
        """Read, agree on, pass and place every round of `plan`; `error`: this rank's own reads failed, which
        fails the load on every rank at the first agreement (as a failure to place does at the next one)."""
        for transfers in plan.rounds:
            error = self._round(checkpoint, plan, transfers, error)
        self._agree(error)

    def _round(self, checkpoint, plan: Plan, transfers: list[Transfer], error):
        me = plan.me
        mine = [t for t in transfers if me in t.members]
        slots: list = []
        try:
            staged = {t: _staged(checkpoint.pool, _passed(t), slots) for t in mine
                      if t.reader == me or self.device is None}
            if error is None:
                try:
                    with Reads(checkpoint) as reads:
                        for t in mine:
                            if t.reader == me:
                                reads.read_chunks(t.rank, checkpoint.items(t.rank)[t.id], t.first, t.last, staged[t],
                                                  decode=False)
                except CheckpointError as e:
                    error = e
            self._agree(error)
            wire = {t: self._wire(t, staged.get(t)) for t in mine}
            self._pass(plan, mine, wire, checkpoint.stats)
            try:
                self._decode(checkpoint, plan, mine, wire, slots)
                self._place(checkpoint.backend, plan, mine, wire)
            except Exception as e:  # noqa: BLE001 - e.g. an object that does not unpickle: the next agreement
                error = e           # fails every rank at once, where raising here would leave them waiting
        finally:
            for slot in slots:
                checkpoint.pool.release(slot)
        return error

    def _wire(self, t: Transfer, staged: torch.Tensor | None) -> torch.Tensor:
        """What goes over the group: the staged bytes themselves, or with NCCL a device copy of them (a
        receiver's device buffer)."""
        if self.device is None:
            return staged
        out = torch.empty(_passed(t), dtype=torch.uint8, device=self.device)
        if staged is not None:
            out.copy_(staged)
        return out

    def _pass(self, plan: Plan, mine: list[Transfer], wire: dict, stats) -> None:
        ops = []
        for t in mine:
            if t.reader == plan.me:
                for i in t.members:
                    if i != plan.me:
                        ops.append(dist.P2POp(dist.isend, wire[t], plan.members[i].rank, self.group))
                        stats.bytes_sent += _passed(t)
            else:
                ops.append(dist.P2POp(dist.irecv, wire[t], plan.members[t.reader].rank, self.group))
                stats.bytes_received += _passed(t)
        for work in dist.batch_isend_irecv(ops) if ops else ():
            self._wait(work, "passing checkpoint bytes between ranks")

    def _decode(self, checkpoint, plan: Plan, mine: list[Transfer], wire: dict, slots: list) -> None:
        """Each compressed piece's stored bytes, checked against the index here and decoded into host memory of
        this round (`wire` then holds its raw bytes), on the process's decoder threads; once every piece is done
        (none still writes into this round's memory), the first bad chunk raises, naming it."""
        jobs = []
        for t in mine:
            if t.stored is not None:
                raw = _staged(checkpoint.pool, t.nbytes, slots)
                jobs.append((t, raw, decoders().submit(
                    decode_passed, checkpoint.items(t.rank)[t.id], t.first, t.last, wire[t].cpu(), raw,
                    checkpoint.data_path(t.rank), plan.members[t.reader].rank)))
        futures.wait([job for _, _, job in jobs])
        for t, raw, job in jobs:
            job.result()
            wire[t] = raw

    def _place(self, backend, plan: Plan, mine: list[Transfer], wire: dict) -> None:
        """Copy each piece into this rank's targets (and unpickle objects); return once the copies landed."""
        ordering, landed = backend.begin(), _Landed()
        try:
            for t in mine:
                for need in plan.places[(t.rank, t.id)]:
                    if callable(need):
                        need(wire[t].cpu())
                        continue
                    read, dst = need
                    first, end = read.span()
                    if first < t.last and t.first < end:
                        read.piece(t.first, t.last).place(wire[t], dst,
                                                          lambda d, s: backend.copy(d, s, ordering))
        finally:
            backend.mark(landed)
            backend.ready(landed)

    def _agree(self, error: BaseException | None) -> None:
        """Raise on every rank when any rank's reads failed, naming each such rank and its cause."""
        failed = torch.tensor([int(error is not None)], dtype=torch.int32, device=self.device)
        self._wait(dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=self.group, async_op=True),
                   "agreeing on the load's reads")
        if failed.item():
            causes = [c for c in self._gather(None if error is None else f"rank {dist.get_rank()}: {error}") if c]
            raise CheckpointError(f"the load failed on {len(causes)} rank(s): {'; '.join(causes)}") from error

    def _gather(self, value: Any) -> list:
        """`value` of every rank of the group (a pickled all-gather whose waits are bounded)."""
        data = torch.frombuffer(bytearray(pickle.dumps(value)), dtype=torch.uint8).to(self.device or "cpu")
        size = torch.tensor([data.numel()], dtype=torch.int64, device=self.device)
        n = dist.get_world_size(self.group)
        sizes = [torch.zeros_like(size) for _ in range(n)]
        self._wait(dist.all_gather(sizes, size, group=self.group, async_op=True), "agreeing on the load's plan")
        longest = max(int(s.item()) for s in sizes)
        padded = torch.zeros(longest, dtype=torch.uint8, device=self.device)
        padded[:data.numel()] = data
        out = [torch.empty_like(padded) for _ in range(n)]
        self._wait(dist.all_gather(out, padded, group=self.group, async_op=True), "agreeing on the load's plan")
        return [pickle.loads(o[:int(s.item())].cpu().numpy().tobytes()) for o, s in zip(out, sizes)]

    def _wait(self, work, what: str) -> None:
        try:
            work.wait(datetime.timedelta(seconds=self.timeout_s))
        except RuntimeError as e:
            raise CheckpointTimeoutError(f"rank {dist.get_rank()}: {what} failed or got no answer within "
                                         f"{self.timeout_s:g} s (a rank died, hangs or left the load): {e}") from None


class _Landed:
    """The completions of a round's copies out of its buffers (`CopyBackend.mark` / `ready`)."""

    __slots__ = ("waits",)

    def __init__(self):
        self.waits = []


def _wants(tensors: list[TensorRead], objects: list[ObjectRead]):
    for read, _ in tensors:
        item = read.item
        yield Want(read.rank, item.id, *read.span(), item.chunk_bytes or item.nbytes, item.nbytes, False)
    for rank, item, _ in objects:
        yield Want(rank, item.id, 0, len(item.chunks()), item.chunk_bytes or item.nbytes, item.nbytes, True)


def _outside(span: tuple[int, int], shared) -> list[tuple[int, int]]:
    """The parts of the chunk `span` that none of the `shared` chunk ranges covers."""
    out, at = [], span[0]
    for first, last in sorted(shared):
        if first > at:
            out.append((at, min(first, span[1])))
        at = max(at, last)
        if at >= span[1]:
            break
    if at < span[1]:
        out.append((at, span[1]))
    return [(a, b) for a, b in out if a < b]


def stored_sizes(checkpoint, transfers: list[Transfer]) -> list[Transfer]:
    """Each transfer of a compressed item with the stored size of its chunks (from the index every rank holds)."""
    out = []
    for t in transfers:
        item = checkpoint.items(t.rank)[t.id]
        out.append(t if item.codec is None else t._replace(stored=sum(item.stored[t.first:t.last])))
    return out


def _passed(t: Transfer) -> int:
    """The bytes a transfer moves between ranks: the stored ones of a compressed item's piece."""
    return t.nbytes if t.stored is None else t.stored


def _staged(pool, nbytes: int, slots: list) -> torch.Tensor:
    """Host memory for a piece: a staging slot (kept in `slots` until the round gave it back), or a buffer of
    its own for a piece larger than a slot (counted by `rounds` as the slots its bytes fill)."""
    if nbytes > pool.slot_bytes:
        return aligned_empty(nbytes)
    slot = pool.acquire()
    slots.append(slot)
    return slot.buffer[:nbytes]
