"""nvCOMP's GPU codecs on real trainer state: would compressing on the device, before the snapshot's copy, pay?

The same kinds of state as benchmarks/compression.py (bf16 weights, fp32 main params, Adam moments, from a
checkpoint the trainer wrote), each moved to the GPU and tiled to --tile-mb for the speeds, then every nvCOMP
algorithm on it raw and byte-grouped (byte k of every element together, done on the device), round trip checked
on the device. Per kind and codec: the ratio (on the untiled bytes), compress and decompress GB/s of raw bytes,
and what a compressing snapshot would cost per raw GB against the plain device-to-host copy:
`1/compress + 1/(ratio * d2h)` seconds, beside `1/d2h`.

    python benchmarks/gpu_codecs.py CHECKPOINT_DIR [--tile-mb 256] [--repeat 3] [--json out.json]

Needs a CUDA device and PyPI `nvidia-nvcomp-cu13` (with `nvidia-libnvcomp-cu13`); an algorithm this nvCOMP lacks
is reported and skipped. Nothing here asserts on time.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compression import load_kinds  # noqa: E402  the CPU table's own reading of the state

ALGORITHMS = ("LZ4", "Snappy", "Zstd", "Deflate", "GDeflate", "Cascaded", "Bitcomp", "ANS")
GB = 1e9


def grouped(t: torch.Tensor, itemsize: int) -> torch.Tensor:
    return t if itemsize == 1 else t.view(-1, itemsize).t().contiguous().view(-1)


def ungrouped(t: torch.Tensor, itemsize: int) -> torch.Tensor:
    return t if itemsize == 1 else t.view(itemsize, -1).t().contiguous().view(-1)


def device_kinds(path: str) -> dict[str, tuple[torch.Tensor, int]]:
    """kind -> (its bytes concatenated on the device, element size)."""
    out = {}
    for kind, chunks in load_kinds(path, 1 << 30).items():
        raw = b"".join(c for c, _ in chunks)
        if len(raw) >= 1 << 20:
            out[kind] = (torch.frombuffer(bytearray(raw), dtype=torch.uint8).cuda(), chunks[0][1])
    return out


def d2h_gbps(nbytes: int = 1 << 30) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").fill_(3)
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    best = float("inf")
    for _ in range(3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / GB


def measure(nvcomp, algorithm: str, data: torch.Tensor, tiled: torch.Tensor, itemsize: int, group: bool,
            repeat: int) -> dict:
    codec = nvcomp.Codec(algorithm=algorithm)

    def encode(t):  # nvCOMP runs on a stream of its own: each hand-over between it and torch synchronizes
        src = grouped(t, itemsize) if group else t
        torch.cuda.synchronize()
        return codec.encode(nvcomp.as_array(src))

    def decode(enc, n):
        out = codec.decode(enc)
        torch.cuda.synchronize()
        back = torch.as_tensor(out, device="cuda").view(torch.uint8).view(-1)[:n]
        return ungrouped(back, itemsize) if group else back

    stored = encode(data)
    torch.cuda.synchronize()
    if not torch.equal(decode(stored, data.numel()), data):
        return {"error": "round trip is not bit-exact"}
    ratio = data.numel() / min(stored.buffer_size, data.numel())
    best_c = best_d = float("inf")
    for _ in range(repeat):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        enc = encode(tiled)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        decode(enc, tiled.numel())
        torch.cuda.synchronize()
        best_c, best_d = min(best_c, t1 - t0), min(best_d, time.perf_counter() - t1)
        del enc
    return {"ratio": ratio, "compress_gbps": tiled.numel() / best_c / GB, "decompress_gbps": tiled.numel() / best_d / GB}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("checkpoint", help="an iteration directory of a datastates checkpoint the trainer wrote")
    ap.add_argument("--tile-mb", type=int, default=256, help="each kind repeated to this size for the speeds")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    from nvidia import nvcomp
    d2h = d2h_gbps()
    fig = {"card": torch.cuda.get_device_name(0), "nvcomp": getattr(nvcomp, "__version__", "?"), "d2h_gbps": d2h,
           "plain_s_per_gb": 1 / d2h, "kinds": collections.defaultdict(dict), "errors": {}}
    print(f"gpu_codecs: nvCOMP {fig['nvcomp']} on {fig['card']}; device->pinned {d2h:.1f} GB/s "
          f"({1000 / d2h:.1f} ms per raw GB)", flush=True)
    for kind, (data, itemsize) in device_kinds(args.checkpoint).items():
        tiled = data.repeat(max(1, (args.tile_mb << 20) // data.numel()))
        for algorithm in ALGORITHMS:
            for group in (False, True):
                name = f"{'bytegroup-' if group else ''}{algorithm}"
                try:
                    r = measure(nvcomp, algorithm, data, tiled, itemsize, group, args.repeat)
                except Exception as e:  # noqa: BLE001 - an algorithm this build lacks is a finding, not a failure
                    fig["errors"][f"{kind} {name}"] = f"{type(e).__name__}: {e}"
                    continue
                if "ratio" in r:
                    r["snapshot_s_per_gb"] = 1 / r["compress_gbps"] + 1 / (r["ratio"] * d2h)
                    print(f"gpu_codecs: {kind:24s} {name:20s} ratio {r['ratio']:.3f}  compress "
                          f"{r['compress_gbps']:7.1f} GB/s  decompress {r['decompress_gbps']:7.1f} GB/s  snapshot "
                          f"{1000 * r['snapshot_s_per_gb']:.1f} ms/GB", flush=True)
                else:
                    print(f"gpu_codecs: {kind:24s} {name:20s} {r['error']}", flush=True)
                fig["kinds"][kind][name] = {**r, "bytes": data.numel()}
        del tiled
        torch.cuda.empty_cache()
    for k, e in fig["errors"].items():
        print(f"gpu_codecs: not measured: {k}: {e}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(fig, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
