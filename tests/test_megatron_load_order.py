"""datastates/megatron.py loads a megatron-core sharded state dict in megatron-core's own order: non-persistent
values are merged back before the factory merges run, so a factory whose merge reads a non-persistent sibling
works. That is the shape of megatron-core's grouped-GEMM MLP with `singleton_local_shards`: its build puts a
`LocalNonpersistentObject(True)` beside the per-expert tensors, and its merge asserts
`sub_state_dict['singleton_local_shards']` before stacking them.

The same state dict goes through stock megatron-core (`dist_checkpointing.save` / `load`) and through the engine;
both must give the same merged tensor."""
from __future__ import annotations

import os

import torch

from datastates import CheckpointEngine, PosixOptions, paths

N_EXPERTS, ROWS, COLS = 3, 2, 4


def _expert_state(weight: torch.Tensor) -> dict:
    """{'fc1': factory}: the weight saved as one tensor per expert, merged back by stacking, reading the
    non-persistent flag that its build puts beside the expert tensors (as GroupedMLP does)."""
    from megatron.core.dist_checkpointing.mapping import (LocalNonpersistentObject, ShardedTensor,
                                                          ShardedTensorFactory)

    def build(key, t, replica_id, flattened_range):
        return {"singleton_local_shards": LocalNonpersistentObject(True),
                "data": [ShardedTensor.from_rank_offsets(f"{key}.expert{i}", t[i].clone(), replica_id=replica_id)
                         for i in range(t.shape[0])]}

    def merge(sub_state_dict):
        assert sub_state_dict["singleton_local_shards"] is True, sub_state_dict
        return torch.stack(sub_state_dict["data"])

    return {"fc1": ShardedTensorFactory("decoder.experts.fc1", weight, build, merge, replica_id=(0, 0, 0))}


def test_factory_merge_reads_a_nonpersistent_value_as_in_megatron_core(tmp_path, gloo):
    from megatron.core import dist_checkpointing
    from datastates.megatron import load_sharded, make_registry, save_sharded
    saved = torch.arange(N_EXPERTS * ROWS * COLS, dtype=torch.float32).reshape(N_EXPERTS, ROWS, COLS)

    stock = tmp_path / "stock"
    stock.mkdir()
    dist_checkpointing.save(_expert_state(saved.clone()), str(stock))
    from_stock = dist_checkpointing.load(_expert_state(torch.zeros_like(saved)), str(stock))

    path = paths.checkpoint_dir(str(tmp_path / "ds"), 1)
    with CheckpointEngine(host_buffer_bytes=1 << 20, storage=PosixOptions(writer_threads=2), rank=0, world_size=1,
                          registry=make_registry()) as eng:
        save_sharded(eng, _expert_state(saved.clone()), path).wait()
        ours = load_sharded(eng, _expert_state(torch.zeros_like(saved)), path)

    assert torch.equal(from_stock["fc1"], saved)
    assert torch.equal(ours["fc1"], saved)
    assert sorted(ours) == sorted(from_stock) == ["fc1"]
    assert os.path.exists(os.path.join(path, "metadata.json"))
