"""Publication across real processes (gloo): nothing is visible before every rank is done; a failed or missing
rank is named; DP replicas are written once and read back from their owner."""
import datetime
import json
import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2


def _worker(rank, root, port, errors):
    try:  # the rendezvous is the parent's store (its port chosen by the kernel when the parent bound it)
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=120))
        dist.init_process_group("gloo", rank=rank, world_size=WORLD, store=store)
        _scenarios(rank, root)
    except BaseException as e:  # report to the parent, which asserts
        import traceback
        errors.put(f"rank {rank}: {traceback.format_exc()}")
        raise SystemExit(1) from e
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _scenarios(rank, root):
    from datastates import CheckpointEngine, PosixOptions, CheckpointError, CheckpointTimeoutError, paths, tracker
    from datastates.providers import ProviderRegistry, StateProvider, default_registry

    class Shard:  # a minimal stand-in for a sharded tensor: name, local data, global box
        def __init__(self, name, data, offset, shape, owner=True):
            self.name, self.data, self.offset, self.shape, self.owner = name, data, offset, shape, owner

    class ShardProvider(StateProvider):
        def accepts(self, value):
            return isinstance(value, Shard)

        def flatten(self, value, path, ctx):
            return ctx.add_tensor(f"{value.name}@{value.offset}", value.data, scope="global", name=value.name,
                                  global_shape=value.shape, global_offset=value.offset, write=value.owner)

    registry = ProviderRegistry(default_registry.providers)
    registry.register(ShardProvider())
    full = torch.arange(40 * 6, dtype=torch.float32).view(40, 6)
    replicated = torch.full((5,), 7.0)

    def state(value):
        return {"rng": torch.get_rng_state(), "rank_value": torch.tensor(float(rank) + value),
                "w": Shard("w", full[rank * 20:(rank + 1) * 20] + value, (rank * 20, 0), (40, 6)),
                # a DP-replicated tensor: rank 1 writes it, rank 0 only reads it back
                "b": Shard("b", replicated + value, (0,), (5,), owner=rank == 1)}

    eng = CheckpointEngine(host_buffer_bytes=1 << 20, storage=PosixOptions(writer_threads=2), registry=registry,
                           publish_timeout_s=60)
    first = paths.checkpoint_dir(root, 1)

    # 1. not published until the last rank is done
    if rank == 0:
        eng.save(state(0.0), first)
        time.sleep(1.0)
        assert not os.path.exists(first), "published before rank 1 saved"
    dist.barrier()
    if rank == 1:
        eng.save(state(0.0), first)
    eng.wait()
    assert tracker.read_latest(root) == 1
    own = eng.load(root)
    assert torch.equal(own["rank_value"], torch.tensor(float(rank)))
    assert torch.equal(own["w"], full[rank * 20:(rank + 1) * 20])
    assert torch.equal(own["b"], replicated)  # rank 0 reads the replica rank 1 wrote
    whole = torch.zeros(40, 6)
    eng.load(first, template={"w": Shard("w", whole, (0, 0), (40, 6))})
    assert torch.equal(whole, full)
    names = sorted(os.listdir(first))
    assert names == ["metadata.json", "rank_00000.data", "rank_00000.manifest.json", "rank_00001.data",
                     "rank_00001.manifest.json"], names
    with open(os.path.join(first, "metadata.json")) as f:  # the global index lists the replica rank 0 skipped
        index = {it["id"]: it for it in json.load(f)["ranks"]["0"]["items"]}
    assert index["b@(0,)"]["write"] is False and index["w@(0, 0)"]["write"] is True
    dist.barrier()

    # 2. a rank whose save fails: every rank's wait names it, the previous checkpoint stays latest
    bad = state(1.0)
    if rank == 1:
        bad["fn"] = lambda: None
    eng.save(bad, paths.checkpoint_dir(root, 2))
    with pytest.raises(CheckpointError, match="rank 1.*not picklable" if rank == 0 else "not picklable"):
        eng.wait()  # rank 0 learns it from rank 1's report, rank 1 from its own save
    assert tracker.read_latest(root) == 1
    dist.barrier()
    assert not os.path.exists(paths.partial_dir(paths.checkpoint_dir(root, 2)))  # rank 0 removed it

    # 3. a rank that never saves: rank 0 gives up after the timeout and names it
    eng.publish_timeout_s = 2.0
    if rank == 0:
        eng.save(state(2.0), paths.checkpoint_dir(root, 3))
        t0 = time.monotonic()
        with pytest.raises(CheckpointTimeoutError, match=r"rank\(s\) \[1\] did not finish"):
            eng.wait()
        assert time.monotonic() - t0 < 30  # the timeout set above, not the 60 s the engine was built with
        assert tracker.read_latest(root) == 1
        assert not os.path.exists(paths.partial_dir(paths.checkpoint_dir(root, 3)))
    dist.barrier()
    eng.close()


def test_publication_across_two_processes(tmp_path):
    spawn_ranks(_worker, WORLD, str(tmp_path))


def spawn_ranks(worker, world: int, root: str) -> None:
    """Run `worker(rank, root, port, errors)` in `world` spawned processes; fail with what any of them put in
    `errors`, or with the exit codes."""
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    # bound here on port 0 and held open while the workers run: no port guessed, none probed and released
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    procs = [ctx.Process(target=worker, args=(r, root, store.port, errors)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=240)
    for p in procs:
        if p.is_alive():
            p.kill()
    messages = []
    while not errors.empty():
        messages.append(errors.get())
    assert not messages, "\n".join(messages)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
