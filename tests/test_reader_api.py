"""The reader's by-name API, what the tools read: tensors and boxes of them by name, objects by name, the common
state; and the names the megatron adapter gives items (datastates.names), which the tools parse.

Checkpoints are written in this process by the engine, by one rank and by two, with a provider that names items
as datastates.megatron does (without megatron-core's import): row shards of a tensor, a replicated one written by
rank 0 only, an object per rank (a ShardedObject's name), a flattened range per rank, common values. So every
box read here is assembled from whichever ranks' shards hold it."""
import argparse
import os
import shutil

import pytest
import torch

from datastates import (CheckpointCorruptError, CheckpointEngine, CheckpointError, CheckpointReader, PosixOptions,
                        Problems, ProviderRegistry, StateProvider)
from datastates.names import common_name, common_path, flat_name, is_flat, parse_shard_name, shard_name
from datastates.providers import ContainerProvider, ObjectProvider, TensorProvider

ROWS, COLS = 8, 6
ARGS = argparse.Namespace(hidden_size=COLS, num_layers=2)


class Shard:
    """A box of the global tensor `name` (`offset` into `global_shape`), written when `write`."""

    def __init__(self, name, data, global_shape, offset, write=True):
        self.name, self.data, self.global_shape, self.offset, self.write = name, data, global_shape, offset, write


class Named:
    """A global object: a common value (`common`) or a ShardedObject's value at grid `offset`."""

    def __init__(self, value, offset=None, write=True):
        self.value, self.offset, self.write = value, offset, write


class AdapterNaming(StateProvider):
    """Names items as datastates.megatron's MegatronProvider does."""

    def accepts(self, value):
        return isinstance(value, (Shard, Named))

    def flatten(self, value, path, ctx):
        if isinstance(value, Named):
            name = common_name(path) if value.offset is None else shard_name(path, value.offset)
            return ctx.add_object(name, value.value, scope="global", name=name, write=value.write)
        return ctx.add_tensor(shard_name(path, value.offset), value.data, scope="global", name=value.name,
                              global_shape=value.global_shape, global_offset=value.offset, write=value.write)


def _full():
    g = torch.Generator().manual_seed(3)
    return {"w": torch.randn(ROWS, COLS, generator=g), "norm": torch.randn(COLS, generator=g),
            "m": torch.randn(ROWS, COLS, generator=g)}


def _rank_state(rank: int, world: int, full: dict) -> dict:
    """Rank `rank`'s state of TP=world (row shards): what the trainer's state holds, named by the adapter."""
    rows = slice(rank * ROWS // world, (rank + 1) * ROWS // world)
    flat = flat_name("m", (rows.start, 0))  # the distributed optimizer's flattened range of the local shard
    return {
        "model": {"w": Shard("w", full["w"][rows], (ROWS, COLS), (rows.start, 0)),
                  "norm": Shard("norm", full["norm"], (COLS,), (0,), write=rank == 0)},
        "optimizer": {"m": Shard(flat, full["m"][rows].reshape(-1), (ROWS // world * COLS,), (0,))},
        "rng": Named([f"rng of rank {rank}"], offset=(rank,)),
        "local_step": torch.tensor([rank]),
        "args": Named(ARGS, write=rank == 0), "iteration": Named(7, write=rank == 0),
    }


@pytest.fixture(scope="module", params=[1, 2], ids=["world1", "world2"])
def saved(request, tmp_path_factory):
    """(checkpoint path, world size, the full tensors it holds)."""
    world, full = request.param, _full()
    path = str(tmp_path_factory.mktemp("reader_api") / "iter_0000007")
    store = torch.distributed.HashStore()
    registry = ProviderRegistry([AdapterNaming(), ContainerProvider(), TensorProvider(), ObjectProvider()])
    engines = [CheckpointEngine(host_buffer_bytes=1 << 20, storage=PosixOptions(writer_threads=1), rank=r,
                                world_size=world, store=store,
                                registry=registry) for r in range(world)]
    try:
        for r, eng in enumerate(engines):
            eng.save(_rank_state(r, world, full), path)
        for eng in engines:
            eng.wait()
    finally:
        for eng in engines:
            eng.close()
    return path, world, full


def test_tensors_and_objects_are_listed_by_name(saved):
    path, world, _ = saved
    with CheckpointReader.open(path, threads=2, staging_bytes=1 << 20) as reader:
        flats = {flat_name("m", (r * ROWS // world, 0)): ((ROWS // world * COLS,), torch.float32)
                 for r in range(world)}
        assert reader.tensors() == {"w": ((ROWS, COLS), torch.float32), "norm": ((COLS,), torch.float32), **flats}
        assert reader.objects() == sorted([common_name("args"), common_name("iteration")] +
                                          [shard_name("rng", (r,)) for r in range(world)])


def test_a_box_is_assembled_from_the_shards_that_hold_it(saved):
    path, world, full = saved
    with CheckpointReader.open(path, threads=2, staging_bytes=1 << 20) as reader:
        assert torch.equal(reader.tensor("w"), full["w"])
        assert torch.equal(reader.tensor("norm"), full["norm"])
        across = reader.tensor("w", offset=(3, 1), shape=(3, 4))  # rows 3..5: both ranks' shards at world 2
        assert torch.equal(across, full["w"][3:6, 1:5])
        assert torch.equal(reader.tensor("w", offset=(5, 0)), full["w"][5:])  # to the end of every axis
        out = torch.full((1, COLS), float("nan"))
        assert reader.tensor("w", offset=(ROWS - 1, 0), shape=(1, COLS), out=out) is out
        assert torch.equal(out, full["w"][-1:])
        last = flat_name("m", ((world - 1) * ROWS // world, 0))
        assert torch.equal(reader.tensor(last), full["m"][(world - 1) * ROWS // world:].reshape(-1))
        with pytest.raises(ValueError, match="not within 'w'"):
            reader.tensor("w", offset=(6, 0), shape=(3, COLS))
        with pytest.raises(ValueError, match="the box of 'w'"):
            reader.tensor("w", out=torch.empty(ROWS, COLS, dtype=torch.float64))
        with pytest.raises(CheckpointError, match="no tensor named 'rng@0'"):
            reader.tensor(shard_name("rng", (0,)))


def test_objects_by_name_and_the_common_state(saved):
    path, world, _ = saved
    with CheckpointReader.open(path, threads=2, staging_bytes=1 << 20) as reader:
        assert reader.object(common_name("args")) == ARGS
        assert reader.object(shard_name("rng", (world - 1,))) == [f"rng of rank {world - 1}"]
        with pytest.raises(CheckpointError, match="no object named 'w'"):
            reader.object("w")
        common = reader.common()  # the sharded model, optimizer and rng go, with the containers that held them
        assert set(common) == {"args", "iteration", "local_step"}, common
        assert common["args"] == ARGS and common["iteration"] == 7 and torch.equal(common["local_step"],
                                                                                    torch.tensor([0]))


def test_a_damaged_box_raises_or_is_reported(saved, tmp_path):
    path, world, _ = saved
    damaged = str(tmp_path / os.path.basename(path))
    shutil.copytree(path, damaged)
    with CheckpointReader.open(damaged, threads=2, staging_bytes=1 << 20) as reader:
        shard = next(sh for sh in reader.checkpoint.global_index()["w"] if sh.rank == world - 1)
        item = reader.checkpoint.shard_item(shard)
    with open(os.path.join(damaged, f"rank_{world - 1:05d}.data"), "r+b") as f:
        f.seek(item.offset)
        byte = f.read(1)
        f.seek(item.offset)
        f.write(bytes([byte[0] ^ 0xFF]))
    with CheckpointReader.open(damaged, threads=2, staging_bytes=1 << 20) as reader:
        with pytest.raises(CheckpointCorruptError, match="checksum"):
            reader.tensor("w")
        problems = Problems()
        reader.tensor("w", problems=problems)
        assert len(problems) == 1 and item.id in problems.summary(), problems.summary()


def test_the_adapter_s_names_parse_back():
    assert parse_shard_name(shard_name("decoder.layers.mlp", (1, 0, 2))) == ("decoder.layers.mlp", (1, 0, 2))
    assert parse_shard_name("decoder.final_layernorm.weight") is None
    assert common_path(common_name("optimizer/0/optimizer")) == "optimizer/0/optimizer"
    assert common_path(shard_name("rng", (0,))) is None
    assert is_flat(flat_name("m", (4, 0))) and not is_flat(shard_name("m", (4, 0)))
