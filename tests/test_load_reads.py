"""The load path's reads: bytes that cannot land in their target directly (a strided or device target, a box of
a saved shard, any target in read mode "parallel") are read into the engine's staging slots, verified, and
copied out by a copy backend; in read mode "stream" a whole item is read straight into a contiguous host target.

A backend that lands those copies late and out of order stands in for a GPU's side stream: a slot reused
before its copies landed, or a load that returned before they all did, shows in the loaded values. The state
is small and the slots smaller still, so slots cycle many times within one load."""
import contextlib
import os

import pytest
import torch

from datastates import CheckpointEngine, PosixOptions
from datastates.errors import CheckpointCorruptError
from datastates.providers import ContainerProvider, ObjectProvider, ProviderRegistry, StateProvider, TensorProvider
from datastates.loader import CheckpointLoader
from datastates.open_checkpoint import OpenCheckpoint
from datastates.copies import HostCopyBackend
from datastates.slots import StagingPool
from datastates.storage import PosixStorage
from datastates.verifier import CheckpointVerifier
from late_copies import LateAddressCopyBackend, LateCopyBackend

ROWS, COLS, SPLIT = 600, 500, 300  # one logical tensor, saved as two row blocks


class Box:
    """A block of a logical tensor: `tensor` holds the elements at `offset` of the `global_shape` whole."""

    def __init__(self, name, tensor, global_shape, offset):
        self.name, self.tensor, self.global_shape, self.offset = name, tensor, tuple(global_shape), tuple(offset)


class BoxProvider(StateProvider):
    def accepts(self, value):
        return isinstance(value, Box)

    def flatten(self, value, path, ctx):
        return ctx.add_tensor(path, value.tensor, scope="global", name=value.name, global_shape=value.global_shape,
                              global_offset=value.offset)


def _registry():
    return ProviderRegistry([BoxProvider(), ContainerProvider(), TensorProvider(), ObjectProvider()])


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(checkpoint path, the values it holds): a global tensor in two blocks, strided, bf16, 0-dim, objects."""
    g = torch.Generator().manual_seed(5)
    whole = torch.randn(ROWS, COLS, generator=g)
    local = {"cols": torch.randn(70, 90, generator=g).t(), "half": torch.randn(3000, generator=g).bfloat16(),
             "scalar": torch.tensor(2.5), "step": 17, "note": "x" * 5000}
    state = {"w0": Box("w", whole[:SPLIT], whole.shape, (0, 0)), "w1": Box("w", whole[SPLIT:], whole.shape, (SPLIT, 0)),
             **local}
    path = str(tmp_path_factory.mktemp("restore") / "iter_0000001")
    with CheckpointEngine(host_buffer_bytes=256 << 10, storage=PosixOptions(writer_threads=2),
                          registry=_registry()) as eng:
        eng.save(state, path)
        eng.wait()
    return path, whole, local


@contextlib.contextmanager
def _reading(path, budget, backend, read_mode="stream"):
    """(a loader of `path` on a staging pool of `budget` bytes and `backend`, that pool); all closed after."""
    storage = PosixStorage(PosixOptions(read_threads=2, read_mode=read_mode))
    pool = StagingPool(budget, writer_threads=2)
    checkpoint = OpenCheckpoint(path, storage, pool, backend)
    try:
        yield CheckpointLoader(checkpoint, _registry()), pool
    finally:
        checkpoint.close(), backend.close(), storage.close(), pool.close()


def _template():
    """Strided targets everywhere, and blocks that straddle the two saved ones."""
    nan = float("nan")
    box_a = torch.full((COLS - 40, 19), nan).t()  # rows 290..308, columns 3..462: a box of both saved blocks
    box_b = torch.full((ROWS - 100, COLS), nan)[::2]  # every other row of a buffer: strided along dim 0
    return {"a": Box("w", box_a, (ROWS, COLS), (SPLIT - 10, 3)), "b": Box("w", box_b, (ROWS, COLS), (100, 0)),
            "cols": torch.full((70, 90), nan).t(), "half": torch.full((3000,), nan).bfloat16(),
            "scalar": torch.tensor(nan), "step": None, "note": None}


def _check(out, whole, local):
    assert torch.equal(out["a"], whole[SPLIT - 10:SPLIT + 9, 3:COLS - 37])
    assert torch.equal(out["b"], whole[100:100 + (ROWS - 100 + 1) // 2])
    for key in ("cols", "half", "scalar"):
        assert torch.equal(out[key], local[key]), key
    assert out["step"] == 17 and out["note"] == local["note"]


def _all_slots_back(pool):
    slots = [pool.acquire(block=False) for _ in range(pool.max_slots)]
    assert all(s is not None for s in slots), "a load kept staging slots"
    for s in slots:
        pool.release(s)


@pytest.mark.parametrize("seed, read_mode", [(1, "stream"), (2, "parallel"), (3, "stream")])
def test_late_copies_out_of_slots_land_before_reuse_and_before_return(saved, seed, read_mode):
    path, whole, local = saved
    backend = LateCopyBackend(seed)
    with _reading(path, 256 << 10, backend, read_mode) as (loader, pool):
        template = _template()
        out = loader.load(0, template)
        assert not backend.pending, "load returned before every copy out of a slot landed"
        _check(out, whole, local)
        assert out["cols"] is template["cols"]  # strided targets are filled in place
        assert backend.landed > 3 * pool.max_slots  # the slots cycled while copies were late
        assert pool.allocated_bytes <= pool.budget_bytes
        _all_slots_back(pool)


def _contiguous_template():
    """Contiguous host targets of the saved shapes: every tensor item can be read whole, straight into them."""
    nan = float("nan")
    return {"w0": Box("w", torch.full((SPLIT, COLS), nan), (ROWS, COLS), (0, 0)),
            "w1": Box("w", torch.full((ROWS - SPLIT, COLS), nan), (ROWS, COLS), (SPLIT, 0)),
            "cols": torch.full((90, 70), nan), "half": torch.full((3000,), nan).bfloat16(),
            "scalar": torch.tensor(nan), "step": None, "note": None}


@pytest.mark.parametrize("read_mode", ["stream", "parallel"])
def test_stream_reads_whole_items_into_contiguous_host_targets_parallel_stages_them(saved, read_mode):
    path, whole, local = saved
    backend = LateCopyBackend(4)
    with _reading(path, 256 << 10, backend, read_mode) as (loader, pool):
        template = _contiguous_template()
        out = loader.load(0, template)
        assert torch.equal(out["w0"], whole[:SPLIT]) and torch.equal(out["w1"], whole[SPLIT:])
        assert torch.equal(out["cols"], local["cols"]) and torch.equal(out["half"], local["half"])
        assert torch.equal(out["scalar"], local["scalar"]) and out["note"] == local["note"]
        assert out["w0"] is template["w0"].tensor  # filled in place
        if read_mode == "stream":
            assert backend.landed == 0  # no byte went through a slot
        else:
            assert backend.landed > pool.max_slots
        _all_slots_back(pool)


def test_a_load_without_template_and_the_verifier_read_every_saved_item(saved):
    """What the memory tier uses: the state rank 0 saved rebuilt (each item whole), and a check of every chunk."""
    path, whole, local = saved
    with _reading(path, 256 << 10, HostCopyBackend(2)) as (loader, pool):
        out = loader.load(0)
        assert torch.equal(out["w0"], whole[:SPLIT]) and torch.equal(out["w1"], whole[SPLIT:])
        assert torch.equal(out["cols"], local["cols"]) and out["note"] == local["note"]
        CheckpointVerifier(loader.checkpoint).verify(0)
        _all_slots_back(pool)


def test_chunks_larger_than_a_slot_read_into_buffers_of_their_own(saved):
    """A loader with a smaller staging budget than the saver's chunks still loads, within its budget."""
    path, whole, local = saved
    with _reading(path, 32 << 10, HostCopyBackend(2)) as (loader, pool):
        assert pool.slot_bytes < loader.checkpoint.items(0)["w0"].chunk_bytes
        _check(loader.load(0, _template()), whole, local)
        _all_slots_back(pool)


@pytest.mark.parametrize("read_mode", ["stream", "parallel"])
def test_buffers_of_their_own_live_until_the_copies_out_of_them_landed(saved, read_mode):
    """Copies out of a buffer of its own (a chunk larger than a slot) that land late and hold only its address,
    as the native copy pool's do, still find it: it is not freed when its read completes."""
    path, whole, local = saved
    with _reading(path, 32 << 10, LateAddressCopyBackend(7), read_mode) as (loader, pool):
        _check(loader.load(0, _template()), whole, local)
        out = loader.load(0, _contiguous_template())  # in "parallel", whole items through the buffers too
        assert torch.equal(out["w0"], whole[:SPLIT]) and torch.equal(out["w1"], whole[SPLIT:])
        _all_slots_back(pool)


@pytest.mark.parametrize("template", ["staged", "streamed into the targets"])
def test_damage_in_a_read_is_reported_and_gives_every_slot_back(saved, tmp_path, template):
    make = _template if template == "staged" else _contiguous_template
    path, _, _ = saved
    damaged = tmp_path / "iter_0000001"
    os.makedirs(damaged)
    for name in os.listdir(path):
        data = open(os.path.join(path, name), "rb").read()
        open(damaged / name, "wb").write(data)
    with _reading(path, 1 << 20, HostCopyBackend(2)) as (loader, _):
        item = loader.checkpoint.items(0)["w0"]
    pos = 150 * COLS * 4  # row 150 of the first block: inside the target's box "b"
    with open(damaged / "rank_00000.data", "r+b") as f:
        f.seek(item.offset + pos)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    with _reading(str(damaged), 1 << 20, HostCopyBackend(2)) as (loader, pool):
        with pytest.raises(CheckpointCorruptError, match=rf"checksum mismatch .* item 'w0' chunk {pos // item.chunk_bytes} "):
            loader.load(0, make())
        _all_slots_back(pool)
        with pytest.raises(CheckpointCorruptError, match=rf"checksum mismatch .* item 'w0' chunk {pos // item.chunk_bytes} "):
            CheckpointVerifier(loader.checkpoint).verify(0)
        _all_slots_back(pool)
        loader.checkpoint.close()  # the data file is opened again, and checked, at the next load
        os.truncate(damaged / "rank_00000.data", item.offset)  # refused at open, after a slot was taken
        with pytest.raises(CheckpointCorruptError, match="is truncated"):
            loader.load(0, make())
        _all_slots_back(pool)
