"""The engine saves tensors built on copy (`datastates.copies.built_on_copy`): shape-only tensors whose values
are asked for range by range as the copier stages them, each range at most a staging slot, every element asked
for once; the checkpoint on disk then loads back as exactly those values, views of them included."""
import pytest
import torch

from datastates import CheckpointEngine, PosixOptions, CheckpointError
from datastates.copies import built_on_copy

BUDGET = 1 << 20


def _source(shape, asked: list):
    full = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)

    def values(first: int, count: int) -> torch.Tensor:
        asked.append((first, count))
        return full.reshape(-1)[first:first + count].clone()
    return full, built_on_copy(full.shape, full.dtype, values)


def test_a_tensor_built_on_copy_is_saved_range_by_range_and_loads_as_its_values(tmp_path):
    asked, view_asked = [], []
    full, lazy = _source((3, 256, 1024), asked)  # 3 MiB through a 1 MiB staging budget
    other, other_lazy = _source((4, 1000), view_asked)
    state = {"big": lazy, "rows": other_lazy[1:3], "real": torch.ones(5)}
    with CheckpointEngine(host_buffer_bytes=BUDGET, storage=PosixOptions(writer_threads=1), rank=0,
                          world_size=1) as engine:
        engine.save(state, str(tmp_path / "ckpt" / "iter_0000001"))
        engine.wait()
        back = engine.load(str(tmp_path / "ckpt"), template={"big": torch.zeros(3, 256, 1024),
                                                             "rows": torch.zeros(2, 1000), "real": torch.zeros(5)})
    assert torch.equal(back["big"], full) and torch.equal(back["rows"], other[1:3])
    assert torch.equal(back["real"], torch.ones(5))
    assert max(count for _, count in asked) * 4 <= BUDGET  # never more than a slot's worth at once
    ranges = sorted(asked)
    assert ranges[0][0] == 0 and sum(c for _, c in ranges) == full.numel()  # every element once, in order
    assert all(a + n == b for (a, n), (b, _) in zip(ranges, ranges[1:]))
    assert sorted(view_asked) == [(1000, 2000)]  # the view's elements in its root, no others


def test_a_non_contiguous_view_of_one_is_refused_before_anything_is_written(tmp_path):
    _, lazy = _source((8, 16), [])
    with CheckpointEngine(host_buffer_bytes=BUDGET, storage=PosixOptions(writer_threads=1), rank=0,
                          world_size=1) as engine:
        with pytest.raises(CheckpointError, match="non-contiguous view of a built_on_copy tensor"):
            engine.save({"cols": lazy[:, 3]}, str(tmp_path / "ckpt" / "iter_0000001"))
    assert not (tmp_path / "ckpt" / "iter_0000001").exists()
