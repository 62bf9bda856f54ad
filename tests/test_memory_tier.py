"""The node-local memory tier (--non-persistent-save-interval), 4 ranks TP2 x DP2 on CPU, real torchrun runs.

One job saves to storage every 5 iterations and to memory every iteration, with two simulated nodes of 2 ranks
(DATASTATES_RANKS_PER_NODE) and replication factor 2; after iteration 8 the whole job is SIGKILLed, launcher
included. Copies of what it left are then restarted three ways: as is (resumes from memory at 8), with one
node's memory gone (recovered from the other node's replicas), and with one memory copy corrupted (falls back to
storage at 5). Every restart's losses equal those of an uninterrupted run. The job runs twice, its tier raw and
compressed (--ckpt-compress bytegroup-zstd: the parts, their replicas and a recovery travel as stored).
"""
import os
import re
import shutil

import pytest
import torch

from datastates import CheckpointEngine, read_index, tracker
from datastates.errors import CheckpointError
from datastates.memory_tier import LocalTier, check_fits, cliques, fitted_replication
from datastates.storage import SharedMemoryStorage
from datastates.verifier import CheckpointVerifier
from megatron_helpers import TINY, losses, torchrun

FLAGS = TINY + ["--tensor-model-parallel-size", "2", "--global-batch-size", "8", "--train-iters", "10"]
ENV = {"DATASTATES_JOB_ID": "memtier-test", "DATASTATES_RANKS_PER_NODE": "2"}


def _flags(root, compress="off"):
    return FLAGS + ["--ckpt-compress", compress, "--save", str(root / "ck"), "--load", str(root / "ck"), "--save-interval", "5", "--async-ckpt",
                    "--non-persistent-save-interval", "1", "--non-persistent-local-ckpt-dir", str(root / "mem"),
                    "--replication", "--replication-factor", "2"]


@pytest.fixture(scope="module")
def reference():
    _, log = torchrun(4, FLAGS)
    ref = losses(log)
    assert sorted(ref) == list(range(1, 11)), log[-3000:]
    return ref


@pytest.fixture(scope="module", params=["off", "bytegroup-zstd"], ids=["raw", "compressed"])
def killed(tmp_path_factory, reference, request):
    """(the killed job's directory, its --ckpt-compress): each kind of job is killed once, for every test below."""
    root, compress = tmp_path_factory.mktemp("killed"), request.param
    rc, log = torchrun(4, _flags(root, compress), env=dict(ENV, FAULT_KILL_JOB_AFTER_LOCAL="8"), faults=True,
                       check=False)
    assert rc != 0 and log.count("FAULT-KILL-JOB") == 4, log[-4000:]
    assert losses(log) == {i: reference[i] for i in range(1, 9)}
    assert tracker.read_latest(str(root / "ck")) == 5
    job = root / "mem" / ENV["DATASTATES_JOB_ID"]
    for node, parts in ((0, (0, 1, 2, 3)), (1, (0, 1, 2, 3))):  # own parts and the other node's replicas
        for part in parts:
            assert tracker.is_published(str(job / f"node_{node:05d}" / f"rank_{part:05d}" / "iter_0000008"))
    return root, compress


def _restart(killed, tmp_path, change=None):
    root, compress = killed
    shutil.copytree(root / "ck", tmp_path / "ck")
    shutil.copytree(root / "mem", tmp_path / "mem")
    if change is not None:
        change(tmp_path / "mem" / ENV["DATASTATES_JOB_ID"])
    _, log = torchrun(4, _flags(tmp_path, compress), env=ENV)
    return log


def test_restart_resumes_from_memory(killed, tmp_path, reference):
    root, compress = killed
    if compress != "off":  # the tier held its parts compressed
        part = root / "mem" / ENV["DATASTATES_JOB_ID"] / "node_00000" / "rank_00000" / "iter_0000008"
        items = read_index(str(part)).part(0).items.values()
        assert {it.codec for it in items if it.kind.value == "tensor" and it.nbytes} == {compress}
        assert sum(it.stored_bytes for it in items) < sum(it.nbytes for it in items)
    log = _restart(killed, tmp_path)
    assert "loaded checkpoint from the memory tier (datastates) at iteration 8" in log, log[-3000:]
    assert losses(log) == {9: reference[9], 10: reference[10]}
    assert not (tmp_path / "mem" / ENV["DATASTATES_JOB_ID"]).exists()  # the finished job's tier is gone


def test_lost_node_is_recovered_from_replicas(killed, tmp_path, reference):
    log = _restart(killed, tmp_path, lambda job: shutil.rmtree(job / "node_00001"))
    for rank in (2, 3):
        assert f"rank {rank}: memory checkpoint of iteration 8 of rank {rank} recovered from rank" in log, log[-3000:]
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
    # refused by name: the part's data file, the item and the chunk whose stored bytes do not match their crc
    assert re.search(r"checksum mismatch in '[^']*/node_00000/rank_00001/iter_0000008/rank_00000\.data': item "
                     r"'[^']+' chunk 0", log), log[-3000:]
    assert "at iteration 5" in log and "from the memory tier" not in log
    assert losses(log) == {i: reference[i] for i in range(6, 11)}


# ----- in one process: paths, jobs, layouts -----

def test_cliques_follow_megatron_replication_jump():
    assert cliques(8, 2, 4) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert cliques(8, 2, 1) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    with pytest.raises(CheckpointError, match="does not divide the world size 6"):
        cliques(6, 2, 2)


def test_the_replication_factor_fits_the_world_present():
    """What a job restarted on fewer nodes replicates with: the largest factor whose cliques tile the world."""
    assert fitted_replication(8, 4, 2, None) == (2, 4)  # 2 nodes of 4: as asked, peers a node apart
    assert fitted_replication(4, 4, 2, None) == (1, 4)  # one node left: no peer
    assert fitted_replication(6, 2, 3, None) == (3, 2) and fitted_replication(4, 2, 3, None) == (2, 2)  # 3, then 2
    assert fitted_replication(2, 1, 2, 4) == (1, 4)  # a jump longer than the world
    assert fitted_replication(8, 4, 2, 1) == (2, 1)  # a jump given is kept


def _tier(base, job, layout=(1, 1, 1)):
    return LocalTier(str(base), job, 0, 1, list(layout), host_buffer_bytes=1 << 20, writer_threads=1)


def test_another_job_never_sees_a_tier_and_a_new_layout_sets_it_apart(tmp_path):
    first = _tier(tmp_path, "job-a")
    first.engine.save({"w": torch.ones(10)}, first.path(3)).wait()
    first.close()
    other = _tier(tmp_path, "job-b")
    assert other.held() == {}
    other.close()
    assert tracker.is_published(first.path(3))
    again = _tier(tmp_path, "job-a")
    assert again.held() == {0: [3]} and again.replaced is None
    again.close()
    relaid = _tier(tmp_path, "job-a", layout=(2, 1, 1))  # a restart in another layout: the parts are set apart
    assert relaid.held() == {} and not os.path.exists(first.path(3))
    assert tracker.is_published(relaid.paths.before.part(0, 3))  # to be read into the new layout
    assert relaid.replaced == {"job": "job-a", "world_size": 1, "layout": [1, 1, 1]}  # for the resume line
    relaid.close()
    relaid.remove()
    assert sorted(os.listdir(tmp_path)) == ["job-b"]


def test_a_tier_that_does_not_fit_is_refused_before_any_work(tmp_path):
    with pytest.raises(CheckpointError, match=r"the memory tier needs about .* GiB in .* but only"):
        check_fits(str(tmp_path), 1 << 60)


def test_the_space_check_at_start_counts_the_parts_set_up_gives_back_and_those_it_sets_apart(tmpfs):
    """A 16 MiB memory file system holding a 4 MiB part of job-a: a restart in the same layout reuses the part's
    pages (they count as free); one in another layout sets the part apart, where it stays beside the new saves
    (it counts as taken, and the refusal says so); another job's check counts none of job-a's parts."""
    mnt = str(tmpfs("16m"))
    tier = _tier(mnt, "job-a")
    tier.engine.save({"w": torch.ones(1 << 20)}, tier.path(3)).wait()
    tier.close()
    free = SharedMemoryStorage().free_bytes(mnt)
    need = free + (2 << 20)  # more than is free, less than free + the part
    check_fits(mnt, need, "job-a", 0, 1, [1, 1, 1])
    with pytest.raises(CheckpointError, match=r"GiB of it held by parts of this job's earlier layout, set apart"):
        check_fits(mnt, need, "job-a", 0, 1, [2, 1, 1])
    with pytest.raises(CheckpointError, match=r"GiB are free there: lower"):
        check_fits(mnt, need, "job-b", 0, 1, [1, 1, 1])
    relaid = _tier(mnt, "job-a", layout=(2, 1, 1))  # the part set apart, for real
    relaid.close()
    with pytest.raises(CheckpointError, match=r"set apart"):
        check_fits(mnt, need, "job-a", 0, 1, [2, 1, 1])


# ----- real node detection (torchrun's GROUP_RANK / LOCAL_WORLD_SIZE, Slurm's SLURM_NODEID) -----

@pytest.fixture
def real_nodes(monkeypatch):
    """No simulated nodes: node_of reads what torchrun or Slurm set."""
    for name in ("DATASTATES_RANKS_PER_NODE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "SLURM_NODEID"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_node_detection_from_torchrun_and_slurm(real_nodes):
    from datastates.memory_tier import node_of
    assert node_of(5, 8) == (0, 8)  # nothing set: one node of every rank
    real_nodes.setenv("LOCAL_WORLD_SIZE", "4")
    assert node_of(5, 8) == (1, 4)  # no node id given: consecutive groups of LOCAL_WORLD_SIZE ranks
    real_nodes.setenv("SLURM_NODEID", "3")
    assert node_of(5, 16) == (3, 4)  # Slurm's node id
    real_nodes.setenv("GROUP_RANK", "2")
    assert node_of(5, 16) == (2, 4)  # torchrun's group rank comes first
    real_nodes.setenv("DATASTATES_RANKS_PER_NODE", "2")
    assert node_of(5, 16) == (2, 2)  # the simulation overrides them all
    real_nodes.setenv("DATASTATES_RANKS_PER_NODE", "3")
    with pytest.raises(CheckpointError, match="DATASTATES_RANKS_PER_NODE=3 does not divide the world size 16"):
        node_of(5, 16)


WORLD = 4


def _tier_rank(rank, warned, results, base, jump, lost_node, compress, chunk):
    """One rank of a 4-rank world: its memory part of iteration 3 saved (with `compress`) and replicated by its
    LocalTier; then, after `lost_node`'s directory is deleted, a restart of the tier that must find and load this
    rank's part. `chunk`: replicas travel in pieces of that many bytes, and the ranks' parts differ in size."""
    import torch.distributed as dist
    from datastates.memory_tier import replication, restart
    if chunk:
        replication.CHUNK_BYTES = restart.CHUNK_BYTES = chunk
    kw = dict(replication_factor=2, replication_jump=jump, timeout_s=60, host_buffer_bytes=1 << 20,
              writer_threads=1, compress=compress)
    tier = LocalTier(base, "job", rank, WORLD, [1, 1, WORLD], **kw)
    n = _elements(rank, chunk)
    handle = tier.engine.save({"w": torch.full((n,), float(rank)), "rank": rank}, tier.path(3))
    tier.replicate(3, handle)
    handle.wait()
    tier.close()  # every replication done on this rank
    dist.barrier()
    if rank == 0:
        job = os.path.join(base, "job")
        results.put(("saved", _held(job)))
        shutil.rmtree(os.path.join(job, f"node_{lost_node:05d}"))
    dist.barrier()
    again = LocalTier(base, "job", rank, WORLD, [1, 1, WORLD], **kw)
    path = again.choose(None)  # None: no memory checkpoint every rank can load
    loaded = path and again.engine.load(path, template={"w": torch.zeros(n), "rank": -1})
    # the values, not every one of them: what a rank puts on the queue must fit the pipe before the test reads it
    w = path and loaded["w"]
    results.put((rank, {"loaded": path and (path, loaded["rank"], w.unique().tolist(), w.numel()), "warnings": warned}))
    again.close()


def _world_rank(rank, world, store, env, target, args, results):
    """A forked rank: nodes as `env` says ("{rank}" and "{half}" filled in), a gloo world of `world` ranks, the
    tier's warnings collected; then `target(rank, warnings, results, *args)`. Prints and exits 1 on any error."""
    import datetime
    import logging
    import sys
    import traceback

    import torch.distributed as dist
    try:
        torch.set_num_threads(1)
        warned = []
        handler = logging.Handler(logging.WARNING)
        handler.emit = lambda record: warned.append(record.getMessage())
        logging.getLogger("datastates.memory_tier").addHandler(handler)
        for name in ("DATASTATES_RANKS_PER_NODE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "SLURM_NODEID"):
            os.environ.pop(name, None)
        os.environ.update({k: v.format(rank=rank, half=rank // 2) for k, v in env.items()})
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))
        target(rank, warned, results, *args)
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)


def _fork_world(tmp_path, world, env, target, *args) -> dict:
    """Run `target` (see `_world_rank`) on `world` forked ranks; what they put on `results`, as a dict (one entry
    a rank and one more)."""
    import multiprocessing
    ctx = multiprocessing.get_context("fork")
    results = ctx.Queue()
    procs = [ctx.Process(target=_world_rank, args=(r, world, str(tmp_path / "store"), env, target, args, results))
             for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    for p in procs:
        if p.exitcode is None:  # stuck behind a rank that failed
            p.kill()
            p.join()
    assert [p.exitcode for p in procs] == [0] * world  # a failed rank printed its traceback
    return dict(results.get(timeout=10) for _ in range(world + 1))


def _elements(rank: int, chunk: int | None) -> int:
    return 100 if chunk is None else 100 + 3000 * rank


def _run_tier_world(tmp_path, env, jump, lost_node, compress="off", chunk=None):
    return _fork_world(tmp_path, WORLD, env, _tier_rank, str(tmp_path / "mem"), jump, lost_node, compress, chunk)


def _parts(job):
    """node directory -> rank -> the iterations of that rank's parts the node holds, published."""
    return {node: {int(r[5:]): sorted(int(i[5:]) for i in os.listdir(os.path.join(job, node, r))
                                      if tracker.is_published(os.path.join(job, node, r, i)))
                   for r in os.listdir(os.path.join(job, node)) if r.startswith("rank_")}
            for node in sorted(os.listdir(job)) if node.startswith("node_")}


def _held(job):
    """node -> the ranks whose part of iteration 3 the node holds, published."""
    return {int(node[5:]): sorted(r for r, its in ranks.items() if 3 in its) for node, ranks in _parts(job).items()}


@pytest.mark.parametrize("env, jump, cliques_, compress, chunk", [
    # torchrun on 4 nodes of one rank each, a replication jump of 2 (the default would be 1, the ranks per node)
    ({"LOCAL_WORLD_SIZE": "1", "GROUP_RANK": "{rank}"}, 2, [[0, 2], [1, 3]], "off", None),
    # ranks started by Slurm (srun): SLURM_NODEID names the node, the default jump (ranks per node, 1)
    ({"LOCAL_WORLD_SIZE": "1", "SLURM_NODEID": "{rank}"}, None, [[0, 1], [2, 3]], "off", None),
    # the same as the first, the parts compressed: replicas and the recovery travel as stored
    ({"LOCAL_WORLD_SIZE": "1", "GROUP_RANK": "{rank}"}, 2, [[0, 2], [1, 3]], "bytegroup-zstd", None),
    # parts of 4 sizes (0.4 to 36 KB) sent in pieces of 8 KiB: a peer's part ends inside a piece, or before it
    ({"LOCAL_WORLD_SIZE": "1", "GROUP_RANK": "{rank}"}, 2, [[0, 2], [1, 3]], "off", 8 << 10),
], ids=["torchrun-jump2", "slurm-default-jump", "torchrun-jump2-compressed", "torchrun-jump2-in-pieces"])
def test_replicas_land_on_the_clique_peers_nodes(tmp_path, env, jump, cliques_, compress, chunk):
    """Nodes from the launcher's environment, not simulated: each node holds its rank's part and the part of
    its clique peer (jump apart), byte for byte the same; a node lost entirely is recovered from its peer."""
    got = _run_tier_world(tmp_path, env, jump, lost_node=1, compress=compress, chunk=chunk)
    job = tmp_path / "mem" / "job"
    peer = {a: b for clique in cliques_ for a, b in (clique, clique[::-1])}
    assert got["saved"] == {n: sorted({n, peer[n]}) for n in range(WORLD)}
    # the lost node 1 is rebuilt by the restart with rank 1's own part, fetched from its peer's node
    held = _held(str(job))
    assert held == {n: sorted({n, peer[n]}) if n != 1 else [1] for n in range(WORLD)}, held
    for rank in range(WORLD):
        path = str(job / f"node_{rank:05d}" / f"rank_{rank:05d}" / "iter_0000003")
        assert got[rank]["loaded"] == (path, rank, [float(rank)], _elements(rank, chunk))
        assert got[rank]["warnings"] == []
    for node in (0, 2, 3):  # a replica is the original's index and data, byte for byte
        other = peer[node]
        replica = job / f"node_{node:05d}" / f"rank_{other:05d}" / "iter_0000003"
        original = job / f"node_{other:05d}" / f"rank_{other:05d}" / "iter_0000003"
        index = (original / "metadata.json").read_bytes()
        assert (replica / "metadata.json").read_bytes() == index
        size = read_index(str(original)).part(0).data_bytes
        assert (replica / "rank_00000.data").read_bytes()[:size] == (original / "rank_00000.data").read_bytes()[:size]
    if compress != "off":  # held compressed: the file is the stored bytes, smaller than the 400 raw of `w`
        for rank in range(WORLD):
            part = job / f"node_{rank:05d}" / f"rank_{rank:05d}" / "iter_0000003"
            w = read_index(str(part)).part(0).items["w"]
            assert w.codec == compress and w.stored_bytes < w.nbytes == 400
            assert (part / "rank_00000.data").stat().st_size == read_index(str(part)).part(0).data_bytes


def test_a_clique_on_one_node_is_warned_and_replicates_nothing(tmp_path):
    """torchrun's 2 nodes of 2 ranks with --replication-jump 1: each clique is on one node, which every rank
    warns about; no replica is sent (the node holds the part already), so a lost node is not recoverable from
    memory and every rank's restart goes to storage."""
    got = _run_tier_world(tmp_path, {"LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "{half}"}, 1, lost_node=1)
    assert got["saved"] == {0: [0, 1], 1: [2, 3]}
    for rank in range(WORLD):
        clique = [rank - rank % 2, rank - rank % 2 + 1]
        assert got[rank]["warnings"] == [f"replication clique {clique} is on one node: a lost node loses every copy "
                                         "(set --replication-jump to the ranks per node)"] * 2, got[rank]
        assert got[rank]["loaded"] is None


def _one_node_rank(rank, warned, results, base):
    """One of the 2 ranks of the one node left of a job that asked for --replication-factor 2: its tier starts
    (no clique to join), saves and replicates; the notices it logged."""
    import logging
    told = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: told.append(record.getMessage())
    logging.getLogger("datastates.memory_tier").addHandler(handler)
    logging.getLogger("datastates.memory_tier").setLevel(logging.INFO)
    tier = LocalTier(base, "job", rank, 2, [2, 1, 1], replication_factor=2, timeout_s=60, host_buffer_bytes=1 << 20,
                     writer_threads=1)
    handle = tier.engine.save({"w": torch.full((100,), float(rank))}, tier.path(3))
    tier.replicate(3, handle)
    tier.close()
    results.put((rank, {"told": told, "warnings": warned, "error": handle.error}))
    torch.distributed.barrier()  # every rank's part published before rank 0 lists them
    if rank == 0:
        results.put(("parts", _parts(os.path.join(base, "job"))))


def test_a_single_node_left_starts_its_tier_without_replication(tmp_path):
    """torchrun's restart of a 2-node job with --replication-factor 2 on the one node left: the tier starts
    (it failed every restart attempt with "4 does not divide the world size 2"), says so in one line, and each
    rank's part is held by its node alone."""
    got = _fork_world(tmp_path, 2, {"LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0"}, _one_node_rank,
                      str(tmp_path / "mem"))
    for rank in range(2):
        assert got[rank] == {"told": ["NOTICE: replication follows the world: 1 node of 2 ranks present, too few for "
                                      "--replication-factor 2 x --replication-jump 2: no replication (storage holds "
                                      "what a lost node held)"], "warnings": [], "error": None}, got[rank]
    assert got["parts"] == {"node_00000": {0: [3], 1: [3]}}


def _old_layout_rank(rank, warned, results, base):
    """One rank of 2 nodes of 2 (DP4): its part of iteration 3 in the tier, no replication."""
    tier = LocalTier(base, "job", rank, 4, [1, 1, 4], host_buffer_bytes=1 << 20, writer_threads=1)
    tier.engine.save({"w": torch.full((1000,), float(rank)), "rank": rank}, tier.path(3)).wait()
    tier.close()
    results.put((rank, warned))
    torch.distributed.barrier()  # every rank's part published before rank 0 lists them
    if rank == 0:
        results.put(("parts", _parts(os.path.join(base, "job"))))


def _new_layout_rank(rank, warned, results, base):
    """One rank of the same 2 nodes with 1 rank each (DP2): the tier's choice, read like a storage checkpoint of
    the old world (every old rank's part verified through it)."""
    import logging
    told = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: told.append(record.getMessage())
    logging.getLogger("datastates.memory_tier").addHandler(handler)
    logging.getLogger("datastates.memory_tier").setLevel(logging.INFO)
    tier = LocalTier(base, "job", rank, 2, [1, 1, 2], host_buffer_bytes=1 << 20, writer_threads=1)
    merged = tier.choose(None)
    checkpoint = tier.engine.checkpoint(merged)
    for old in range(4):
        CheckpointVerifier(checkpoint).verify(old)
    results.put((rank, {"merged": merged, "world": checkpoint.world_size, "iteration": checkpoint.index.iteration,
                        "told": [m for m in told if "recovered" in m or "set apart" in m]}))
    tier.close()
    torch.distributed.barrier()  # every part sent before rank 0 lists them
    if rank == 0:
        results.put(("before", _parts(os.path.join(base, "job", "before"))))


def test_a_new_layout_reads_the_old_one_merged_with_the_parts_each_node_lacked(tmp_path):
    """The same 2 nodes restarted with 1 rank each instead of 2: each node held its own 2 ranks' parts of the old
    layout (no replication), is sent the other node's 2, verifies them, and reads all 4 as one checkpoint of the
    old world, byte for byte as saved."""
    base = str(tmp_path / "mem")
    (tmp_path / "old").mkdir()
    (tmp_path / "new").mkdir()
    saved = _fork_world(tmp_path / "old", 4, {"DATASTATES_RANKS_PER_NODE": "2"}, _old_layout_rank, base)
    assert saved["parts"] == {"node_00000": {0: [3], 1: [3]}, "node_00001": {2: [3], 3: [3]}}
    got = _fork_world(tmp_path / "new", 2, {"DATASTATES_RANKS_PER_NODE": "1"}, _new_layout_rank, base)
    assert got["before"] == {f"node_0000{n}": {r: [3] for r in range(4)} for n in range(2)}
    for rank in range(2):
        lacked = [2, 3] if rank == 0 else [0, 1]
        assert got[rank] == {
            "merged": os.path.join(base, "job", "before", f"node_0000{rank}", "merged", "iter_0000003"), "world": 4,
            "iteration": 3,
            "told": [f"NOTICE: memory tier {base}/job/node_0000{rank} holds checkpoints of another layout (world size "
                     f"4): set apart in {base}/job/before/node_0000{rank}, to be read into this one"] +
                    [f"NOTICE: rank {rank}: memory checkpoint of iteration 3 of rank {p} recovered from rank {1 - rank}'s "
                     f"replica (node {1 - rank})" for p in lacked]}, got[rank]


def _machine_rank(rank, warned, results, tmp, machines, groups, factor, lost):
    """One rank on machine `machines[rank]` (its own tier directory) as torchrun node `groups[rank]`: its part
    of iteration 3 saved (replicated with `factor`); then, with the tier directories of the `lost` machines gone,
    nothing else."""
    os.environ.update({"GROUP_RANK": str(groups[rank]), "LOCAL_WORLD_SIZE": str(groups.count(groups[rank]))})
    world = len(machines)
    tier = LocalTier(str(tmp / machines[rank]), "job", rank, world, [1, 1, world], replication_factor=factor,
                     replication_jump=groups.count(groups[rank]), timeout_s=60, host_buffer_bytes=1 << 20,
                     writer_threads=1)
    handle = tier.engine.save({"w": torch.full((1000,), float(rank)), "rank": rank}, tier.path(3))
    tier.replicate(3, handle)
    tier.close()
    torch.distributed.barrier()
    if rank == 0:
        for machine in lost:
            shutil.rmtree(tmp / machine)
    results.put((rank, warned))
    if rank == 0:
        results.put(("world", world))


def _renumbered_rank(rank, warned, results, tmp, machines, groups):
    """One rank of the job re-formed on `machines` as nodes `groups`: the tier's choice, read like a storage
    checkpoint of the old world (every old rank's part verified through it)."""
    import logging
    told = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: told.append(record.getMessage())
    logging.getLogger("datastates.memory_tier").addHandler(handler)
    logging.getLogger("datastates.memory_tier").setLevel(logging.INFO)
    os.environ.update({"GROUP_RANK": str(groups[rank]), "LOCAL_WORLD_SIZE": str(groups.count(groups[rank]))})
    world = len(machines)
    tier = LocalTier(str(tmp / machines[rank]), "job", rank, world, [1, 1, world], host_buffer_bytes=1 << 20,
                     writer_threads=1)
    merged = tier.choose(None)
    checkpoint = merged and tier.engine.checkpoint(merged)
    for old in range(checkpoint.world_size if checkpoint else 0):
        CheckpointVerifier(checkpoint).verify(old)
    results.put((rank, {"merged": merged, "world": checkpoint and checkpoint.world_size,
                        "told": [m for m in told if "node" in m and ("now" in m or "recovered" in m)], "warnings": warned}))
    tier.close()
    torch.distributed.barrier()
    if rank == 0:
        results.put(("world", world))


@pytest.mark.parametrize("old, new, lost, factor", [
    # machines a (node 0) and b (node 1), 2 ranks each, replicas 2 apart; a is lost and b is node 0 of 1 now
    ((("a", 0), ("a", 0), ("b", 1), ("b", 1)), (("b", 0), ("b", 0)), ["a"], 2),
    # machine b alone (node 0); machine a joins as node 0 and b is node 1 now: a is sent every old part
    ((("b", 0), ("b", 0)), (("a", 0), ("a", 0), ("b", 1), ("b", 1)), [], 1),
], ids=["node-0-lost", "grown-node-before"])
def test_a_job_re_formed_with_its_nodes_numbered_anew_reads_its_memory(tmp_path, old, new, lost, factor):
    """torchrun numbers a re-formed job's nodes anew: a machine's memory holds its parts under the number it had
    (node_00001), and finds them under the one it has now (node_00000): no lost memory whichever node went, or
    came."""
    (tmp_path / "old").mkdir()
    (tmp_path / "new").mkdir()
    machines, groups = [m for m, _ in old], [g for _, g in old]
    _fork_world(tmp_path / "old", len(old), {}, _machine_rank, tmp_path, machines, groups, factor, lost)
    machines, groups = [m for m, _ in new], [g for _, g in new]
    got = _fork_world(tmp_path / "new", len(new), {}, _renumbered_rank, tmp_path, machines, groups)
    for rank in range(len(new)):
        node, machine = groups[rank], machines[rank]
        assert got[rank]["merged"] == str(tmp_path / machine / "job" / "before" / f"node_{node:05d}" / "merged" /
                                          "iter_0000003"), got[rank]
        assert got[rank]["world"] == len(old) and got[rank]["warnings"] == [], got[rank]
    recovered = [m for r in range(len(new)) for m in got[r]["told"] if "recovered" in m]
    assert recovered == ([] if lost else [f"NOTICE: rank 0: memory checkpoint of iteration 3 of rank {p} recovered "
                                          f"from rank 2's replica (node 1)" for p in (0, 1)]), recovered
    renamed = [m for r in range(len(new)) for m in got[r]["told"] if "are node" in m]
    assert renamed == ([f"NOTICE: memory tier {tmp_path}/b/job/node_00001: the parts this machine held as node 1 "
                        f"are node 0's now ({tmp_path}/b/job/node_00000)"] if lost else
                       [f"NOTICE: memory tier {tmp_path}/b/job/node_00000: the parts this machine held as node 0 "
                        f"are node 1's now ({tmp_path}/b/job/node_00001)"]), got


def test_replication_jump_is_validated_before_any_work():
    from megatron.training.arguments import ArgumentError, parse_args
    from megatron.training.argument_checks import validate_args
    argv = FLAGS + ["--non-persistent-save-interval", "1", "--replication", "--replication-factor", "2"]
    assert validate_args(parse_args(argv=argv + ["--replication-jump", "1"]), 4, cuda=False).replication_jump == 1
    with pytest.raises(ArgumentError, match="--replication-factor 2 x --replication-jump 4 must divide the world "
                                            "size 4"):
        validate_args(parse_args(argv=argv + ["--replication-jump", "4"]), 4, cuda=False)


def test_replication_is_checked_at_start_by_the_tiers_own_rule(monkeypatch):
    """4 ranks on one node, factor 2: the tier's cliques (2 ranks a node apart) cannot tile the world, so the job is
    refused at start, not run without replication; 2 nodes of 2 can."""
    from megatron.training.argument_checks import validate_args
    from megatron.training.arguments import ArgumentError, parse_args
    argv = FLAGS + ["--non-persistent-save-interval", "1", "--replication", "--replication-factor", "2"]
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    with pytest.raises(ArgumentError, match=r"--replication-factor 2 x --replication-jump 4 \(the ranks per node, 4, "
                                            r"when not given\) must divide the world size 4"):
        validate_args(parse_args(argv=argv), 4, cuda=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert validate_args(parse_args(argv=argv), 4, cuda=False).replication_factor == 2


def test_a_torchrun_restart_on_fewer_nodes_is_not_refused_for_its_replication_flags(monkeypatch):
    """Refused at the job's start, the same flags pass on a restart (the tier fits the cliques to the world)."""
    from megatron.training.argument_checks import validate_args
    from megatron.training.arguments import parse_args
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    argv = FLAGS + ["--non-persistent-save-interval", "1", "--replication", "--replication-factor", "2",
                    "--replication-jump", "2"]
    assert validate_args(parse_args(argv=argv), 2, cuda=False).replication_jump == 2


def _behind_rank(rank, warned, results, base, compress):
    """One rank of 2 nodes saving iterations 1-3 to its tier (which keeps 2): rank 1 hands each save to
    replication as it is made, rank 0 only once all three are published, when retention has retired its part of 1
    already."""
    import torch.distributed as dist
    tier = LocalTier(base, "job", rank, 2, [1, 1, 2], replication_factor=2, timeout_s=20,
                     host_buffer_bytes=1 << 20, writer_threads=1, compress=compress)
    handles = {}
    for it in (1, 2, 3):
        handles[it] = tier.engine.save({"w": torch.full((100,), 10.0 * rank + it), "it": it}, tier.path(it))
        handles[it].wait()
        if rank == 1:
            tier.replicate(it, handles[it])
    if rank == 0:
        for it, handle in handles.items():
            tier.replicate(it, handle)
    tier.close()  # every exchange done on this rank
    results.put((rank, {"warnings": warned}))
    dist.barrier()
    if rank == 0:
        results.put(("held", _parts(os.path.join(base, "job"))))


@pytest.mark.parametrize("compress", ["off", "bytegroup-zstd"])
def test_a_replicator_behind_the_saves_stays_in_step_with_its_clique(tmp_path, compress):
    """A part retired before replication reaches it is sent as nothing, so the clique's exchanges stay in step:
    every replica kept is the peer's part of that very iteration, byte for byte, and no rank waits on a
    collective its peer never makes (before, rank 0 skipped iteration 1 and paired its 2 with its peer's 1)."""
    got = _fork_world(tmp_path, 2, {"LOCAL_WORLD_SIZE": "1", "GROUP_RANK": "{rank}"}, _behind_rank,
                      str(tmp_path / "mem"), compress)
    job = tmp_path / "mem" / "job"
    assert got["held"] == {f"node_{n:05d}": {0: [2, 3], 1: [2, 3]} for n in (0, 1)}, got["held"]
    for node, peer in ((0, 1), (1, 0)):
        for it in (2, 3):
            replica = job / f"node_{node:05d}" / f"rank_{peer:05d}" / f"iter_{it:07d}"
            original = job / f"node_{peer:05d}" / f"rank_{peer:05d}" / f"iter_{it:07d}"
            assert (replica / "metadata.json").read_bytes() == (original / "metadata.json").read_bytes()
            size = read_index(str(original)).part(0).data_bytes
            assert (replica / "rank_00000.data").read_bytes()[:size] == (original / "rank_00000.data").read_bytes()[:size]
            loaded = CheckpointEngine(rank=0, world_size=1).load(str(replica), template={"w": torch.zeros(100), "it": 0})
            assert loaded["it"] == it and loaded["w"].tolist() == [10.0 * peer + it] * 100
    assert len(got[0]["warnings"]) == 1 and "iteration 1 was retired before replication reached it" in \
        got[0]["warnings"][0] and got[1]["warnings"] == [], got


def _exchange_killed_rank(rank, warned, results, base, phase):
    """Two nodes of one rank, factor 2, replicas in 8 KiB pieces. Phase "kill": iteration 3 saved and replicated,
    then iteration 5, whose exchange rank 1 dies in for real (SIGKILL after its first data piece: a test hook on
    its own all-gathers); rank 0 reports what its node holds once its exchange failed. Phase "restart": node 1
    is lost, both ranks start their tier again, load what `choose` finds, then save and replicate iteration 7."""
    import signal
    import time

    import torch.distributed as dist
    from datastates.memory_tier import replication
    replication.CHUNK_BYTES = 8 << 10
    kw = dict(replication_factor=2, replication_jump=1, timeout_s=20, host_buffer_bytes=1 << 20, writer_threads=1)
    tier = LocalTier(base, "job", rank, 2, [1, 1, 2], **kw)
    state = {"w": torch.full((10_000,), float(rank))}
    if phase == "restart":
        path = tier.choose(None)
        loaded = tier.engine.load(path, template={"w": torch.zeros(10_000)})["w"].unique().tolist()
        handle = tier.engine.save(state, tier.path(7))
        tier.replicate(7, handle)
        handle.wait()
        tier.close()
        results.put((rank, {"loaded": (path, loaded), "warnings": warned}))
        if rank == 0:
            results.put(("parts", None))
        return
    peer_replica = tier.paths.part(1 - rank, 3)
    for iteration in (3, 5):
        if iteration == 5:
            deadline = time.monotonic() + 30
            while not tracker.is_published(peer_replica) and time.monotonic() < deadline:
                time.sleep(0.05)
            dist.barrier()
            if rank == 1:
                calls, gather = [0], dist.all_gather

                def dying(*args, **kwargs):  # sizes, indexes, the first piece; dies in the second
                    calls[0] += 1
                    if calls[0] == 4:
                        os.kill(os.getpid(), signal.SIGKILL)
                    return gather(*args, **kwargs)
                replication.dist.all_gather = dying
        handle = tier.engine.save(state, tier.path(iteration))
        tier.replicate(iteration, handle)
        handle.wait()
    deadline = time.monotonic() + 60
    while not tier.errors and time.monotonic() < deadline:
        time.sleep(0.05)
    held = sorted(os.listdir(os.path.dirname(tier.paths.part(1, 5))))
    results.put((0, {"errors": [type(e).__name__ for e in tier.errors], "held": held}))
    results.put(("parts", _parts(os.path.join(base, "job"))))
    results.close()
    results.join_thread()
    os._exit(0)  # the process group has a dead member: nothing to tear down


def test_a_peer_killed_during_a_replica_exchange_leaves_whole_copies_and_the_next_run_replicates(tmp_path):
    """A peer SIGKILLed halfway through sending its part: the receiver's exchange fails, the half-received
    replica is discarded (no iteration 5 of rank 1 on node 0, published or not), the earlier replica stays whole;
    node 1 then lost, the restart finds iteration 3 whole (rank 1's part from node 0's replica, verified) and
    the next save replicates again on both nodes."""
    import multiprocessing
    env, base = {"LOCAL_WORLD_SIZE": "1", "GROUP_RANK": "{rank}"}, str(tmp_path / "mem")
    ctx = multiprocessing.get_context("fork")
    results = ctx.Queue()
    procs = [ctx.Process(target=_world_rank, args=(r, 2, str(tmp_path / "store"), env, _exchange_killed_rank,
                                                  (base, "kill"), results)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, -9]
    got = dict(results.get(timeout=10) for _ in range(2))
    assert got[0]["errors"] and got[0]["held"] == ["iter_0000003"], got
    assert got["parts"]["node_00000"] == {0: [3, 5], 1: [3]} and got["parts"]["node_00001"][1] == [3, 5], got
    shutil.rmtree(os.path.join(base, "job", "node_00001"))
    os.remove(tmp_path / "store")
    again = _fork_world(tmp_path, 2, env, _exchange_killed_rank, base, "restart")
    job = os.path.join(base, "job")
    for rank in (0, 1):
        assert again[rank]["loaded"] == (os.path.join(job, f"node_{rank:05d}", f"rank_{rank:05d}", "iter_0000003"),
                                         [float(rank)]), again
    parts = _parts(job)
    assert 7 in parts["node_00000"][1] and 7 in parts["node_00001"][0], parts
