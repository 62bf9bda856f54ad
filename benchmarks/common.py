"""Shared helpers for the side-by-side checkpoint benchmarks.

Nothing here measures anything by itself: the synthetic training state, the durability sweep (fsync every
file and directory of a checkpoint), page-cache eviction before restores, and a sampler of the process
tree's memory.
"""
from __future__ import annotations

import math
import os
import threading
import time

import torch

from datastates import fsync_dir

GB = 1e9  # sizes and bandwidths in the tables are decimal GB and GB/s


# ----------------------------------------------------------------------------------------------------------
# CPU guard for megatron-core
# ----------------------------------------------------------------------------------------------------------
def install_cpu_guard() -> str:
    """Make megatron-core's dist_checkpointing usable on a CPU-only torch.

    megatron-core calls torch.cuda.synchronize/current_device/set_device on its save/finalize paths even for
    CPU tensors. The trainer's shim (megatron/training/cpu_shim.py) is used when it exists; otherwise a
    minimal local guard is installed (TEMPORARY fallback, only for trees without the shared shim).
    """
    if torch.cuda.is_available():
        return "cuda"
    try:
        from megatron.training import cpu_shim  # type: ignore

        cpu_shim.install()
        return "megatron.training.cpu_shim"
    except ImportError:
        torch.cuda.synchronize = lambda *a, **k: None
        torch.cuda.current_device = lambda: "cpu"
        torch.cuda.set_device = lambda *a, **k: None
        torch.cuda.device_count = lambda: 0
        return "benchmarks.common local guard (temporary)"


# ----------------------------------------------------------------------------------------------------------
# Synthetic, Megatron-shaped training state
# ----------------------------------------------------------------------------------------------------------
def state_shapes(per_rank: float) -> tuple[dict, int, int]:
    """(tensor name -> shape, hidden size, layers) of one rank's model: L transformer layers (qkv, proj, fc1,
    fc2, two layer norms with biases) plus an embedding that takes the remainder of `per_rank` bytes, counting
    Adam's two moments beside each parameter (fp32)."""
    layers = 4 if per_rank < 0.5 * GB else 8
    # 3 copies (param, exp_avg, exp_avg_sq) * 4 bytes * ~12 h^2 per layer; the embedding gets >= 1/4.
    h = int(math.sqrt(0.75 * per_rank / (layers * 12 * 12)))
    h = max(64, h // 64 * 64)
    shapes: dict[str, tuple[int, int] | tuple[int]] = {}
    for i in range(layers):
        p = f"decoder.layers.{i}."
        shapes[p + "self_attention.linear_qkv.weight"] = (3 * h, h)
        shapes[p + "self_attention.linear_proj.weight"] = (h, h)
        shapes[p + "mlp.linear_fc1.weight"] = (4 * h, h)
        shapes[p + "mlp.linear_fc2.weight"] = (4 * h, h)  # stored transposed so dim 0 shards evenly
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "input_layernorm.bias"] = (h,)
        shapes[p + "pre_mlp_layernorm.weight"] = (h,)
        shapes[p + "pre_mlp_layernorm.bias"] = (h,)
    used = sum(math.prod(s) for s in shapes.values()) * 4 * 3
    vocab_rows = max(1, int((per_rank - used) / (3 * 4 * h)))
    shapes["embedding.word_embeddings.weight"] = (vocab_rows, h)
    return shapes, h, layers


def make_state(total_bytes: float, rank: int, world: int, seed: int = 1234, device: str = "cpu") -> dict:
    """One rank's share (total_bytes / world) of a GPT-like training state in fp32 (`state_shapes`).

    Model parameters and Adam's exp_avg / exp_avg_sq for each (so 3 tensors of every shape), plus the small
    Python objects a Megatron checkpoint carries (iteration, args, RNG state).
    Every rank's tensors are rows [rank*r, (rank+1)*r) of logical tensors sharded along dim 0. With a `device`
    ("cuda"), the model and its moments live there (generated on the host, so the values do not depend on it).
    """
    shapes, h, layers = state_shapes(total_bytes / world)
    g = torch.Generator().manual_seed(seed + rank)
    model, exp_avg, exp_avg_sq = {}, {}, {}
    for k, s in shapes.items():
        model[k] = torch.randn(s, generator=g).to(device)
        exp_avg[k] = (torch.randn(s, generator=g) * 1e-3).to(device)
        exp_avg_sq[k] = (torch.rand(s, generator=g) * 1e-6).to(device)
    return {
        "model": model,
        "optimizer": {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq, "step": 1},
        "iteration": 1,
        "args": {"hidden_size": h, "num_layers": layers, "world_size": world, "rank": rank},
        "rng_state": torch.get_rng_state(),
    }


def iter_tensors(state, prefix=""):
    """(dotted key, tensor) for every tensor in a nested dict/list state, in a deterministic order."""
    if isinstance(state, torch.Tensor):
        yield prefix, state
    elif isinstance(state, dict):
        for k in sorted(state, key=str):
            yield from iter_tensors(state[k], f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(state, (list, tuple)):
        for i, v in enumerate(state):
            yield from iter_tensors(v, f"{prefix}.{i}" if prefix else str(i))


def state_bytes(state) -> int:
    return sum(t.numel() * t.element_size() for _, t in iter_tensors(state))


def big_tensors(state):
    """The tensors an optimizer step mutates (model and optimizer moments), not the RNG state."""
    return [t for k, t in iter_tensors(state) if not k.startswith("rng_state")]


def checksums(state) -> dict[str, float]:
    return {k: float(t.sum(dtype=torch.float64)) for k, t in iter_tensors(state) if t.is_floating_point()}


# ----------------------------------------------------------------------------------------------------------
# Durability and page cache
# ----------------------------------------------------------------------------------------------------------
def fsync_tree(path: str) -> int:
    """fsync every regular file and directory under path (and path's parent). Cheap when already clean.

    Applied to every system after it reports completion so that "durable" means the same for all of them.
    Returns the number of files synced.
    """
    n = 0
    if os.path.isfile(path):
        _fsync_file(path)
        fsync_dir(os.path.dirname(path) or ".")
        return 1
    for root, dirs, files in os.walk(path):
        for f in files:
            _fsync_file(os.path.join(root, f))
            n += 1
        fsync_dir(root)
    fsync_dir(os.path.dirname(os.path.abspath(path)))
    return n


def _fsync_file(p: str) -> None:
    try:
        fd = os.open(p, os.O_RDONLY)
    except FileNotFoundError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def evict_tree(path: str) -> None:
    """Drop the (clean, fsynced) pages of every file under path from the page cache.

    /proc/sys/vm/drop_caches is not writable in this container; POSIX_FADV_DONTNEED per file works for clean
    pages, so restores read from the disk rather than from memory.
    """
    files = [path] if os.path.isfile(path) else [os.path.join(r, f) for r, _, fs in os.walk(path) for f in fs]
    for p in files:
        try:
            fd = os.open(p, os.O_RDONLY)
        except FileNotFoundError:
            continue
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def warm_free_memory(nbytes: int) -> None:
    """Touch nbytes of fresh memory and free it again, so the next allocations find warm free pages.

    In a VM whose host reclaims the guest's free pages (this project's test machines), the first touch of a
    page the guest freed a while ago costs a fault on the host: a load that fills new page cache or new tensors
    would then pay for whatever the step before it left behind, not for its own work. Warming the same amount
    before every load makes that equal for every system (as on bare metal, where fresh pages are cheap)."""
    t = torch.empty(int(nbytes), dtype=torch.uint8)
    t.fill_(0)
    del t


def tree_bytes(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)


# ----------------------------------------------------------------------------------------------------------
# Memory of the process tree
# ----------------------------------------------------------------------------------------------------------
def tree_memory_bytes(proc=None) -> int:
    """PSS of this process and all its descendants (forked savers included; shared pages counted once).

    Falls back to RSS where PSS cannot be read.
    """
    import psutil

    proc = proc or psutil.Process()
    total = 0
    for p in [proc] + proc.children(recursive=True):
        try:
            mi = p.memory_full_info()
            total += getattr(mi, "pss", mi.rss)
        except Exception:
            try:
                total += p.memory_info().rss
            except Exception:
                pass
    return total


class MemorySampler:
    """Samples tree_memory_bytes() in a thread; peak_above_baseline() after stop().

    `max_share`: the most of a core the sampling may take. Reading the PSS of a process walks its page tables
    (75-90 ms for 8 GiB), so at a fixed 20 ms it would hold a core for itself beside what is measured; with a
    share, the wait after each sample grows with the time the sample took."""

    def __init__(self, interval_s: float = 0.02, max_share: float = 1.0):
        self.interval_s, self.max_share = interval_s, max_share
        self.baseline = 0
        self.peak = 0
        self._stop = threading.Event()
        self._thread = None

    def start(self):
        self.baseline = tree_memory_bytes()
        self.peak = self.baseline
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self):
        wait = self.interval_s
        while not self._stop.wait(wait):
            t0 = time.perf_counter()
            self.peak = max(self.peak, tree_memory_bytes())
            wait = max(self.interval_s, (time.perf_counter() - t0) * (1 / self.max_share - 1))

    def stop(self) -> int:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.peak = max(self.peak, tree_memory_bytes())
        return self.peak - self.baseline


class Timer:
    def __init__(self):
        self.t0 = time.perf_counter()

    def __call__(self) -> float:
        return time.perf_counter() - self.t0
