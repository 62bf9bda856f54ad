"""The node-local memory tier (--non-persistent-save-interval), 4 ranks TP2 x DP2 on CPU, real torchrun runs.

One job saves to storage every 5 iterations and to memory every iteration, with two simulated nodes of 2 ranks
(DATASTATES_RANKS_PER_NODE) and replication factor 2; after iteration 8 the whole job is SIGKILLed, launcher
included. Copies of what it left are then restarted three ways: as is (resumes from memory at 8), with one
node's memory gone (recovered from the other node's replicas), and with one memory copy corrupted (falls back to
storage at 5). Every restart's losses equal those of an uninterrupted run.
"""
import os
import shutil

import pytest
import torch

from datastates import commit
from datastates.errors import CheckpointError
from datastates.local_tier import LocalTier, check_fits, cliques
from megatron_helpers import TINY, losses, torchrun

FLAGS = TINY + ["--tensor-model-parallel-size", "2", "--global-batch-size", "8", "--train-iters", "10"]
ENV = {"DATASTATES_JOB_ID": "memtier-test", "DATASTATES_RANKS_PER_NODE": "2"}


def _flags(root):
    return FLAGS + ["--save", str(root / "ck"), "--load", str(root / "ck"), "--save-interval", "5", "--async-ckpt",
                    "--non-persistent-save-interval", "1", "--non-persistent-local-ckpt-dir", str(root / "mem"),
                    "--replication", "--replication-factor", "2"]


@pytest.fixture(scope="module")
def reference():
    _, log = torchrun(4, FLAGS)
    ref = losses(log)
    assert sorted(ref) == list(range(1, 11)), log[-3000:]
    return ref


@pytest.fixture(scope="module")
def killed(tmp_path_factory, reference):
    root = tmp_path_factory.mktemp("killed")
    rc, log = torchrun(4, _flags(root), env=dict(ENV, FAULT_KILL_JOB_AFTER_LOCAL="8"), faults=True, check=False)
    assert rc != 0 and log.count("FAULT-KILL-JOB") == 4, log[-4000:]
    assert losses(log) == {i: reference[i] for i in range(1, 9)}
    assert commit.read_latest(str(root / "ck")) == 5
    job = root / "mem" / ENV["DATASTATES_JOB_ID"]
    for node, parts in ((0, (0, 1, 2, 3)), (1, (0, 1, 2, 3))):  # own parts and the other node's replicas
        for part in parts:
            assert commit.is_published(str(job / f"node_{node:05d}" / f"rank_{part:05d}" / "iter_0000008"))
    return root


def _restart(killed, tmp_path, change=None, env=ENV):
    shutil.copytree(killed / "ck", tmp_path / "ck")
    shutil.copytree(killed / "mem", tmp_path / "mem")
    if change is not None:
        change(tmp_path / "mem" / ENV["DATASTATES_JOB_ID"])
    _, log = torchrun(4, _flags(tmp_path), env=env)
    return log


def test_restart_resumes_from_memory(killed, tmp_path, reference):
    log = _restart(killed, tmp_path)
    assert "loaded checkpoint from the memory tier (datastates) at iteration 8" in log, log[-3000:]
    assert losses(log) == {9: reference[9], 10: reference[10]}
    assert not (tmp_path / "mem" / ENV["DATASTATES_JOB_ID"]).exists()  # the finished job's tier is gone


def test_lost_node_is_recovered_from_replicas(killed, tmp_path, reference):
    log = _restart(killed, tmp_path, lambda job: shutil.rmtree(job / "node_00001"))
    for rank in (2, 3):
        assert f"rank {rank}: memory checkpoint of iteration 8 recovered from rank" in log, log[-3000:]
    assert "loaded checkpoint from the memory tier (datastates) at iteration 8" in log
    assert losses(log) == {9: reference[9], 10: reference[10]}


def test_corrupt_memory_copy_falls_back_to_storage(killed, tmp_path, reference):
    def corrupt(job):
        data = job / "node_00000" / "rank_00001" / "iter_0000008" / "rank_00000.data"
        raw = bytearray(data.read_bytes())
        raw[100] ^= 0xFF
        data.write_bytes(bytes(raw))
    log = _restart(killed, tmp_path, corrupt)
    assert "memory checkpoint of iteration 8 failed verification" in log, log[-3000:]
    assert "at iteration 5" in log and "from the memory tier" not in log
    assert losses(log) == {i: reference[i] for i in range(6, 11)}


# ----- in one process: paths, jobs, layouts -----

def test_cliques_follow_megatron_replication_jump():
    assert cliques(8, 2, 4) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert cliques(8, 2, 1) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    with pytest.raises(CheckpointError, match="does not divide the world size 6"):
        cliques(6, 2, 2)


def _tier(base, job, layout=(1, 1, 1)):
    return LocalTier(str(base), job, 0, 1, list(layout), host_buffer_bytes=1 << 20, writer_threads=1)


def test_another_job_never_sees_a_tier_and_a_new_layout_clears_it(tmp_path):
    first = _tier(tmp_path, "job-a")
    first.engine.save({"w": torch.ones(10)}, first.path(3)).wait()
    first.close()
    other = _tier(tmp_path, "job-b")
    assert other._inventory() == {}
    other.close()
    assert commit.is_published(first.path(3))
    again = _tier(tmp_path, "job-a")
    assert again._inventory() == {0: [3]}
    again.close()
    relaid = _tier(tmp_path, "job-a", layout=(2, 1, 1))  # a restart in another layout cannot use these parts
    assert relaid._inventory() == {} and not os.path.exists(first.path(3))
    relaid.close()
    relaid.remove()
    assert sorted(os.listdir(tmp_path)) == ["job-b"]


def test_a_tier_that_does_not_fit_is_refused_before_any_work(tmp_path):
    with pytest.raises(CheckpointError, match=r"the memory tier needs about .* GiB in .* but only"):
        check_fits(str(tmp_path), 1 << 60)
