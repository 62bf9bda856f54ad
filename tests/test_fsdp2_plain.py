"""Plain PyTorch FSDP2 (examples/fsdp2/train.py: `fully_shard`, AdamW, torch's distributed state dicts) checkpointed
through the engine's public API, in real gloo processes: a resume bit-identical to the uninterrupted run; loads
into 3 ranks and back into 2 (uneven Shard(0) rows, one rank of 3 holding none of a tensor) equal, bit for bit, to
the source's parameters and Adam moments; a replicated DTensor written by one rank and loaded in place by all; a
Partial DTensor refused by its name."""
import datetime
import importlib.util
import math
import multiprocessing
import os
import sys
import time
import traceback

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from datastates import CheckpointEngine, CheckpointReader, GlobalState, PosixOptions
from datastates.paths import checkpoint_dir

_spec = importlib.util.spec_from_file_location(
    "fsdp2_train", os.path.join(os.path.dirname(__file__), "..", "examples", "fsdp2", "train.py"))
example = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(example)

SIZES = [6, 11, 5, 2]  # weights of 11, 5 and 2 rows: uneven over 2 and 3 ranks; rank 2 of 3 holds no row of the last
ITERS, EVERY = 6, 3


def _rank(rank, world, port, errors, body, args):
    try:
        torch.set_num_threads(1)
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=60))
        dist.init_process_group("gloo", rank=rank, world_size=world, store=store)
        body(*args)
    except BaseException as e:  # to the parent, which asserts
        errors.put(f"rank {rank}: {traceback.format_exc()}")
        raise SystemExit(1) from e
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


# The ranks are forked from a server that imported this module and nothing else (no thread has run there): a fork
# of the test process itself, after other tests' threads (OpenMP's team among them), can hang in the child.
_RANKS = multiprocessing.get_context("forkserver")
_RANKS.set_forkserver_preload([__name__, "megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor"])


def _run(world, body, *args):
    """`body(*args)` on `world` gloo ranks forked from a clean server; fails with the first rank's traceback."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ctx = _RANKS
    errors = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, world, store.port, errors, body, args)) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + 120
    while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
        if any(p.exitcode not in (None, 0) for p in procs):
            break  # the others may wait for it in a collective: stop them now
        time.sleep(0.05)
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join()
    assert errors.empty(), errors.get()
    assert [p.exitcode for p in procs] == [0] * world


def _engine():
    return CheckpointEngine(host_buffer_bytes=8 << 20, storage=PosixOptions(writer_threads=2), publish_timeout_s=20)


def _full(model, optimizer) -> dict:
    """Every tensor of the live state, whole (gathered: a collective), by the name the checkpoint gives it."""
    out = {}
    for prefix, sd in (("model", get_model_state_dict(model)),
                       ("optim/state", get_optimizer_state_dict(model, optimizer)["state"])):
        for fqn, value in sd.items():
            for key, t in (value.items() if isinstance(value, dict) else [("", value)]):
                name = "/".join(filter(None, (prefix, fqn, key)))
                out[name] = t.full_tensor() if isinstance(t, DTensor) else t.clone()
    return out


def _train(root, start_from, out):
    """Train to ITERS with a checkpoint every EVERY (from `start_from`'s checkpoint if given); rank 0 writes the
    losses, the live state whole and the loaded iteration to `out`."""
    model, optimizer = example.build(SIZES)
    with _engine() as engine:
        start = example.resume(engine, start_from, model, optimizer) if start_from else 0
        losses = example.train(engine, model, optimizer, SIZES, start, ITERS, root, EVERY)
    full = _full(model, optimizer)
    if dist.get_rank() == 0:
        torch.save({"losses": losses, "full": full, "start": start}, out)


def _reshard(src, dst, out):
    """Load `src` into this number of ranks, write the live state whole to `out`, save it again to `dst`."""
    model, optimizer = example.build(SIZES, seed=1)  # other initial values: the load must replace every one
    with _engine() as engine:
        iteration = example.resume(engine, src, model, optimizer)
        full = _full(model, optimizer)
        engine.save(example.state(model, optimizer, iteration), checkpoint_dir(dst, iteration))
    if dist.get_rank() == 0:
        torch.save({"full": full, "iteration": iteration}, out)


def _saved(path) -> dict:
    with CheckpointReader.open(path) as r:
        return {name: r.tensor(name) for name in r.tensors()} | {name: r.object(name) for name in r.objects()}


def _same(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        if isinstance(a[name], torch.Tensor):
            assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name
        else:
            assert a[name] == b[name], name


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """The uninterrupted 2-rank run: its save root and what rank 0 wrote."""
    work = tmp_path_factory.mktemp("fsdp2_source")
    _run(2, _train, str(work / "ck"), None, str(work / "out.pt"))
    return str(work / "ck"), torch.load(work / "out.pt")


def test_the_checkpoint_holds_the_source_bit_for_bit(source):
    root, out = source
    saved = _saved(checkpoint_dir(root, ITERS))
    assert saved["iteration"] == ITERS
    assert {n for n in saved if n.endswith("/exp_avg_sq")} == {f"optim/state/{i}.{w}/exp_avg_sq"
                                                              for i in (0, 2, 4) for w in ("weight", "bias")}
    _same({n: saved[n] for n in out["full"]}, out["full"])
    assert saved["model/4.weight"].shape == (SIZES[3], SIZES[2])


def test_a_resume_is_bit_identical_to_the_uninterrupted_run(source, tmp_path):
    root, out = source
    _run(2, _train, str(tmp_path / "ck"), checkpoint_dir(root, EVERY), str(tmp_path / "out.pt"))
    resumed = torch.load(tmp_path / "out.pt")
    assert resumed["start"] == EVERY
    assert resumed["losses"] == out["losses"][EVERY:]
    _same(resumed["full"], out["full"])
    _same(_saved(checkpoint_dir(str(tmp_path / "ck"), ITERS)), _saved(checkpoint_dir(root, ITERS)))


def test_loads_into_three_ranks_and_back_into_two(source, tmp_path):
    root, out = source
    _run(3, _reshard, root, str(tmp_path / "ck3"), str(tmp_path / "out3.pt"))
    on3 = torch.load(tmp_path / "out3.pt")
    assert on3["iteration"] == ITERS
    _same(on3["full"], out["full"])
    _same(_saved(checkpoint_dir(str(tmp_path / "ck3"), ITERS)), _saved(checkpoint_dir(root, ITERS)))
    _run(2, _reshard, str(tmp_path / "ck3"), str(tmp_path / "ck2"), str(tmp_path / "out2.pt"))
    _same(torch.load(tmp_path / "out2.pt")["full"], out["full"])


def _replicated_and_partial(root):
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    rank = dist.get_rank()
    replicated = distribute_tensor(torch.arange(12.0).view(3, 4), mesh, [Replicate()])
    with _engine() as engine:
        engine.save(GlobalState({"r": replicated}), checkpoint_dir(root, 1))
        engine.wait()
        index = engine.checkpoint(root).global_index()
        assert [shard.rank for shard in index["r"]] == [0]  # one replica writes it
        local = replicated._local_tensor
        local.zero_()
        loaded = engine.load(root, template={"r": replicated})
        assert loaded["r"] is replicated and replicated._local_tensor is local  # in place, the DTensor back
        assert torch.equal(local, torch.arange(12.0).view(3, 4))
        partial = DTensor.from_local(torch.full((2,), float(rank)), mesh, [Partial()])
        with pytest.raises(ValueError, match=r"'grads/pending'.*Partial"):
            engine.save({"grads": {"pending": partial}}, checkpoint_dir(root, 2))


def test_replicas_write_once_and_a_partial_dtensor_is_refused_by_name(tmp_path):
    _run(2, _replicated_and_partial, str(tmp_path / "ck"))


def test_the_benchmark_s_quick_mode(tmp_path, capsys):
    """benchmarks/fsdp2_plain.py --quick (its restore phase checks every system's restored values itself)."""
    benchmarks = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
    if benchmarks not in sys.path:
        sys.path.insert(0, benchmarks)  # the script imports its helpers (common) by name
    spec = importlib.util.spec_from_file_location("bench_fsdp2_plain", os.path.join(benchmarks, "fsdp2_plain.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    result = bench.main(["--quick", "--out", str(tmp_path)])
    assert [r["system"] for r in result["systems"]] == ["engine_lazy", "engine_sync", "dcp_async", "dcp_sync"]
    for row in result["systems"]:
        assert 0 <= row["call_s"] <= row["call_fence_s"] <= row["durable_s"] and row["restore_s"] > 0, row
        assert row["loop_ratio"] > 0 and row["loop_held_s"] >= 0, row
    assert "| engine_lazy |" in capsys.readouterr().out
    assert (tmp_path / "fsdp2_plain.json").exists()


# Megatron-FSDP's layout: shards cut where its flat buffers put them, not by torch's rule (one rank may hold none),
# as `DTensor.from_local(..., shape=, stride=)` makes them; a 2x2 mesh (dp, tp) nests FSDP inside TP as
# Megatron-FSDP's `_shard_order` says. name -> (global shape, rows (columns for "r") of each rank, by global rank).
UNEVEN_ON_4 = {"w": ((10, 3), [3, 0, 5, 2]),           # 1-D mesh of 4, Shard(0)
               "n": ((12, 2), [4, 1, 2, 5]),           # (dp, tp) mesh, [Shard(0), Shard(0)], tp outer: 6 rows each
               "r": ((4, 6), [4, 2, 4, 2])}            # (dp, tp) mesh, [Replicate(), Shard(1)]
UNEVEN_ON_3 = {"w": [5, 5, 0], "n": [0, 12, 0], "r": [1, 2, 1]}  # all 1-D Shard(0) on 3 ranks


def _full_value(name, shape):
    return torch.arange(math.prod(shape), dtype=torch.float32).view(shape) * (1 + len(name))


def _uneven(name, shape, counts, mesh, placements, dim=0):
    """This rank's DTensor of `name`: the rows (or columns, `dim`) its place in `counts` gives it, taken from
    `_full_value`, nested over the mesh as `mesh._shard_order` (or torch) says."""
    rank = dist.get_rank()
    if mesh.ndim == 1:
        start = sum(counts[:rank])
    elif dim == 1:  # replicated over dp, columns over tp: both dp rows of a tp rank hold the same columns
        tp = rank % 2
        start = sum(counts[:tp])
    else:  # tp outer (rows [6 tp, 6 tp + 6)), dp inner
        dp, tp = divmod(rank, 2)
        start = shape[0] // 2 * tp + (counts[tp] if dp == 1 else 0)
    local = _full_value(name, shape).narrow(dim, start, counts[rank]).clone()
    return DTensor.from_local(local, mesh, placements, shape=torch.Size(shape),
                              stride=torch.empty(shape).stride())


def _save_uneven_on_4(root, out):
    from megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor import gather_and_compute_chunk_metadata
    calls = []
    counted = dist.all_gather_object

    def counting(*args, **kwargs):
        calls.append(kwargs.get("group"))
        return counted(*args, **kwargs)

    line = init_device_mesh("cpu", (4,))
    square = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    square._shard_order = [1, 0]  # as Megatron-FSDP marks it: TP sharded first (outer), then FSDP
    state = {"w": _uneven("w", *UNEVEN_ON_4["w"], line, [Shard(0)]),
             "n": _uneven("n", *UNEVEN_ON_4["n"], square, [Shard(0), Shard(0)]),
             "r": _uneven("r", *UNEVEN_ON_4["r"], square, [Replicate(), Shard(1)], dim=1)}
    more = dict(state, extra=_uneven("w", *UNEVEN_ON_4["w"], line, [Shard(0)]))
    dist.all_gather_object = counting
    try:
        with _engine() as engine:
            for step in (1, 2, 3):  # one structure: its boxes learned at the first save only
                engine.save(state, checkpoint_dir(root, step))
            assert len(calls) == 1
            engine.save(more, checkpoint_dir(root, 4))  # another structure: learned once more
            engine.wait()
            assert len(calls) == 2
            for dt in more.values():
                dt._local_tensor.zero_()
            loaded = engine.load(checkpoint_dir(root, 4), template=more)  # a known structure: no collective
            assert len(calls) == 2 and loaded["n"] is more["n"]
            bad = {"b": _uneven("b", (11, 2), [3, 0, 5, 2], line, [Shard(0)])}  # 10 rows held of 11
            with pytest.raises(ValueError, match=r"'b'.*cover \[\(10, 2\)\], not its global shape \(11, 2\)"):
                engine.save(bad, checkpoint_dir(root, 5))
            index = engine.checkpoint(checkpoint_dir(root, 4)).global_index()
    finally:
        dist.all_gather_object = counted
    for name, dt in more.items():  # back in place, and each box the one upstream's own helper computes
        full = _full_value(name if name != "extra" else "w", dt.shape)
        start = gather_and_compute_chunk_metadata(dt).offsets
        box = tuple(slice(o, o + n) for o, n in zip(start, dt._local_tensor.shape))
        assert torch.equal(dt._local_tensor, full[box]), name
        if dt._local_tensor.numel():
            assert tuple(start) in {tuple(s.box.offset) for s in index[name]}, (name, start)
    if dist.get_rank() == 0:
        torch.save({name: [(s.rank, tuple(s.box.offset)) for s in index[name] if s.box.volume()] for name in more},
                   out)


def _load_uneven_on_3(root):
    line = init_device_mesh("cpu", (3,))
    state = {name: _uneven(name, UNEVEN_ON_4[name][0], counts, line, [Shard(0)]) for name, counts in
             UNEVEN_ON_3.items()}
    for dt in state.values():
        dt._local_tensor.fill_(-1)
    with _engine() as engine:
        engine.load(checkpoint_dir(root, 3), template=state)
    for name, dt in state.items():
        rows = sum(UNEVEN_ON_3[name][:dist.get_rank()])
        assert torch.equal(dt._local_tensor, _full_value(name, dt.shape)[rows:rows + dt._local_tensor.shape[0]])


def test_uneven_shards_saved_by_their_true_boxes_learned_once_and_loaded_anywhere(tmp_path):
    root = str(tmp_path / "ck")
    _run(4, _save_uneven_on_4, root, str(tmp_path / "boxes.pt"))
    boxes = torch.load(tmp_path / "boxes.pt")
    assert boxes["w"] == [(0, (0, 0)), (2, (3, 0)), (3, (8, 0))]  # (rank 1 holds no row)
    assert boxes["n"] == [(0, (0, 0)), (1, (6, 0)), (2, (4, 0)), (3, (7, 0))]  # tp outer, dp inner
    assert boxes["r"] == [(0, (0, 0)), (1, (0, 4))]  # the dp replicas at coordinate 0 write
    _run(3, _load_uneven_on_3, root)
    saved = _saved(checkpoint_dir(root, 3))  # into plain whole tensors, without a live model
    assert sorted(saved) == ["n", "r", "w"]
    for name, value in saved.items():
        assert torch.equal(value, _full_value(name, UNEVEN_ON_4[name][0])), name
    assert not os.path.exists(checkpoint_dir(root, 5))  # the refused save wrote nothing
