"""Restore with and without the exchange (--ckpt-fully-parallel-load): 1, 2 and 4 ranks on this machine.

Each world saves a distributed-optimizer layout through megatron-core's ShardedTensors (`datastates.megatron`):
bf16 model weights replicated on every rank (their writers spread by ReplicaOwnership) and fp32 main params plus
two Adam moments sharded across the ranks, 14 bytes a parameter as in Megatron-LM. Then it restores the same
layout, alternating without and with the exchange, `--repeats` times each, and reports the slowest rank's
restore (median), and the bytes and requests read from storage summed over the ranks, against the checkpoint's
unique bytes. Stream reads drop their pages behind them, so every restore reads the disk.

    python benchmarks/read_once.py [--params 16e6] [--worlds 1 2 4] [--repeats 3] [--dir /tmp/read_once]
    python benchmarks/read_once.py --quick --dir DIR   # seconds: 64k parameters, 2 ranks, 1 repeat
"""
from __future__ import annotations

import argparse
import datetime
import os
import shutil
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TENSORS = 8  # weight tensors, and as many optimizer tensors per kind


def _state(rank: int, world: int, params: int, fill: bool) -> dict:
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    n = params // TENSORS // world * world
    state = {}
    for i in range(TENSORS):
        w = torch.randn(n).to(torch.bfloat16) if fill else torch.empty(n, dtype=torch.bfloat16)
        state[f"w{i}"] = ShardedTensor.from_rank_offsets(f"w{i}", w, replica_id=rank)
        for kind in ("param", "exp_avg", "exp_avg_sq"):
            part = torch.randn(n // world) if fill else torch.empty(n // world)
            state[f"{kind}{i}"] = ShardedTensor.from_rank_offsets(f"{kind}{i}", part, (0, rank, world))
    return state


def _rank(rank: int, world: int, port: int, args, out) -> None:
    from datastates import CheckpointEngine, Exchange
    from datastates import format as fmt  # an internal: the skeleton item's id, left out of the unique bytes
    from datastates.megatron import ReplicaOwnership, load_sharded, make_registry, save_sharded
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=300))
    dist.init_process_group("gloo", rank=rank, world_size=world, store=store)
    ownership = ReplicaOwnership()
    engine = CheckpointEngine(host_buffer_bytes=256 << 20, registry=make_registry(ownership))
    path = os.path.join(args.dir, f"w{world}", "iter_0000001")
    save_sharded(engine, _state(rank, world, args.params, True), path, ownership=ownership)
    engine.wait()
    exchange = Exchange() if world > 1 else None
    rows = []
    for _ in range(args.repeats):
        for ex in (None, exchange) if world > 1 else (None,):
            stats = engine.checkpoint(path).stats
            before = (stats.bytes_read, stats.requests)
            template = _state(rank, world, args.params, False)
            dist.barrier()
            t0 = time.perf_counter()
            load_sharded(engine, template, path, ex)
            seconds = time.perf_counter() - t0
            rows.append((ex is not None, seconds, stats.bytes_read - before[0], stats.requests - before[1]))
    checkpoint = engine.checkpoint(path)
    unique = sum(it.nbytes for r in range(checkpoint.world_size) for it in checkpoint.items(r).values()
                 if it.write and it.id != fmt.SKELETON_ID)
    gathered = [None] * world
    dist.all_gather_object(gathered, rows)
    if rank == 0:
        out.put((world, unique, gathered))
    engine.close()
    dist.destroy_process_group()


def _world(world: int, args) -> list[str]:
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    procs = [ctx.Process(target=_rank, args=(r, world, store.port, args, out)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    if any(p.exitcode for p in procs):
        raise SystemExit(f"a rank of the {world}-rank world failed")
    _, unique, gathered = out.get()
    lines = []
    for exchanged in (False, True) if world > 1 else (False,):
        runs = [[row for row in rows if row[0] == exchanged] for rows in gathered]
        slowest = [max(rank_rows[i][1] for rank_rows in runs) for i in range(len(runs[0]))]
        nbytes = sum(rank_rows[0][2] for rank_rows in runs)
        requests = sum(rank_rows[0][3] for rank_rows in runs)
        lines.append(f"| {world} | {'on' if exchanged else 'off'} | {statistics.median(slowest):.3f} | "
                     f"{nbytes / 1e6:.1f} | {requests} | {nbytes / unique:.3f} |")
    return lines


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--params", type=float, default=16e6)
    p.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", default=None)
    p.add_argument("--quick", action="store_true", help="seconds: 64k parameters, a world of 2, 1 repeat")
    args = p.parse_args(argv)
    if args.quick:
        args.params, args.worlds, args.repeats = 65536, [2], 1
    args.params = int(args.params)
    own = args.dir is None
    args.dir = args.dir or tempfile.mkdtemp(prefix="read_once_")
    try:
        print(f"{args.params / 1e6:.0f}M parameters, 14 B each (bf16 weights on every rank, fp32 param and Adam "
              f"moments sharded); median of {args.repeats}")
        print("| ranks | exchange | restore s (slowest rank) | MB read from storage (all ranks) | requests | "
              "x unique bytes |")
        print("|---|---|---|---|---|---|")
        for world in args.worlds:
            for line in _world(world, args):
                print(line, flush=True)
    finally:
        if own:
            shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
