"""The device side of the policy hand-off (issue 68; `benchmarks/rl_weights.py` runs it on a CUDA machine, a part
of scripts/gpu_check.sh): for the tensors of one published version, on the first CUDA device, the median time of

  plain pinned copy   the tensors on the device copied into pinned host memory: what every hand-off starts with
                      (the engine's lazy snapshot is this copy, taken behind the next forward/backward)
  reader to device    the version read from its files (`datastates.weights`' reading: safetensors in shared memory)
                      and copied onto the device, as a rollout engine on this node loads it
  NCCL broadcast      the same tensors broadcast from one device to another (the transport NeMo-RL and OpenRLHF
                      use); only with two devices or more (NCCL takes one rank per device)

    python benchmarks/rl_device.py VERSION_DIR [--reps 5]
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import time

import torch
from safetensors import safe_open


def tensors_of(version_dir: str):
    """(name, tensor) of every safetensors file of the version at `version_dir`, as a reader reads them."""
    for file in sorted(f for f in os.listdir(version_dir) if f.endswith(".safetensors")):
        with safe_open(os.path.join(version_dir, file), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def _median_ms(run, reps: int, device: str = "cuda") -> float:
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    times = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        run()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _broadcast_rank(rank: int, port: int, shapes: dict, reps: int, out) -> None:
    import torch.distributed as dist
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    bufs = [torch.ones(s, dtype=d, device="cuda") for s, d in shapes.values()]

    def once():
        for b in bufs:
            dist.broadcast(b, src=0)
    once()  # NCCL's set-up
    ms = _median_ms(lambda: (once(), dist.barrier()), reps)
    if rank == 0:
        out["nccl_broadcast_ms"] = ms
    dist.destroy_process_group()


def measure(version_dir: str, reps: int = 5, device: str = "cuda") -> dict:
    """The figures above for the version at `version_dir` (nccl_broadcast_ms None with one device; `device` "cpu":
    the same steps between host buffers, unpinned, to check them where no card is)."""
    host = dict(tensors_of(version_dir))
    nbytes = sum(t.numel() * t.element_size() for t in host.values())
    on_device = {n: t.to(device, copy=True) for n, t in host.items()}
    pinned = {n: torch.empty_like(t, device="cpu") for n, t in host.items()}
    if device == "cuda":
        pinned = {n: t.pin_memory() for n, t in pinned.items()}

    def plain():
        for n, t in on_device.items():
            pinned[n].copy_(t, non_blocking=True)

    def reader():
        for n, t in tensors_of(version_dir):
            on_device[n].copy_(t, non_blocking=False)
    plain()
    out = {"bytes": nbytes, "plain_pinned_copy_ms": _median_ms(plain, reps, device),
           "reader_to_device_ms": _median_ms(reader, reps, device), "nccl_broadcast_ms": None}
    if device == "cuda" and torch.cuda.device_count() >= 2:
        import torch.multiprocessing as mp
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        shared = mp.Manager().dict()
        mp.spawn(_broadcast_rank, args=(port, {n: (tuple(t.shape), t.dtype) for n, t in host.items()}, reps,
                                        shared), nprocs=2)
        out["nccl_broadcast_ms"] = shared["nccl_broadcast_ms"]
    return out


def describe(r: dict) -> str:
    """`measure`'s figures, one line."""
    nccl = "not measured (one device)" if r["nccl_broadcast_ms"] is None else f"{r['nccl_broadcast_ms']:.2f} ms"
    return (f"{torch.cuda.get_device_name(0)}, {r['bytes']} bytes | plain pinned copy {r['plain_pinned_copy_ms']:.2f} "
            f"ms | reader to device {r['reader_to_device_ms']:.2f} ms | NCCL broadcast {nccl}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("version_dir")
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("rl_device.py measures a CUDA device: torch sees none")
    print(f"rl_device: {describe(measure(a.version_dir, a.reps))}")


if __name__ == "__main__":
    main()
