"""Publication and load at scale: simulated worlds of 16 to 4,096 ranks on one machine.

Every rank is a real client of one TCPStore and writes the real file layout. Two ranks are real engines in
processes of their own, watched with strace: rank 0 (which gathers the reports, writes the global index and
publishes) and rank 1 (an ordinary rank). The other W-2 ranks are lightweight: each writes a tiny row shard and
its manifest with the engine's own format code and reports through the engine's own `Coordinator`, as a real
rank does once its data is durable. For each W this reports:

    publish_s        rank 0, from the last report to `latest` naming the checkpoint (SaveStats.publish_s)
    load_s           rank 1 loading its shard of the W-rank checkpoint (reads the index, then one data file)
    report_s         a lightweight rank's report, mean (O(1) store messages)
    syscalls_save    file-metadata syscalls (path-taking calls, fsync, getdents) of rank 1 for one checkpoint
    syscalls_save_r0 the same for rank 0
    json_opened_load JSON files rank 1 opens to load
    index_bytes      size of metadata.json

    python benchmarks/scale.py [--worlds 16 64 256 1024 4096] [--torch-dist-worlds 4 8 16] [--out ...]
    python benchmarks/scale.py --quick --out DIR   # a world of 16, torch_dist at 2 ranks
    python benchmarks/scale.py --fsdp2 [--worlds 16 64 256 1024]

--fsdp2: the state is FSDP2's instead of one row per rank: DTensors sharded on dim 0 over a mesh of all W ranks
(torch's own DeviceMesh and DTensor, over torch's "fake" process group: a W-rank mesh in one process), some of
whose rows do not divide W, so that the last ranks hold fewer rows or none, as FSDP2 leaves them. The observers
save them through the engine's DTensor provider and rank 1 loads its shards back in place, bytes checked; the
lightweight ranks write their rows of every tensor in torch's chunking. Two more columns: the torch.distributed
calls the observers make during each save (one all_gather_object the first time a structure is seen, to learn
every rank's box, none after: never one per tensor; the other ranks' answers are simulated, the fake process
group exchanging nothing) and the size of rank 1's manifest (flat in W: its own boxes only).

Beside it, megatron-core's torch_dist (`dist_checkpointing.save/load`) runs where this machine can hold a real
process per rank (`--torch-dist-worlds`): every rank saves its row of the same tensor, then loads it back; for
each W it reports rank 0's time for a second save (global planning, metadata and data; the first pays one-time
set-up), rank 1's load time, and the file-metadata syscalls and files opened of ranks 0 and 1.

Targets (docs/benchmarking.md): per-rank costs flat in W; rank-0 publication linear in W and under 1 s at
4,096 ranks; loading at 4,096 ranks under 1 s.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from syscalls import metadata_call, opens_json  # noqa: E402

ROW = 256  # floats per rank: the global tensor "w" is (W, ROW), rank r holds row r
MARK = "/nonexistent/datastates-scale-mark-"  # an os.stat of this path delimits phases in the strace log


def _store(port: int, master: bool = False):
    import datetime
    import torch.distributed as dist
    return dist.TCPStore("127.0.0.1", port, is_master=master, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=600))


WORLD = [0]  # the simulated world size, for the provider below
# --fsdp2: (name, global shape) of the DTensors, rows chosen not to divide the worlds (a 1,000-row tensor leaves
# 24 of 1,024 ranks without a row)
FSDP2_TENSORS = [("embedding.word_embeddings.weight", (5003, 16)), ("decoder.layers.0.self_attention.linear_qkv."
                 "weight", (3000, 16)), ("decoder.layers.0.self_attention.linear_proj.weight", (1000, 16)),
                 ("decoder.layers.0.mlp.linear_fc1.weight", (4100, 16)), ("decoder.layers.0.mlp.linear_fc2.weight",
                 (2050, 16)), ("decoder.final_layernorm.weight", (1000,)), ("output_layer.weight", (5003, 16))]
C10D_CALLS = ("all_gather_object", "all_gather", "all_gather_into_tensor", "all_reduce", "broadcast",
              "broadcast_object_list", "barrier", "gather", "gather_object", "scatter", "scatter_object_list",
              "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "send", "recv")


def _registry():
    """A rank's row ("row", rank, tensor) is a global item, as a megatron ShardedTensor would be."""
    from datastates import ProviderRegistry, StateProvider, default_registry

    class RowProvider(StateProvider):
        def accepts(self, value):
            return isinstance(value, tuple) and len(value) == 3 and value[0] == "row"

        def flatten(self, value, path, ctx):
            _, rank, t = value
            return ctx.add_tensor(f"w@{rank}", t, scope="global", name="w", global_shape=(WORLD[0], ROW),
                                  global_offset=(rank, 0))
    registry = ProviderRegistry(default_registry.providers)
    registry.register(RowProvider())
    return registry


def _row(rank: int):
    import torch
    return torch.full((1, ROW), float(rank))


def _rows(n: int, world: int, rank: int) -> tuple[int, int]:
    """torch's Shard(0) chunking (torch.chunk's): ceil(n / world) rows a rank, the last ones fewer or none."""
    per = -(-n // world)
    start = min(rank * per, n)
    return start, min(start + per, n)


def _fsdp2_values(index: int, shape: tuple, start: int, stop: int):
    """The rows [start, stop) of FSDP2 tensor `index`: each element its own value, so a misplaced row shows."""
    import torch
    cols = 1 if len(shape) == 1 else shape[1]
    t = torch.arange(start * cols, stop * cols, dtype=torch.float32) + index * 1e6
    return t if len(shape) == 1 else t.reshape(stop - start, cols)


def _fsdp2_state(rank: int, world: int, zero: bool = False) -> dict:
    """This rank's FSDP2 DTensors on a W-rank mesh (the fake process group: no peers needed), zeros to load into."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.testing._internal.distributed.fake_pg import FakeStore
    if not dist.is_initialized():
        dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    mesh = init_device_mesh("cpu", (world,))
    state = {}
    for i, (name, shape) in enumerate(FSDP2_TENSORS):
        start, stop = _rows(shape[0], world, rank)
        local = _fsdp2_values(i, shape, start, stop)
        stride = (shape[1], 1) if len(shape) == 2 else (1,)
        dt = DTensor.from_local(torch.zeros_like(local) if zero else local, mesh, [Shard(0)], run_check=False,
                                shape=torch.Size(shape), stride=stride)
        state[name] = dt
    return state


def _counting_c10d(world: int) -> list:
    """Count the torch.distributed calls made from now on (in this benchmark's observer processes only). The fake
    process group exchanges nothing, so `all_gather_object` (the engine learns a DTensor structure's boxes with
    one, datastates/dtensor_layouts.py) answers what the other ranks would send: their local shapes of each
    DTensor, by torch's chunking."""
    import torch.distributed as dist
    calls, shapes = [], dict(FSDP2_TENSORS)

    def every_rank(out, obj, group=None):
        for r in range(world):
            out[r] = {}
            for name in obj:
                shape = shapes[name]
                start, stop = _rows(shape[0], world, r)
                out[r][name] = (stop - start, *shape[1:])
    for name in C10D_CALLS:
        real = every_rank if name == "all_gather_object" else getattr(dist, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            calls.append(_name)
            return _real(*args, **kwargs)
        setattr(dist, name, counted)
    return calls


def _mark(label: str) -> None:
    try:
        os.stat(MARK + label)
    except FileNotFoundError:
        pass


def observer(rank: int, world: int, port: int, root: str, iters: int, fsdp2: bool) -> None:
    """A real engine as rank 0 or 1: save `iters` checkpoints, then (rank 1) load its row (its shards) back."""
    import torch
    from datastates import CheckpointEngine, PosixOptions
    from datastates.paths import checkpoint_dir, manifest_file
    WORLD[0] = world
    store = _store(port)
    state = _fsdp2_state(rank, world) if fsdp2 else {"w": ("row", rank, _row(rank))}
    calls = _counting_c10d(world) if fsdp2 else []
    per_save = []
    out = {}
    with CheckpointEngine(host_buffer_bytes=1 << 20, storage=PosixOptions(writer_threads=1), copy_threads=1,
                          rank=rank, world_size=world,
                          store=store, registry=_registry(), publish_timeout_s=600) as eng:
        for it in range(1, iters + 1):
            store.wait([f"go/{it}"])
            _mark(f"save{it}-begin")
            eng.save(state, checkpoint_dir(root, it))
            stats = eng.wait()[0]
            _mark(f"save{it}-end")
            per_save.append(len(calls) - sum(per_save))
        out.update(publish_s=stats.publish_s, durable_s=stats.durable_s, c10d_calls=per_save)
        if rank == 1:
            out["manifest_bytes"] = os.path.getsize(os.path.join(checkpoint_dir(root, iters), manifest_file(1)))
            template = _fsdp2_state(rank, world, zero=True) if fsdp2 else {"w": ("row", rank, torch.zeros(1, ROW))}
            _mark("load-begin")
            t0 = time.perf_counter()
            eng.load(root, template=template)
            out["load_s"] = time.perf_counter() - t0
            _mark("load-end")
            want = state if fsdp2 else {"w": ("row", rank, _row(rank))}
            for name, t in template.items():
                got, ref = (t._local_tensor, want[name]._local_tensor) if fsdp2 else (t[2], want[name][2])
                assert torch.equal(got, ref), f"rank 1 loaded wrong bytes for {name}"
    print("RESULT " + json.dumps(out), flush=True)


def _light_items(rank: int, world: int, fsdp2: bool) -> tuple[bytes, list]:
    """A lightweight rank's data file and its items (4 KiB-aligned, one checksummed chunk each), as an engine
    writes them: its row of "w", or (--fsdp2) its rows of every FSDP2 tensor, an empty box where it holds none."""
    from datastates import _native
    from datastates.schema import Item, Kind, Scope
    if not fsdp2:
        data = _row(rank).numpy().tobytes()
        return data, [Item(f"w@{rank}", Kind.TENSOR, Scope.GLOBAL, "w", "float32", (1, ROW), (world, ROW), (rank, 0),
                           offset=0, nbytes=len(data), chunk_bytes=len(data), crcs=[_native.crc32c(data)])]
    data, items = b"", []
    for i, (name, shape) in enumerate(FSDP2_TENSORS):
        start, stop = _rows(shape[0], world, rank)
        part = _fsdp2_values(i, shape, start, stop).numpy().tobytes()
        data += b"\0" * (-len(data) % 4096)
        items.append(Item(name, Kind.TENSOR, Scope.GLOBAL, name, "float32", (stop - start, *shape[1:]), shape,
                          (start, *(0,) * (len(shape) - 1)), offset=len(data), nbytes=len(part),
                          chunk_bytes=len(part), crcs=[_native.crc32c(part)] if part else []))
        data += part
    return data, items


def light_ranks(ranks: list[int], world: int, port: int, root: str, iters: int, fsdp2: bool, queue) -> None:
    """Lightweight ranks: the real file layout and the real Coordinator, without an engine's threads."""
    from datastates.storage.posix import write_file
    from datastates.paths import checkpoint_dir, data_file, manifest_file, partial_dir
    # the internals measured: a rank's report as the engine makes it (crc32c, records, signed manifest, Coordinator)
    from datastates import format as fmt
    from datastates.coordination import Coordinator
    from datastates.schema import Manifest
    store = _store(port)
    coords = {r: Coordinator(store, r, world) for r in ranks}
    times = []
    for it in range(1, iters + 1):
        store.wait([f"go/{it}"])
        partial = partial_dir(checkpoint_dir(root, it))
        for r in ranks:
            t0 = time.perf_counter()
            os.makedirs(partial, exist_ok=True)
            data, items = _light_items(r, world, fsdp2)
            with open(os.path.join(partial, data_file(r)), "wb") as f:
                f.write(data)
                os.fsync(f.fileno())
            manifest = fmt.signed_manifest(Manifest.written(r, world, len(data), False, items))
            write_file(os.path.join(partial, manifest_file(r)), fmt.encode_json(manifest), fsync=True)
            coords[r].report(it, manifest, None)
            times.append(time.perf_counter() - t0)
        for r in ranks:
            coords[r].verdict(it, f"checkpoint {it}", 600)
            coords[r].done(it)
    queue.put(times)


def torch_dist_rank(rank: int, world: int, port: int, root: str) -> None:
    """A megatron-core torch_dist rank: `dist_checkpointing.save` of its row of "w", then `load` of it."""
    import datetime

    import torch
    import torch.distributed as dist
    from megatron.training import cpu_shim
    cpu_shim.install()  # megatron-core's torch_dist strategy calls torch.cuda device helpers
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))

    def sharded(t):
        return {"w": ShardedTensor.from_rank_offsets("w", t, (0, rank, world))}
    out = {}
    for it in (1, 2):  # the first save pays one-time costs (imports, strategy set-up): the second is measured
        ckpt = os.path.join(root, f"iter_{it:07d}")
        if rank == 0:
            os.makedirs(ckpt)
        dist.barrier()
        _mark(f"save{it}-begin")
        t0 = time.perf_counter()
        dist_checkpointing.save(sharded(_row(rank)), ckpt)
        out["save_s"] = time.perf_counter() - t0
        _mark(f"save{it}-end")
    dist.barrier()
    template = torch.zeros(1, ROW)
    _mark("load-begin")
    t0 = time.perf_counter()
    loaded = dist_checkpointing.load(sharded(template), ckpt)
    out["load_s"] = time.perf_counter() - t0
    _mark("load-end")
    assert torch.equal(loaded["w"], _row(rank)), f"rank {rank} loaded wrong bytes"
    dist.barrier()
    if rank in (0, 1):
        print("RESULT " + json.dumps(out), flush=True)
    dist.destroy_process_group()


def run_torch_dist(world: int) -> dict:
    """Timings from a plain run, syscall counts from a second run with ranks 0 and 1 under strace."""
    row = _run_torch_dist(world, strace=None)
    if shutil.which("strace"):
        row.update({k: v for k, v in _run_torch_dist(world, shutil.which("strace")).items()
                    if k.startswith(("syscalls", "files"))})
    return row


def _run_torch_dist(world: int, strace: str | None) -> dict:
    import socket
    root = tempfile.mkdtemp(prefix=f"td-scale-{world}-", dir=os.environ.get("DS_SCALE_DIR"))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
               PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")]))
    procs, traces = [], {}
    for rank in range(world):
        cmd = [sys.executable, os.path.abspath(__file__), "--torch-dist-rank", str(rank), "--world", str(world),
               "--port", str(port), "--root", root]
        if strace and rank < 2:
            traces[rank] = os.path.join(root, f"strace{rank}.txt")
            cmd = [strace, "-f", "-qq", "-y", "-e", "trace=%file,%desc", "-o", traces[rank]] + cmd
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env))
    results = {}
    for rank, p in enumerate(procs):
        out, _ = p.communicate(timeout=900)
        if p.returncode != 0:
            raise SystemExit(f"torch_dist rank {rank} of {world} failed (exit {p.returncode}):\n{out[-3000:]}")
        if rank < 2:
            results[rank] = json.loads(out.split("RESULT ", 1)[1].splitlines()[0])
    row = {"world": world, "save_s": results[0]["save_s"], "load_s": results[1]["load_s"]}
    if strace:
        ckpt = os.path.join(root, "iter_0000002")
        row["syscalls_save_r0"] = _phase(traces[0], "save2", ckpt)[0]
        row["syscalls_save"] = _phase(traces[1], "save2", ckpt)[0]
        row["files_opened_load"] = _phase(traces[1], "load", ckpt)[2]
    shutil.rmtree(root, ignore_errors=True)
    return row


def _phase(trace: str, label: str, tree: str | None = None) -> tuple[int, int, int]:
    """(file-metadata syscalls, JSON files opened, files opened for reading) between the begin and end marks of
    a phase; with `tree`, only the calls on paths under it."""
    inside, calls, json_opened, opened = False, 0, 0, 0
    with open(trace) as f:
        for line in f:
            if MARK + label + "-begin" in line:
                inside = True
                continue
            if MARK + label + "-end" in line:
                break
            call = metadata_call(line) if inside else None
            if call and (tree is None or tree in call[1]):
                calls += 1
                json_opened += opens_json(call)
                opened += call[0].startswith("open") and "O_RDONLY" in call[1] and "O_DIRECTORY" not in call[1]
    return calls, json_opened, opened


def run_world(world: int, iters: int = 2, workers: int = 2, fsdp2: bool = False) -> dict:
    """Timings from a plain run, syscall counts from a second run under strace (which slows every call)."""
    row = _run_world(world, iters, workers, None, fsdp2)
    strace = shutil.which("strace")
    if strace:
        traced = _run_world(world, iters, workers, strace, fsdp2)
        row.update({k: traced[k] for k in ("syscalls_save", "syscalls_save_r0", "json_opened_load")})
    return row


def _tracker_text(root: str) -> str | None:
    """The tracker's text as an observer polls it (this process forks later: it does not import torch)."""
    try:
        with open(os.path.join(root, "latest_checkpointed_iteration.txt")) as f:
            return f.read().strip()
    except FileNotFoundError:
        return None


def _run_world(world: int, iters: int, workers: int, strace: str | None, fsdp2: bool) -> dict:
    root = tempfile.mkdtemp(prefix=f"ds-scale-{world}-", dir=os.environ.get("DS_SCALE_DIR"))
    store = _store(0, master=True)
    port = store.port
    procs, traces = {}, {}
    for rank in (0, 1):
        cmd = [sys.executable, os.path.abspath(__file__), "--observer", str(rank), "--world", str(world),
               "--port", str(port), "--root", root, "--iters", str(iters)] + (["--fsdp2"] if fsdp2 else [])
        if strace:
            traces[rank] = os.path.join(root, f"strace{rank}.txt")
            cmd = [strace, "-f", "-qq", "-y", "-e", "trace=%file,%desc", "-o", traces[rank]] + cmd
        procs[rank] = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    rest = list(range(2, world))
    light = [ctx.Process(target=light_ranks, args=(rest[i::workers], world, port, root, iters, fsdp2, queue))
             for i in range(workers) if rest[i::workers]]
    for p in light:
        p.start()
    for it in range(1, iters + 1):
        store.set(f"go/{it}", "1")
        while _tracker_text(root) != str(it):
            time.sleep(0.01)
    report_times = [t for _ in light for t in queue.get()]
    for p in light:
        p.join()
    results = {}
    for rank, p in procs.items():
        out, _ = p.communicate(timeout=600)
        if p.returncode != 0:
            raise SystemExit(f"observer rank {rank} failed (exit {p.returncode}):\n{out[-3000:]}")
        results[rank] = json.loads(out.split("RESULT ", 1)[1].splitlines()[0])
    row = {"world": world, "publish_s": results[0]["publish_s"], "load_s": results[1]["load_s"],
           "report_s": sum(report_times) / max(1, len(report_times)),
           "index_bytes": os.path.getsize(os.path.join(root, f"iter_{iters:07d}", "metadata.json")),
           "manifest_bytes_r1": results[1]["manifest_bytes"],
           "c10d_calls": [max(a, b) for a, b in zip(results[0]["c10d_calls"], results[1]["c10d_calls"])]}
    if strace:
        row["syscalls_save"] = _phase(traces[1], f"save{iters}", root)[0]
        row["syscalls_save_r0"] = _phase(traces[0], f"save{iters}", root)[0]
        row["json_opened_load"] = _phase(traces[1], "load", root)[1]
    shutil.rmtree(root, ignore_errors=True)
    return row


def plot(rows: list[dict], png: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    metrics = [k for k in ("publish_s", "load_s", "report_s", "syscalls_save", "syscalls_save_r0", "index_bytes")
               if k in rows[0]]
    fig, axes = plt.subplots(1, len(metrics), figsize=(3.2 * len(metrics), 3))
    worlds = [r["world"] for r in rows]
    for ax, k in zip(axes, metrics):
        ax.plot(worlds, [r[k] for r in rows], "o-")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("ranks (W)")
        ax.set_title(k, fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[16, 64, 256, 1024, 4096])
    ap.add_argument("--torch-dist-worlds", type=int, nargs="*", default=[4, 8, 16],
                    help="world sizes for megatron-core torch_dist (a real process per rank)")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--observer", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--torch-dist-rank", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--world", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--root", help=argparse.SUPPRESS)
    ap.add_argument("--iters", type=int, default=2, help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true", help="a simulated world of 16, torch_dist at 2 ranks")
    ap.add_argument("--fsdp2", action="store_true", help="FSDP2's DTensors over a W-rank mesh (no torch_dist rows)")
    a = ap.parse_args(argv)
    if a.quick:
        a.worlds, a.torch_dist_worlds = [16], [2]
    if a.fsdp2:  # megatron-core's torch_dist takes no FSDP2 DTensors: nothing to run beside it
        a.torch_dist_worlds = []
    if a.observer is not None:
        observer(a.observer, a.world, a.port, a.root, a.iters, a.fsdp2)
        return
    if a.torch_dist_rank is not None:
        torch_dist_rank(a.torch_dist_rank, a.world, a.port, a.root)
        return
    from deps import require
    require("matplotlib")
    rows = []
    header = f"{'W':>6} {'publish s':>10} {'load s':>8} {'report ms':>10} {'syscalls/ckpt r1':>17} " \
             f"{'r0':>6} {'json at load':>13} {'index KB':>9} {'manifest r1 B':>14} {'c10d calls/save':>16}"
    print(("FSDP2 DTensors\n" if a.fsdp2 else "") + header)
    for w in a.worlds:
        r = run_world(w, fsdp2=a.fsdp2)
        rows.append(r)
        print(f"{w:>6} {r['publish_s']:>10.3f} {r['load_s']:>8.3f} {r['report_s'] * 1e3:>10.2f} "
              f"{r.get('syscalls_save', '-'):>17} {r.get('syscalls_save_r0', '-'):>6} "
              f"{r.get('json_opened_load', '-'):>13} {r['index_bytes'] / 1024:>9.1f} {r['manifest_bytes_r1']:>14} "
              f"{' '.join(map(str, r['c10d_calls'])) or '-':>16}", flush=True)
    td_rows = []
    if a.torch_dist_worlds:
        print(f"\ntorch_dist\n{'W':>6} {'save s r0':>10} {'load s':>8} {'syscalls save r1':>17} {'r0':>6} "
              f"{'files opened at load':>21}")
    for w in a.torch_dist_worlds:
        r = run_torch_dist(w)
        td_rows.append(r)
        print(f"{w:>6} {r['save_s']:>10.3f} {r['load_s']:>8.3f} {r.get('syscalls_save', '-'):>17} "
              f"{r.get('syscalls_save_r0', '-'):>6} {r.get('files_opened_load', '-'):>21}", flush=True)
    os.makedirs(a.out, exist_ok=True)
    name = "scale_fsdp2" if a.fsdp2 else "scale"
    with open(os.path.join(a.out, f"{name}.json"), "w") as f:
        json.dump({"datastates": rows, "torch_dist": td_rows}, f, indent=1)
    plot(rows, os.path.join(a.out, f"{name}.png"))
    print(f"wrote {a.out}/{name}.json, {name}.png")


if __name__ == "__main__":
    main()
