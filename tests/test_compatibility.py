"""Checkpoints written by earlier releases load: the bytes on disk are the format (docs/format.md), whatever the
engine's code becomes. tests/fixtures/ holds a save root written by main at fe86c63, before the storage seam took
the reads and the typed write side: two ranks, a global tensor split between them, rank-local tensors of several
dtypes and layouts, and objects. It is loaded here whole, into another layout, and checked byte for byte."""
import argparse
import os
import sys

import torch

from datastates import CheckpointEngine, PosixOptions, audit_checkpoint
from test_load_reads import Box, _registry

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "fe86c63")
GLOBAL = (6, 5)


def state(rank: int) -> dict:
    """What rank `rank` of two saved: the same function wrote the fixture."""
    g = torch.Generator().manual_seed(100 + rank)
    whole = torch.arange(30, dtype=torch.float32).reshape(GLOBAL) / 7
    base = torch.randn(8, 6, generator=g)
    return {"w": Box("w", whole[3 * rank:3 * rank + 3], GLOBAL, (3 * rank, 0)),
            "local": {"f32": base, "bf16": base.bfloat16(), "strided": base[::2, 1::2], "int": torch.arange(7) * rank,
                      "scalar": torch.tensor(2.5 + rank), "big": torch.randn(20_000, generator=g)},
            "objects": {"args": argparse.Namespace(lr=1e-3, rank=rank), "step": 3, "note": "x" * (1000 + rank)}}


def write(root: str) -> None:
    """Save the fixture (run with an older checkout first on sys.path)."""
    store = torch.distributed.HashStore()
    engines = [CheckpointEngine(host_buffer_bytes=256 << 10, storage=PosixOptions(writer_threads=1), rank=r,
                                world_size=2, store=store,
                                registry=_registry()) for r in range(2)]
    for r, eng in enumerate(engines):
        eng.save(state(r), os.path.join(root, "iter_0000003"))
    for eng in engines:
        eng.close()


def _same(a, b):
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, Box):  # a load without a template gives the saved block back as a tensor
        _same(a.tensor, b)
    else:
        assert a == b


def test_a_checkpoint_of_an_earlier_main_loads_and_verifies():
    from datastates import tracker  # not at the top: `write` runs this module over the older checkout
    assert tracker.read_latest(FIXTURE) == 3
    audit = audit_checkpoint(os.path.join(FIXTURE, "iter_0000003"), verify=True)
    assert not audit.problems, audit.problems.summary()
    assert audit.stats["bytes_read"] > 0
    with CheckpointEngine(host_buffer_bytes=256 << 10, storage=PosixOptions(writer_threads=1),
                          registry=_registry()) as eng:
        for rank in range(2):
            _same(state(rank), eng.load(FIXTURE, rank=rank))
        whole = torch.zeros(GLOBAL)
        loaded = eng.load(FIXTURE, {"w": Box("w", whole, GLOBAL, (0, 0))})  # one rank takes both halves
        assert loaded["w"] is whole and torch.equal(whole, torch.arange(30, dtype=torch.float32).reshape(GLOBAL) / 7)


if __name__ == "__main__":
    write(sys.argv[1])
