"""Lossless codecs on real trainer state: ratio per kind of state, compress and decompress GB/s on one core.

Reads every tensor of a datastates checkpoint (the trainer's own, e.g. a bf16 run with the distributed
optimizer), sorts it into a kind (bf16 weights, fp32 main params, Adam first and second moments, other), cuts
each kind into chunks of --chunk-mb (as the engine does) and runs every candidate on the same chunks, one thread
each (blosc2 with nthreads=1). Ratios are properties of the data; the GB/s are of a shared 2-core VM and noisy.

    python benchmarks/compression.py CHECKPOINT_DIR [--chunk-mb 16] [--repeat 3] [--json out.json]
    python benchmarks/compression.py CHECKPOINT_DIR --quick [--engine] [--json out.json]   # seconds: 1 MB chunks,
        one pass; with --engine the tensors once, 2 iterations of a 0.05 s step

With --engine, the engine itself instead: the checkpoint's tensors (tiled --tile times) saved and restored with
compression off and on, to a local directory (fsync on), to the memory tier's storage (a /dev/shm directory,
as `LocalTier` keeps a part) and to a local SeaweedFS (tests/s3_store.py): bytes stored (held, in the tier), time
to durable of a fresh engine's first save and of its next one (staging already faulted in, threads and
connections up: every save of a run but its first), restore time and the every-iteration loop ratio, best of
--repeat, settings interleaved.
--link-mbps N adds the same SeaweedFS behind a link of N MB/s (tests/s3_faults.py's proxy paces every body both
ways): an object store whose network, not its servers, sets the pace, as a node's link to S3 does. --storages
SeaweedFS,link runs only those rows.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from datastates import CheckpointEngine, CheckpointReader, storage_for
from datastates.paths import checkpoint_dir, data_file, join as join_path
from datastates.codecs import CODECS, group_bytes, ungroup_bytes  # the internal measured: the codecs themselves
from datastates.storage import SharedMemoryStorage  # the memory tier's storage, as LocalTier makes it

GB = 1e9


def kind_of(name: str, dtype: torch.dtype) -> str:
    if "exp_avg_sq" in name:
        return "Adam exp_avg_sq (fp32)"
    if "exp_avg" in name:
        return "Adam exp_avg (fp32)"
    if dtype == torch.bfloat16:
        return "bf16 weights"
    if "fp32_param" in name or "param" in name and dtype == torch.float32:
        return "fp32 main params"
    return f"other ({str(dtype).replace('torch.', '')})"


def load_kinds(path: str, chunk_bytes: int) -> dict[str, list[tuple[bytes, int]]]:
    """kind -> chunks of (raw bytes, element size), every tensor of the checkpoint."""
    reader = CheckpointReader.open(path)
    kinds: dict[str, list] = collections.defaultdict(list)
    for name, (_, dtype) in sorted(reader.tensors().items()):
        t = reader.tensor(name).contiguous()
        raw = t.view(-1).view(torch.uint8).numpy().tobytes()
        for s in range(0, len(raw), chunk_bytes):
            kinds[kind_of(name, dtype)].append((raw[s:s + chunk_bytes], t.element_size()))
    return kinds


def _ungrouped(grouped: bytes, itemsize: int) -> np.ndarray:
    out = np.empty(len(grouped), np.uint8)
    ungroup_bytes(np.frombuffer(grouped, np.uint8), itemsize, out)
    return out


def candidates() -> dict[str, tuple]:
    """name -> (compress(raw, itemsize) -> stored, decompress(stored, raw_nbytes, itemsize) -> raw)."""
    out = {}
    for name, c in CODECS.items():
        def enc(raw, isz, c=c):
            return c.encode(memoryview(raw), isz)

        def dec(stored, n, isz, c=c):
            buf = np.empty(n, np.uint8)
            c.decode(memoryview(stored), buf, isz)
            return buf
        out[f"{name} (engine)"] = (enc, dec)
    import zstandard
    for level in (3,):
        zc, zd = zstandard.ZstdCompressor(level=level), zstandard.ZstdDecompressor()
        out[f"zstd-{level}"] = (lambda raw, isz, zc=zc: zc.compress(raw), lambda s, n, isz, zd=zd: zd.decompress(s))
        out[f"bytegroup-zstd-{level}"] = (lambda raw, isz, zc=zc: zc.compress(group_bytes(memoryview(raw), isz)),
                                          lambda s, n, isz, zd=zd: _ungrouped(zd.decompress(s), isz))
    try:  # lz4 and blosc2 are peers only, in no extra: measured where installed
        import lz4.frame
        out["lz4"] = (lambda raw, isz: lz4.frame.compress(raw), lambda s, n, isz: lz4.frame.decompress(s))
        out["bytegroup-lz4"] = (lambda raw, isz: lz4.frame.compress(group_bytes(memoryview(raw), isz)),
                                lambda s, n, isz: _ungrouped(lz4.frame.decompress(s), isz))
    except ImportError as e:
        print(f"lz4 not measured: {e}")
    try:
        import blosc2
    except ImportError as e:
        print(f"blosc2 not measured: {e}")
        blosc2 = None
    for label, codec, filters in (("blosc2 zstd1+shuffle", blosc2.Codec.ZSTD, [blosc2.Filter.SHUFFLE]),
                                  ("blosc2 zstd1+bytedelta", blosc2.Codec.ZSTD,
                                   [blosc2.Filter.SHUFFLE, blosc2.Filter.BYTEDELTA]),
                                  ("blosc2 lz4+shuffle", blosc2.Codec.LZ4, [blosc2.Filter.SHUFFLE])) if blosc2 else ():
        def enc(raw, isz, codec=codec, filters=filters):
            return blosc2.compress2(raw, typesize=isz, clevel=1 if codec == blosc2.Codec.ZSTD else 5, codec=codec,
                                    filters=filters, filters_meta=[0] * len(filters), nthreads=1)
        out[label] = (enc, lambda s, n, isz: blosc2.decompress2(s, nthreads=1))
    try:  # zipnn 0.5.4's input_format="byte" does not round-trip here: it is given tensors
        from zipnn import ZipNN
        zn = ZipNN(input_format="torch", threads=1)
        dtypes = {2: torch.bfloat16, 4: torch.float32, 8: torch.int64}
        out["zipnn"] = (lambda raw, isz: zn.compress(torch.frombuffer(bytearray(raw), dtype=dtypes[isz])),
                        lambda s, n, isz: zn.decompress(s).view(torch.uint8).numpy())
    except ImportError as e:
        print(f"zipnn not measured: {e}")
    return out


def measure(chunks, enc, dec, repeat: int) -> tuple[float, float, float]:
    """(ratio, compress GB/s, decompress GB/s): best of `repeat` passes over every chunk; round trip checked."""
    raw_bytes = sum(len(c) for c, _ in chunks)
    best_c = best_d = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        stored = [enc(c, isz) for c, isz in chunks]
        t1 = time.perf_counter()
        back = [dec(s, len(c), isz) for s, (c, isz) in zip(stored, chunks)]
        t2 = time.perf_counter()
        best_c, best_d = min(best_c, t1 - t0), min(best_d, t2 - t1)
    for b, (c, _) in zip(back, chunks):
        assert bytes(b) == c, "round trip is not bit-exact"
    stored_bytes = sum(min(len(s), len(c)) for s, (c, _) in zip(stored, chunks))  # the engine stores raw if larger
    return raw_bytes / stored_bytes, raw_bytes / best_c / GB, raw_bytes / best_d / GB


def loop_ratio(eng: CheckpointEngine, root: str, state: dict, first: int, iters: int, step_s: float) -> float:
    """`iters` iterations, each a 1-step "training" (a sleep: an accelerator's step leaves the host's cores to the
    checkpoint) after the fence and a lazy save, until the last save is durable, over the same loop without
    saves (benchmarks/RESULTS.md, "Object store", the same loop)."""
    t0 = time.perf_counter()
    for i in range(iters):
        eng.wait_for_snapshot()
        time.sleep(step_s)
        eng.save(state, checkpoint_dir(root, first + i))
    eng.wait()
    return (time.perf_counter() - t0) / (iters * step_s)


def engine_rows(path: str, tile: int, repeat: int, budget: int, iters: int = 4, step_s: float = 1.0,
                link_mbps: float | None = None, storages: str | None = None) -> None:
    """Bytes, durable and restore seconds and the loop ratio with compression off and on, on a file system and
    in the memory tier's storage and on SeaweedFS (and behind a `link_mbps` link)."""
    tests = Path(__file__).resolve().parents[1] / "tests"
    sys.path.insert(0, str(tests))
    from s3_store import S3Store
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from common import evict_tree
    reader = CheckpointReader.open(path)
    state = {f"{name}#{k}": reader.tensor(name) for name in reader.tensors() for k in range(tile)}
    raw = sum(t.numel() * t.element_size() for t in state.values())
    store, local = S3Store(), tempfile.mkdtemp(prefix="compression-", dir=os.environ.get("BENCH_DIR", "/tmp"))
    memory = tempfile.mkdtemp(prefix="compression-", dir="/dev/shm")
    proxy = None
    try:
        store.start()
        os.environ.update(store.env())
        endpoints = {"SeaweedFS": store.endpoint}
        roots = {"file system": local, "memory tier": memory, "SeaweedFS": f"s3://{store.create_bucket()}/run"}
        if link_mbps:  # the proxy in a process of its own: a link is not paced by this process's interpreter
            link = f"link of {link_mbps:g} MB/s to SeaweedFS"
            proxy = subprocess.Popen([sys.executable, str(tests / "s3_faults.py"), store.endpoint, str(link_mbps)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            endpoints[link] = proxy.stdout.readline().strip()
            roots[link] = f"s3://{store.create_bucket()}/run"
        roots = {k: v for k, v in roots.items() if not storages or any(k.startswith(s) for s in storages.split(","))}
        print(f"| storage | compress | stored MB (raw {raw / 1e6:.1f}) | ratio | durable s (first save) | "
              f"durable s (next save) | restore s | loop ratio ({iters} x {step_s:g} s) |")
        print("|---|---|---|---|---|---|---|---|")
        rows = collections.defaultdict(lambda: [float("inf"), float("inf"), 0, float("inf"), float("inf")])
        for rep in range(repeat):
            for where, root in roots.items():
                for compress in ("off", "bytegroup-zstd"):
                    os.environ["AWS_ENDPOINT_URL"] = endpoints.get(where, store.endpoint)
                    storage = SharedMemoryStorage() if root == memory else storage_for(root)
                    with CheckpointEngine(host_buffer_bytes=budget, storage=storage, compress=compress,
                                          keep_last=2) as eng:
                        ckpt = checkpoint_dir(root, 1 + rep)
                        t0 = time.perf_counter()
                        eng.save(state, ckpt).wait()
                        durable = time.perf_counter() - t0
                        stored = storage.size(join_path(ckpt, data_file(0)))
                        if where == "file system":
                            evict_tree(ckpt)
                        t0 = time.perf_counter()
                        eng.load(ckpt)
                        restore = time.perf_counter() - t0
                        t0 = time.perf_counter()  # as every save after a run's first: staging faulted in, threads up
                        eng.save(state, checkpoint_dir(root, 50 + rep)).wait()
                        warm = time.perf_counter() - t0
                        loop = loop_ratio(eng, root, state, 100 * (1 + rep), iters, step_s)
                    row = rows[(where, compress)]
                    row[:] = min(row[0], durable), min(row[1], restore), stored, min(row[3], loop), min(row[4], warm)
        for (where, compress), (durable, restore, stored, loop, warm) in rows.items():
            print(f"| {where} | {compress} | {stored / 1e6:.1f} | {raw / stored:.3f} | {durable:.3f} | {warm:.3f} "
                  f"| {restore:.3f} | {loop:.2f} |")
    finally:
        if proxy is not None:
            proxy.kill()
            proxy.wait()
        store.close()
        shutil.rmtree(local, ignore_errors=True)
        shutil.rmtree(memory, ignore_errors=True)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint")
    p.add_argument("--chunk-mb", type=int, default=16)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--json")
    p.add_argument("--only", help="measure only the candidates whose name contains this")
    p.add_argument("--engine", action="store_true", help="the engine's save and restore, off and on (see above)")
    p.add_argument("--tile", type=int, default=5)
    p.add_argument("--budget-mb", type=int, default=1024)
    p.add_argument("--link-mbps", type=float, help="with --engine: also SeaweedFS behind a link of this bandwidth")
    p.add_argument("--storages", help="with --engine: the rows whose storage begins with one of these, "
                   "comma-separated (\"file system\", \"memory tier\", \"SeaweedFS\", \"link\")")
    p.add_argument("--quick", action="store_true", help="seconds: 1 MB chunks, one pass; with --engine the tensors "
                   "once, a 64 MB budget, 2 iterations of a 0.05 s step")
    a = p.parse_args(argv)
    loop = {}
    if a.quick:
        a.chunk_mb, a.repeat, a.tile, a.budget_mb, loop = 1, 1, 1, 64, {"iters": 2, "step_s": 0.05}
    if a.engine:
        return engine_rows(a.checkpoint, a.tile, a.repeat, a.budget_mb << 20, link_mbps=a.link_mbps,
                           storages=a.storages, **loop)
    torch.set_num_threads(1)
    kinds = load_kinds(a.checkpoint, a.chunk_mb << 20)
    kinds["all"] = [c for k in list(kinds) for c in kinds[k]]
    rows = []
    print("| codec | " + " | ".join(f"{k} ({sum(len(c) for c, _ in v) / 1e6:.1f} MB)" for k, v in kinds.items())
          + " | compress GB/s | decompress GB/s |")
    print("|---" * (len(kinds) + 3) + "|")
    for name, (enc, dec) in candidates().items():
        if a.only and a.only not in name:
            continue
        cells, speed = [], None
        for kind, chunks in kinds.items():
            ratio, cg, dg = measure(chunks, enc, dec, a.repeat if kind == "all" else 1)
            cells.append(f"{ratio:.3f}")
            rows.append({"codec": name, "kind": kind, "ratio": ratio, "compress_gbps": cg, "decompress_gbps": dg})
            speed = (cg, dg)
        print(f"| {name} | " + " | ".join(cells) + f" | {speed[0]:.2f} | {speed[1]:.2f} |", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
