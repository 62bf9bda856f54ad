"""The load plan is data: which saved bytes fill a target, computed from boxes and the index alone, no I/O.

Each case saves a logical tensor as shards of one layout (items described as the index would describe them) and
plans a target of another layout: TP split and merge, a DP reshard of flat ranges, items chunked smaller than
a row, pieces smaller than an item. The plan is then run against the saved bytes held in memory, with the
reader's own copy-out (`Piece.place`), and must give exactly the target's part of the logical tensor, while
reading only the chunks that hold it.
"""
import pytest
import torch

from datastates.errors import CheckpointCorruptError, CheckpointError
from datastates.load_plan import plan_global, plan_whole
from datastates.schema import Box, Item, Shard

FULL = torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6)


def shard_items(full, boxes, chunk_elems=None):
    """{rank: Item} of the shards `boxes` of `full`, each with checksum chunks of `chunk_elems` elements."""
    items = {}
    for rank, (off, shape) in enumerate(boxes):
        nbytes = Box(off, shape).volume() * 4
        chunk = min(nbytes, (chunk_elems or nbytes // 4) * 4)
        items[rank] = Item(id=f"w.{rank}", kind="tensor", scope="global", name="w", dtype="float32",
                           shape=tuple(shape), global_shape=tuple(full.shape), global_offset=tuple(off), offset=0,
                           nbytes=nbytes, chunk_bytes=chunk, crcs=[0] * -(-nbytes // chunk))
    return items


def saved_bytes(full, item):
    (off, shape) = item.box
    return full[Box(off, shape).index((0,) * full.dim())].contiguous().reshape(-1).view(torch.uint8)


def plan(items, target, dtype="float32", global_shape=(8, 6)):
    shards = [Shard(r, it.id, it.name, it.kind, it.dtype, it.box, it.global_shape) for r, it in items.items()]
    return plan_global("checkpoint 'ck'", "w", target, global_shape, dtype, shards,
                       lambda shard: items[shard.rank])


def _copy(dst, src):
    dst.copy_(src)


def execute(reads, full, target, piece_bytes):
    """Run the plan on the saved bytes in memory; returns the filled target and the chunks each rank read."""
    dst = torch.full(target.shape, float("nan"))
    chunks = {}
    for read in reads:
        data = saved_bytes(full, read.item)
        for piece in read.pieces(piece_bytes):
            assert piece.stop - piece.start <= max(piece_bytes, read.item.chunk_bytes)
            chunks.setdefault(read.rank, []).extend(range(piece.first, piece.last))
            piece.place(data[piece.start:piece.stop].clone(), dst, _copy)
    return dst, chunks


def expected(full, target):
    return full[target.index((0,) * full.dim())]


@pytest.mark.parametrize("piece_bytes", [24, 48, 1 << 20])
def test_tp_split_reads_only_the_rows_of_the_target(piece_bytes):
    items = shard_items(FULL, [((0, 0), (8, 6))], chunk_elems=6)  # saved whole, one chunk per row
    target = Box((4, 0), (4, 6))  # TP2 rank 1, split along rows
    reads = plan(items, target)
    assert [(r.rank, r.whole) for r in reads] == [(0, False)]
    dst, chunks = execute(reads, FULL, target, piece_bytes)
    assert torch.equal(dst, expected(FULL, target))
    assert sorted(chunks[0]) == [4, 5, 6, 7]


def test_tp_split_along_columns_reads_every_row_and_copies_strided():
    items = shard_items(FULL, [((0, 0), (8, 6))], chunk_elems=12)
    target = Box((0, 3), (8, 3))
    dst, chunks = execute(plan(items, target), FULL, target, 24)
    assert torch.equal(dst, expected(FULL, target))
    assert sorted(chunks[0]) == [0, 1, 2, 3]


def test_tp_merge_reads_each_saved_shard_whole():
    items = shard_items(FULL, [((0, 0), (4, 6)), ((4, 0), (4, 6))])
    target = Box((0, 0), (8, 6))
    reads = plan(items, target)
    assert [(r.rank, r.whole, r.dst) for r in reads] == [(0, True, (slice(0, 4), slice(0, 6))),
                                                        (1, True, (slice(4, 8), slice(0, 6)))]
    dst, _ = execute(reads, FULL, target, 1 << 20)
    assert torch.equal(dst, FULL)


@pytest.mark.parametrize("saved_dp,target_dp", [(4, 2), (4, 3), (2, 4), (3, 5)])
def test_dp_reshard_of_flat_ranges(saved_dp, target_dp):
    """The distributed optimizer's flat buffers: contiguous ranges of one 1-D tensor, cut at other places."""
    flat = torch.arange(100, dtype=torch.float32)
    cuts = [round(i * 100 / saved_dp) for i in range(saved_dp + 1)]
    items = shard_items(flat, [((a,), (b - a,)) for a, b in zip(cuts, cuts[1:])], chunk_elems=5)
    for t in range(target_dp):
        lo, hi = round(t * 100 / target_dp), round((t + 1) * 100 / target_dp)
        target = Box((lo,), (hi - lo,))
        reads = plan(items, target, global_shape=(100,))
        assert {r.rank for r in reads} == {r for r, (a, b) in enumerate(zip(cuts, cuts[1:])) if a < hi and lo < b}
        dst, chunks = execute(reads, flat, target, 40)
        assert torch.equal(dst, flat[lo:hi])
        for read in reads:  # only the chunks holding wanted elements, widened to whole chunks
            first = (read.box.offset[0] - read.item.box.offset[0]) // 5
            last = -(-(read.box.offset[0] + read.box.shape[0] - read.item.box.offset[0]) // 5)
            assert sorted(chunks[read.rank]) == list(range(first, last))


def test_chunked_item_in_pieces_smaller_than_the_item():
    big = torch.arange(30 * 7, dtype=torch.float32).reshape(30, 7)
    items = shard_items(big, [((0, 0), (30, 7))], chunk_elems=14)  # two rows a chunk
    target = Box((5, 2), (20, 4))
    reads = plan(items, target, global_shape=(30, 7))
    pieces = list(reads[0].pieces(3 * 56))
    assert [(p.first, p.last) for p in pieces] == [(2, 5), (5, 8), (8, 11), (11, 13)]
    dst, _ = execute(reads, big, target, 3 * 56)
    assert torch.equal(dst, big[5:25, 2:6])


def test_whole_local_items_and_scalars():
    item = Item(id="s", kind="tensor", dtype="float32", shape=(), offset=0, nbytes=4, chunk_bytes=4, crcs=[0])
    reads = plan_whole(0, item)
    assert reads[0].whole and reads[0].dst == ()
    [piece] = reads[0].pieces(1 << 20)
    dst = torch.zeros(())
    piece.place(torch.tensor(2.5).reshape(1).view(torch.uint8), dst, _copy)
    assert dst.item() == 2.5
    empty = Item(id="e", kind="tensor", dtype="float32", shape=(0, 3), offset=0, nbytes=0)
    assert plan_whole(0, empty) == []


def test_gaps_mismatches_and_forged_boxes_are_refused_naming_the_checkpoint():
    items = shard_items(FULL, [((0, 0), (4, 6))])  # rows 4:8 were never saved
    with pytest.raises(CheckpointError, match="'ck' does not cover 'w' at offset \\(2, 0\\).*12 of 24"):
        plan(items, Box((2, 0), (4, 6)))
    assert len(plan(items, Box((0, 0), (4, 6)))) == 1
    with pytest.raises(CheckpointError, match="'w' is float32 with global shape \\(8, 6\\), the target wants "
                                              "bfloat16"):
        plan(items, Box((0, 0), (4, 6)), dtype="bfloat16")
    with pytest.raises(CheckpointError, match="has no tensor named 'w'"):
        plan({}, Box((0, 0), (4, 6)))
    forged = [Shard(0, "w.0", "w", "tensor", "float32", Box(("x", 0), (4, 6)), (8, 6))]
    with pytest.raises(CheckpointCorruptError, match="shard 'w.0' of rank 0 has a malformed box"):
        plan_global("checkpoint 'ck'", "w", Box((0, 0), (4, 6)), (8, 6), "float32", forged, lambda s: None)
