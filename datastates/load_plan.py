"""The load plan: which saved bytes fill a target tensor, and where each of them goes.

Computed from the target's box and the checkpoint's index alone, without I/O, so that a reshard (TP split or
merge, a DP reshard of flat ranges, chunked items) can be checked without reading a file; `open_checkpoint`
executes it.
A target is filled by `BoxRead`s, one per saved item it overlaps. A box read is done either in one read straight
into the target (a whole saved item, when the target's memory allows it) or in `Piece`s: whole checksum chunks,
each at most a staging slot, whose elements `Copy` out into the target.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Iterable, Iterator, NamedTuple

from .errors import CheckpointCorruptError, CheckpointError
from .schema import Box, Item, Shard, volume


class Copy(NamedTuple):
    """Elements of a piece that go to the target: a contiguous run of `run`'s shape starting `start` elements
    into the piece, of which the part `src` goes to `dst` in the target."""

    start: int
    run: tuple
    src: tuple  # slices of the run
    dst: tuple  # slices of the target


class Piece(NamedTuple):
    """Chunks [first, last) of a saved item, its bytes [start, stop), and where their wanted elements go."""

    first: int
    last: int
    start: int
    stop: int
    copies: tuple

    def place(self, buffer, dst, copy: Callable) -> None:
        """Hand each of the piece's runs in `buffer` (its verified bytes) to `copy(target view, run)`."""
        src = buffer[:self.stop - self.start].view(dst.dtype)
        for c in self.copies:
            run = src[c.start:c.start + volume(c.run)].view(c.run)
            copy(dst[c.dst], run[c.src])


@dataclasses.dataclass(frozen=True)
class BoxRead:
    """Fill the part `box` of the target whose first element is at `origin` from the saved `item` of `rank`."""

    rank: int
    item: Item
    box: Box
    origin: tuple

    @property
    def whole(self) -> bool:
        """The box is the whole saved item: its bytes may land straight in the target."""
        return self.box == self.item.box

    @property
    def dst(self) -> tuple:
        """The box as slices of the target."""
        return self.box.index(self.origin)

    def span(self) -> tuple[int, int]:
        """The checksum chunks [first, end) of the item that hold the rows of the box."""
        item, (s_off, s_shape) = self.item, self.item.box
        esize = item.element_size
        row_bytes = esize * volume(s_shape[1:])
        rows = self.box.offset[0] - s_off[0] if s_shape else 0
        lo, hi = (rows * row_bytes, (rows + self.box.shape[0]) * row_bytes) if s_shape else (0, esize)
        cb = item.chunk_bytes or item.nbytes
        return lo // cb, -(-hi // cb)

    def pieces(self, piece_bytes: int, span: tuple[int, int] | None = None) -> Iterator[Piece]:
        """The rows of the item that hold the box, widened to whole checksum chunks (or the chunks `span` of
        them), in pieces of as many chunks as `piece_bytes` allows (at least one)."""
        cb = self.item.chunk_bytes or self.item.nbytes
        first, end = span or self.span()
        while first < end:
            last = max(first + 1, min(end, first + max(1, piece_bytes // cb)))
            yield self.piece(first, last)
            first = last

    def piece(self, first: int, last: int) -> Piece:
        """Chunks [first, last) of the item, and the copies of their elements that lie in the box."""
        item, s_off = self.item, self.item.box.offset
        esize, cb = item.element_size, item.chunk_bytes or item.nbytes
        local = Box(tuple(o - so for o, so in zip(self.box.offset, s_off)), self.box.shape)
        start, stop = first * cb, min(last * cb, item.nbytes)
        return Piece(first, last, start, stop, tuple(self._copies(local, start // esize, stop // esize)))

    def _copies(self, local: Box, lo: int, hi: int) -> Iterator[Copy]:
        """The copies out of the item's elements [lo, hi) into the target: `local` is the box in the item's own
        coordinates."""
        s_off, s_shape = self.item.box
        for run in _flat_boxes(s_shape, lo, hi):
            part = run.overlap(local)
            if part is None:
                continue
            yield Copy(_ravel(run.offset, s_shape) - lo, run.shape,
                       tuple(slice(a - r, a - r + n) for a, r, n in zip(part.offset, run.offset, part.shape)),
                       Box(tuple(a + so for a, so in zip(part.offset, s_off)), part.shape).index(self.origin))


def plan_whole(rank: int, item: Item) -> list[BoxRead]:
    """A rank-local tensor read whole into a target of its own shape."""
    return [BoxRead(rank, item, item.box, item.box.offset)] if item.nbytes else []


def plan_global(where: str, name: str, target: Box, global_shape: tuple, dtype: str, shards: Iterable[Shard],
                item_of: Callable[[Shard], Item]) -> list[BoxRead]:
    """The reads that fill the `target` box of the logical tensor `name` from the saved `shards` that overlap it
    (`item_of` gives a shard's validated item). Raises, naming `where`, when a shard disagrees with the target
    on dtype or global shape, or when the shards do not cover the whole box."""
    reads, covered, found = [], 0, False
    for shard in shards:
        found = True
        if shard.global_shape != tuple(global_shape) or shard.dtype != dtype:
            raise CheckpointError(f"{where}: {name!r} is {shard.dtype} with global shape {shard.global_shape}, the "
                                  f"target wants {dtype} {tuple(global_shape)}")
        try:
            box = target.overlap(shard.box)
        except TypeError as e:  # a forged index; the item itself is validated below only if it overlaps
            raise CheckpointCorruptError(f"{where}: shard {shard.id!r} of rank {shard.rank} has a malformed box: "
                                         f"{e}") from None
        if box is None:
            continue
        item = item_of(shard)
        covered += box.volume()
        if item.nbytes:
            reads.append(BoxRead(shard.rank, item, box, target.offset))
    if not found:
        raise CheckpointError(f"{where} has no tensor named {name!r}")
    if covered != target.volume():
        raise CheckpointError(f"{where} does not cover {name!r} at offset {target.offset} shape {target.shape}: "
                              f"{covered} of {target.volume()} elements saved")
    return reads


def _flat_boxes(shape, lo: int, hi: int) -> Iterator[Box]:
    """Boxes that together are the row-major elements [lo, hi) of a tensor of `shape`, each of them one
    contiguous run of those elements."""
    if hi <= lo:
        return
    if not shape:
        yield Box((), ())
        return
    inner = volume(shape[1:])
    r0, o0 = divmod(lo, inner)
    r1, o1 = divmod(hi, inner)
    rest = len(shape) - 1

    def row(r, a, b):
        for sub in _flat_boxes(shape[1:], a, b):
            yield Box((r,) + sub.offset, (1,) + sub.shape)
    if r0 == r1:
        yield from row(r0, o0, o1)
        return
    if o0:
        yield from row(r0, o0, inner)
        r0 += 1
    if r1 > r0:
        yield Box((r0,) + (0,) * rest, (r1 - r0,) + tuple(shape[1:]))
    if o1:
        yield from row(r1, 0, o1)


def _ravel(index, shape) -> int:
    flat = 0
    for i, n in zip(index, shape):
        flat = flat * n + i
    return flat
