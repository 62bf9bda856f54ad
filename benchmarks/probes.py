"""Raw limits of this machine, measured in the same run and the same directory as the checkpoints.

- O_DIRECT sequential write: page-aligned buffers (anonymous mmap), pwrite at aligned offsets from 1 and
  from 4 threads (the better one is the disk's limit), then fsync; "durable" includes the fsync.
- buffered write + fsync: the same bytes through the page cache, timed until fsync returns.
- O_DIRECT sequential read: a file of the same size, page cache evicted, read back in 8 MiB blocks from 1 and
  from 4 threads (the better one is the disk's read limit, the yardstick of restores).
- memcpy: torch copy_ between two host tensors (what a staging copy costs at best).
"""
from __future__ import annotations

import mmap
import os
import statistics
import threading
import time

import torch

from common import GB

BLOCK = 8 << 20  # 8 MiB per write call


def _aligned_buffer(nbytes: int) -> mmap.mmap:
    buf = mmap.mmap(-1, nbytes)  # page aligned, which satisfies O_DIRECT's 512/4096-byte alignment
    buf.write(os.urandom(1 << 20) * (nbytes >> 20))
    return buf


def _run_threads(work, threads: int) -> None:
    """work(0) .. work(threads - 1), each on a thread of its own; returns when all are done."""
    ts = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()


def write_odirect(path: str, nbytes: int, threads: int = 1) -> float:
    """Seconds to write nbytes with O_DIRECT (plus fsync). Raises OSError if the FS refuses O_DIRECT."""
    nblocks = max(1, nbytes // BLOCK)
    bufs = [_aligned_buffer(BLOCK) for _ in range(threads)]
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_DIRECT", 0), 0o644)
    try:
        t0 = time.perf_counter()
        # reserve the extent first (timed), as a checkpoint writer does: O_DIRECT into holes is slower on ext4
        os.posix_fallocate(fd, 0, nblocks * BLOCK)

        def work(tid: int):
            mv = memoryview(bufs[tid])
            for b in range(tid, nblocks, threads):
                os.pwrite(fd, mv, b * BLOCK)
            mv.release()

        _run_threads(work, threads)
        os.fsync(fd)
        return time.perf_counter() - t0
    finally:
        os.close(fd)
        for b in bufs:
            b.close()
        os.unlink(path)


def write_buffered_fsync(path: str, nbytes: int) -> float:
    nblocks = max(1, nbytes // BLOCK)
    buf = _aligned_buffer(BLOCK)
    mv = memoryview(buf)
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for _ in range(nblocks):
            os.write(fd, mv)
        os.fsync(fd)
        dt = time.perf_counter() - t0
    finally:
        os.close(fd)
        mv.release()
        buf.close()
        os.unlink(path)
    return dt


def write_files_fsync(directory: str, sizes: list[int], writers: int = 1) -> float:
    """Seconds for `writers` threads to write files of these sizes (file k by writer k mod writers), each
    fsynced before the next: the storage's floor for a set of files, such as a Hugging Face model's shards."""
    buf = _aligned_buffer(max(sizes) // BLOCK * BLOCK + BLOCK)
    mv = memoryview(buf)
    os.makedirs(directory, exist_ok=True)
    paths = [os.path.join(directory, f"probe_file_{k}.bin") for k in range(len(sizes))]

    def work(w: int):
        for k in range(w, len(sizes), writers):
            with open(paths[k], "wb") as f:
                f.write(mv[: sizes[k]])
                f.flush()
                os.fsync(f.fileno())

    try:
        t0 = time.perf_counter()
        _run_threads(work, writers)
        return time.perf_counter() - t0
    finally:
        mv.release()
        buf.close()
        for path in paths:
            if os.path.exists(path):
                os.unlink(path)


def read_odirect(path: str, nbytes: int, threads: int = 1) -> float:
    """Seconds to read the first nbytes of `path` (whole blocks, the last one short at the end of the file)
    with O_DIRECT, its page cache evicted first."""
    nblocks = max(1, -(-nbytes // BLOCK))
    bufs = [mmap.mmap(-1, BLOCK) for _ in range(threads)]
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)

        def work(tid: int):
            for b in range(tid, nblocks, threads):
                os.preadv(fd, [bufs[tid]], b * BLOCK)

        t0 = time.perf_counter()
        _run_threads(work, threads)
        return time.perf_counter() - t0
    finally:
        os.close(fd)
        for b in bufs:
            b.close()


def read_stream(path: str) -> float:
    """Seconds to read `path` as one sequential buffered stream (8 MiB reads, kernel readahead), its page cache
    evicted first and each block dropped from it once read."""
    buf = mmap.mmap(-1, BLOCK)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        t0, pos = time.perf_counter(), 0
        while n := os.preadv(fd, [buf], pos):
            os.posix_fadvise(fd, pos, n, os.POSIX_FADV_DONTNEED)
            pos += n
        return time.perf_counter() - t0
    finally:
        os.close(fd)
        buf.close()


def _written_file(path: str, nbytes: int) -> None:
    buf = _aligned_buffer(BLOCK)
    with open(path, "wb") as f:
        for _ in range(max(1, nbytes // BLOCK)):
            f.write(buf)
        f.flush()
        os.fsync(f.fileno())
    buf.close()


def memcpy_seconds(nbytes: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8)
    src.fill_(7)
    dst = torch.empty_like(src)
    dst.fill_(0)  # fault the pages in first: a staging pool is allocated once, then reused
    t0 = time.perf_counter()
    dst.copy_(src)
    return time.perf_counter() - t0


def device_to_host_gbps(nbytes: int = 1 << 30, reps: int = 3) -> float:
    """The device's copy into pinned host memory, best of reps in GB/s: the ceiling of a snapshot's copy (PCIe
    Gen5 x16 reaches about 52 GB/s pinned on H100/H200). Runs in the process that holds the device state."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").fill_(7)
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    best = float("inf")
    for _ in range(1 + reps):  # the first one warms the copy engine up
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def run_probes(directory: str, nbytes: int, reps: int = 3, log=print) -> dict:
    """Median (and min/max) of each probe over reps, interleaved. Bandwidths in GB/s."""
    os.makedirs(directory, exist_ok=True)
    p = os.path.join(directory, "probe.bin")
    nbytes = int(max(nbytes, 256 << 20)) // BLOCK * BLOCK
    res: dict[str, list[float]] = {"odirect_1t": [], "odirect_4t": [], "buffered_fsync": [],
                                   "read_odirect_1t": [], "read_odirect_4t": [], "memcpy": []}
    direct_ok = True
    mc_bytes = int(min(nbytes, 1 << 30))
    readable = os.path.join(directory, "probe_read.bin")
    _written_file(readable, nbytes)
    for _ in range(reps):
        if direct_ok:
            try:
                res["odirect_1t"].append(write_odirect(p, nbytes, 1))
                res["odirect_4t"].append(write_odirect(p, nbytes, 4))
                res["read_odirect_1t"].append(read_odirect(readable, nbytes, 1))
                res["read_odirect_4t"].append(read_odirect(readable, nbytes, 4))
            except OSError as e:  # tmpfs and some overlay setups refuse O_DIRECT
                log(f"O_DIRECT unavailable in {directory}: {e}")
                direct_ok = False
        res["buffered_fsync"].append(write_buffered_fsync(p, nbytes))
        res["memcpy"].append(memcpy_seconds(mc_bytes))
    os.unlink(readable)
    out = {"bytes": nbytes, "memcpy_bytes": mc_bytes}
    for k, v in res.items():
        if not v:
            continue
        b = mc_bytes if k == "memcpy" else nbytes
        out[k] = {
            "median_s": statistics.median(v),
            "gbps": b / statistics.median(v) / GB,
            "gbps_min": b / max(v) / GB,
            "gbps_max": b / min(v) / GB,
            "samples_s": v,
        }
    ods = [out[k]["gbps"] for k in ("odirect_1t", "odirect_4t") if k in out]
    out["raw_odirect_gbps"] = max(ods) if ods else None
    reads = [out[k]["gbps"] for k in ("read_odirect_1t", "read_odirect_4t") if k in out]
    out["raw_read_gbps"] = max(reads) if reads else None
    return out
