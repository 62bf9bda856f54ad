"""The engine's read side under damage: a check collects every problem in one run, a load stops at the first.

A three-rank checkpoint of one logical tensor (a row block per rank, several checksummed chunks each) plus
rank-local tensors and objects, saved by three engines in this process (one store), is damaged on disk: bytes
flipped in two chunks of rank 0's block and one of rank 2's, rank 1's data file truncated, rank 2's manifest
deleted. One `audit_checkpoint(..., verify=True)` names all of them, each with its rank, item and file offset;
the load path (the trainer's) refuses at the first; a load that collects reads every other byte bit-exact.
"""
import json
import os
import shutil

import pytest
import torch

from datastates import CheckpointEngine, PosixOptions, Problems, audit_checkpoint, paths
from datastates.loader import CheckpointLoader
from datastates.open_checkpoint import OpenCheckpoint
from datastates.errors import CheckpointCorruptError, CheckpointError
from test_load_reads import Box, _registry

WORLD, ROWS, COLS = 3, 12, 1000  # each rank's block: 4 rows of 4000 bytes, chunks of at most a slot (8 KiB)


def _state(rank: int, whole: torch.Tensor) -> dict:
    rows = ROWS // WORLD
    return {"w": Box("w", whole[rank * rows:(rank + 1) * rows].clone(), whole.shape, (rank * rows, 0)),
            "local": torch.full((3000,), float(rank)), "note": f"rank {rank}"}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(checkpoint directory, the logical tensor)."""
    whole = torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(3))
    path = paths.checkpoint_dir(str(tmp_path_factory.mktemp("audit")), 5)
    store = torch.distributed.HashStore()
    engines = [CheckpointEngine(host_buffer_bytes=48 << 10, storage=PosixOptions(writer_threads=2), rank=r,
                                world_size=WORLD, store=store,
                                registry=_registry(), publish_timeout_s=60) for r in range(WORLD)]
    try:
        for r, eng in enumerate(engines):
            eng.save(_state(r, whole), path)
        for eng in engines:
            eng.wait()
    finally:
        for eng in engines:
            eng.close()
    return path, whole


def _item(path: str, rank: int, name: str) -> dict:
    with open(os.path.join(path, paths.METADATA)) as f:
        items = json.load(f)["ranks"][str(rank)]["items"]
    return next(i for i in items if i.get("name") == name or i["id"] == name)


def _flip(path: str, rank: int, item: dict, chunk: int) -> int:
    """Flip a byte inside chunk `chunk` of `item`; its file offset (the chunk's start)."""
    offset = item["offset"] + chunk * item["chunk_bytes"]
    with open(os.path.join(path, paths.data_file(rank)), "r+b") as f:
        f.seek(offset + 3)
        b = f.read(1)
        f.seek(offset + 3)
        f.write(bytes([b[0] ^ 0x10]))
    return offset


@pytest.fixture
def damaged(saved, tmp_path):
    """A copy with four problems in three ranks: (path, the logical tensor, {(rank, file offset) of each flipped
    chunk}, (rank 1, its truncated size))."""
    src, whole = saved
    path = str(tmp_path / "iter_0000005")
    shutil.copytree(src, path)
    w0, w2 = _item(path, 0, "w"), _item(path, 2, "w")
    assert len(w0["crcs"]) >= 2, w0  # the block spans several checksummed chunks
    flipped = {(0, _flip(path, 0, w0, 0)), (0, _flip(path, 0, w0, 1)), (2, _flip(path, 2, w2, 0))}
    data1 = os.path.join(path, paths.data_file(1))
    size = os.path.getsize(data1) - 100
    os.truncate(data1, size)
    os.unlink(os.path.join(path, paths.manifest_file(2)))
    return path, whole, flipped, (1, size)


def test_one_audit_reports_every_problem_of_every_rank(damaged):
    path, _, flipped, truncated_at = damaged
    found = audit_checkpoint(path, verify=True, threads=2)
    problems = found.problems.found
    mismatches = [p for p in problems if "checksum mismatch" in p.message]
    assert {(p.rank, p.offset) for p in mismatches} == flipped  # rank 2's bytes are checked without its manifest
    for p in mismatches:
        assert p.file == os.path.join(path, paths.data_file(p.rank)) and p.item == _item(path, p.rank, "w")["id"]
    truncated = [p for p in problems if "truncated" in p.message]
    assert [(p.rank, p.offset) for p in truncated] == [truncated_at]
    missing = [p for p in problems if p.file.endswith(paths.manifest_file(2))]
    assert len(missing) == 1 and "missing" in missing[0].message and missing[0].rank == 2
    assert len(problems) == 5, [p.message for p in problems]  # and nothing else
    assert found.stats["chunks"] > 0


def test_a_truncated_file_still_has_the_items_before_its_end_verified(saved, tmp_path):
    src, _ = saved
    path = str(tmp_path / "iter_0000005")
    shutil.copytree(src, path)
    data = os.path.join(path, paths.data_file(1))
    local = _item(path, 1, "local")
    os.truncate(data, local["offset"] + local["nbytes"])  # the pickled objects after the tensors are cut off
    _flip(path, 1, local, 0)
    found = audit_checkpoint(path, verify=True, threads=2)
    assert {p.item for p in found.problems.found if "checksum mismatch" in p.message} == {local["id"]}
    assert any("truncated" in p.message and p.rank == 1 for p in found.problems.found)


def test_the_load_stops_at_the_first_problem(damaged):
    path, whole, _, _ = damaged
    with CheckpointEngine(host_buffer_bytes=48 << 10, storage=PosixOptions(writer_threads=2), rank=0, world_size=1,
                          registry=_registry()) as eng:
        template = {"w": Box("w", torch.zeros(ROWS // WORLD, COLS), whole.shape, (0, 0))}  # rank 0's rows
        with pytest.raises(CheckpointCorruptError, match="checksum mismatch in .*rank_00000.data.* chunk 0"):
            eng.load(path, template)


def test_a_collecting_load_reports_every_damaged_chunk_and_reads_the_rest(damaged):
    path, whole, flipped, truncated_at = damaged
    rows = ROWS // WORLD
    problems = Problems()
    with OpenCheckpoint.standalone(path, threads=2, staging_bytes=48 << 10) as checkpoint:
        out = CheckpointLoader(checkpoint, _registry()).load(0, {"w0": Box("w", torch.zeros(rows, COLS), whole.shape, (0, 0)),
                              "w1": Box("w", torch.zeros(rows, COLS), whole.shape, (rows, 0))}, problems)
    assert {(p.rank, p.offset) for p in problems.found} == {f for f in flipped if f[0] == 0} | {truncated_at}
    assert torch.equal(out["w1"], whole[rows:2 * rows])  # within rank 1's short file, after the damaged chunks
    assert not torch.equal(out["w0"], whole[:rows])


def test_the_stopping_policy_raises_the_error_it_is_given():
    with pytest.raises(CheckpointCorruptError, match="bad bytes"):
        Problems.stop().add("f", "bad bytes", CheckpointCorruptError, rank=0)
    problems = Problems()
    problems.add("f", "bad bytes", rank=0, item="x", offset=8)
    problems.add("f", "bad bytes", rank=0, item="x", offset=8)  # reported once
    assert problems.items == [{"file": "f", "problem": "bad bytes", "rank": 0, "item": "x", "offset": 8}]
    with pytest.raises(CheckpointError, match="^any$"):
        Problems.stop().add("f", "any")
