"""The snapshot protocol (issue a copy, record its completion, wait on it before reading the slot) and what
happens when a stage thread dies. A backend that completes copies late and out of order stands in for a GPU's
side stream: if the writer read a slot early, or the fence opened early, the bytes on disk would show it."""
import json
import mmap
import os
import subprocess
import sys
import threading

import pytest
import torch

from datastates import CheckpointEngine, PosixOptions, CheckpointError
from datastates.copies import HostCopyBackend, default_copy_threads
from datastates.priority import BACKGROUND_NICE
from datastates.slots import StagingPool
from late_copies import LateCopyBackend, copy_thread_held


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    big = torch.randn(300_000, generator=g)  # larger than a slot: chunked across slots
    return {"big": big, "w": torch.randn(64, 48, generator=g),
            "cols": torch.randn(48, 64, generator=g).t(),  # non-contiguous: copied view by view
            "half": torch.randn(1000, generator=g).to(torch.bfloat16),
            "many": [torch.randn(17 + i, generator=g) for i in range(40)], "step": seed}


def _mutate(state: dict) -> None:
    """What optimizer.step() does to the saved tensors, in place."""
    for t in (state["big"], state["w"], state["cols"], state["half"], *state["many"]):
        t.add_(1000)


def _expected(state: dict) -> dict:
    return {k: (v.clone() if isinstance(v, torch.Tensor) else [t.clone() for t in v] if isinstance(v, list) else v)
            for k, v in state.items()}


def _assert_equal(got: dict, want: dict) -> None:
    for k, v in want.items():
        if isinstance(v, list):
            assert all(torch.equal(a, b) for a, b in zip(got[k], v)), k
        elif isinstance(v, torch.Tensor):
            assert torch.equal(got[k], v), k
        else:
            assert got[k] == v, k


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_late_out_of_order_copies_never_read_early(tmp_path, seed):
    """Every save: fence, then mutate in place at once. Disk must hold the state at save(), never the poison
    of an unlanded copy, never the mutated values. A small budget makes slots cycle while copies are late."""
    backend = LateCopyBackend(seed)
    state = _state(seed)
    wanted = []
    with CheckpointEngine(host_buffer_bytes=512 << 10, storage=PosixOptions(writer_threads=2),
                          copy_backend=backend) as eng:
        for it in range(1, 5):
            wanted.append(_expected(state))
            eng.save(state, str(tmp_path / f"iter_{it:07d}"))
            eng.wait_for_snapshot()
            assert not backend.pending, "the fence opened before every copy landed"
            _mutate(state)
        eng.wait()
        for it, want in enumerate(wanted, 1):
            _assert_equal(eng.load(str(tmp_path / f"iter_{it:07d}")), want)
    assert backend.landed > 4 * 40


def test_native_host_copies_hold_the_state_at_save(tmp_path):
    """The default CPU backend (native copy threads, no GIL) under the same fence-then-mutate discipline."""
    state = _state(7)
    wanted = []
    with CheckpointEngine(host_buffer_bytes=512 << 10, storage=PosixOptions(writer_threads=2), copy_threads=2) as eng:
        assert isinstance(eng.backend, HostCopyBackend)
        for it in range(1, 4):
            wanted.append(_expected(state))
            eng.save(state, str(tmp_path / f"iter_{it:07d}"))
            eng.wait_for_snapshot()
            _mutate(state)
        stats = eng.wait()[-1]
        for it, want in enumerate(wanted, 1):
            _assert_equal(eng.load(str(tmp_path / f"iter_{it:07d}")), want)
    assert 0 < stats.peak_staging_bytes <= stats.staging_allocated_bytes <= 512 << 10
    assert stats.staging_pinned_bytes == 0  # no CUDA here: nothing page-locked


def test_fence_caller_takes_the_snapshot_its_copy_thread_cannot(tmp_path):
    """The engine's one copy thread held: save() plus the fence still takes the snapshot, the blocked caller
    running the copies itself; the state mutated right after the fence, the checkpoint holds it as at save()."""
    state = _state(5)
    with CheckpointEngine(host_buffer_bytes=16 << 20, storage=PosixOptions(writer_threads=2), copy_threads=1) as eng:
        want = _expected(state)
        with copy_thread_held(eng.backend.pool) as holding:
            eng.save(state, str(tmp_path / "iter_0000001"))
            eng.wait_for_snapshot()
            assert holding()  # the snapshot taken while the copy thread was held: by the fence's caller
            _mutate(state)
        eng.wait()
        _assert_equal(eng.load(str(tmp_path / "iter_0000001")), want)


def test_staging_costs_exactly_its_slots():
    """Slots are page-aligned mappings of exactly slot_bytes: the pool holds what it says, within budget."""
    pool = StagingPool(10 << 20, writer_threads=2)
    slots = [pool.acquire() for _ in range(pool.max_slots)]
    assert all(s.buffer.data_ptr() % mmap.PAGESIZE == 0 and s.buffer.numel() == pool.slot_bytes for s in slots)
    assert pool.allocated_bytes == len(slots) * pool.slot_bytes <= pool.budget_bytes
    assert pool.pinned_bytes == 0
    for s in slots:
        pool.release(s)
    pool.close()


class _CopyError(HostCopyBackend):
    """A copy backend that fails the way a CUDA error does: on every call, also inside the error handling."""

    def finish(self):
        super().finish()
        raise RuntimeError("CUDA error: an illegal memory access was encountered")


class _LosingIO:
    """Delegates to the real writer pool but forgets tickets, as a bug in the completer's bookkeeping would."""

    def __init__(self, io):
        self.io = io

    def __getattr__(self, name):
        return getattr(self.io, name)

    def wait(self, ticket):
        self.io.wait(ticket)
        raise ValueError(f"unknown ticket {ticket} (never submitted, or already waited)")


def _dies_cleanly(eng, tmp_path, thread_name, first_error):
    state = {"w": torch.randn(10_000)}
    handle = eng.save(state, str(tmp_path / "iter_0000001"))
    fence = threading.Thread(target=eng.wait_for_snapshot)
    fence.start()
    fence.join(30)
    assert not fence.is_alive(), "the fence hangs after a stage thread died"
    assert handle.join(30), "the save never finished after a stage thread died"
    with pytest.raises(CheckpointError, match=first_error):
        handle.wait()
    with pytest.raises(CheckpointError, match=f"iter_0000002.*{thread_name} thread died"):
        eng.save(state, str(tmp_path / "iter_0000002"))  # fails fast instead of queueing forever
    raised = []

    def close():
        try:
            eng.close()
        except CheckpointError as e:
            raised.append(e)
    closer = threading.Thread(target=close)
    closer.start()
    closer.join(30)
    assert not closer.is_alive(), "close() hangs after a stage thread died"
    assert not raised, "close() repeated the error handle.wait() already raised"  # each failure is raised once
    assert not (tmp_path / "iter_0000001").exists()


def test_copier_death_fails_pending_saves(tmp_path):
    _dies_cleanly(CheckpointEngine(host_buffer_bytes=1 << 20, storage=PosixOptions(writer_threads=1),
                                   copy_backend=_CopyError(1)),
                  tmp_path, "copy", "CUDA error")


def test_completer_death_fails_pending_saves(tmp_path):
    eng = CheckpointEngine(host_buffer_bytes=1 << 20, storage=PosixOptions(writer_threads=1))
    eng.storage._pools["write"] = _LosingIO(eng.storage._pool("write"))
    _dies_cleanly(eng, tmp_path, "complete", "complete thread died.*unknown ticket")


def test_dead_rank_stage_fails_the_other_rank_at_once(tmp_path):
    """Rank 1's completer dies: rank 0 hears it through the store at once, not at its publish timeout."""
    store = torch.distributed.HashStore()
    engines = [CheckpointEngine(host_buffer_bytes=1 << 20, storage=PosixOptions(writer_threads=1), rank=r,
                                world_size=2, store=store,
                                publish_timeout_s=300) for r in range(2)]
    engines[1].storage._pools["write"] = _LosingIO(engines[1].storage._pool("write"))
    path = str(tmp_path / "iter_0000001")
    handles = [eng.save({"w": torch.full((1000,), float(r))}, path) for r, eng in enumerate(engines)]
    assert handles[0].join(30), "rank 0 waited for the dead rank's timeout"
    with pytest.raises(CheckpointError, match="rank 1.*complete thread died"):
        handles[0].wait()
    engines[0].close()  # its failure was raised by handles[0].wait(): not again
    with pytest.raises(CheckpointError, match="complete thread died"):
        engines[1].close()  # nobody waited for rank 1's handle: close() raises its failure
    assert not (tmp_path / "iter_0000001").exists() and not (tmp_path / "iter_0000001.partial").exists()


def test_tensor_the_backend_cannot_copy_is_refused_at_save(tmp_path):
    with CheckpointEngine(host_buffer_bytes=1 << 20, storage=PosixOptions(writer_threads=1)) as eng:
        with pytest.raises(CheckpointError, match=r"iter_0000001.*'w'.*meta"):
            eng.save({"w": torch.empty(4, device="meta")}, str(tmp_path / "iter_0000001"))
    assert not (tmp_path / "iter_0000001").exists()


def _shmem_rss() -> int:
    """This process's resident shared memory (where the anonymous shared slot mappings are counted), in bytes."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("RssShmem:"))


def test_staging_made_ahead_is_the_whole_budget_resident_and_saves_add_none(tmp_path):
    """stage_ahead: the whole budget is mapped and faulted in before any save; saves larger than it (back-
    pressure) and later saves take only those slots, and what they wrote loads back."""
    budget = 8 << 20
    before = _shmem_rss()
    with CheckpointEngine(host_buffer_bytes=budget, storage=PosixOptions(writer_threads=2), stage_ahead=True) as eng:
        assert eng.staging_ready(timeout=60)
        made = eng.pool.allocated_bytes
        assert made == eng.pool.max_slots * eng.pool.slot_bytes > budget - eng.pool.slot_bytes
        assert _shmem_rss() - before >= made, "the slots were mapped but not faulted in"
        state = _state(11)
        state["large"] = torch.randn(3 * budget // 4, generator=torch.Generator().manual_seed(3))  # 3x the budget
        for it in (1, 2):
            eng.save(state, str(tmp_path / f"iter_{it:07d}"))
            stats = eng.wait()[0]
            assert stats.staging_allocated_bytes == eng.pool.allocated_bytes == made
            assert stats.peak_staging_bytes <= made
        _assert_equal(eng.load(str(tmp_path / "iter_0000002")), _expected(state))


def test_staging_is_made_as_saves_take_it_without_stage_ahead():
    """Without stage_ahead (the default without CUDA) a pool makes a slot only when a save first takes it."""
    with CheckpointEngine(host_buffer_bytes=8 << 20, storage=PosixOptions(writer_threads=2)) as eng:
        assert eng.staging_ready(timeout=0) and eng.pool.allocated_bytes == 0


def views_of_one_buffer(flat: torch.Tensor, sizes: list[int]) -> dict:
    """Views of `flat` back to back, of these sizes (4 KiB multiples keep the slot offsets going, odd ones leave
    padding), and after the second one a view of its end: a slot offset that continues the run, a source that
    does not."""
    views, pos = {}, 0
    for i, n in enumerate(sizes):
        views[f"v{i}"] = flat[pos:pos + n]
        pos += n
        if i == 1:
            views["jump"] = flat[-1024:]
    return views


def test_views_of_one_buffer_load_as_saved_whether_their_copies_join_or_not(tmp_path):
    """Tensors laid out back to back in one buffer (megatron-core's parameter and gradient buffers) are copied as
    one run where their slot offsets continue too (sizes a multiple of 4 KiB), one by one where they do not (odd
    sizes leave padding in the slot), and across slot boundaries; every byte lands where the plan put it."""
    flat = torch.randn(600_000, generator=torch.Generator().manual_seed(5))
    views = views_of_one_buffer(flat, [1024, 2048, 1024 * 70, 1000, 3, 1024 * 100, 77_777, 1024])
    pos = sum(v.numel() for k, v in views.items() if k != "jump")
    views["rest"] = flat[pos:pos + 7 * 40_000].view(-1, 7)[:, 2]  # strided: copied apart, between runs
    with CheckpointEngine(host_buffer_bytes=1 << 20, storage=PosixOptions(writer_threads=2), copy_threads=2) as eng:
        want = {k: v.clone() for k, v in views.items()}
        eng.save(views, str(tmp_path / "iter_0000001"))
        eng.wait_for_snapshot()
        flat.add_(1)  # the optimizer step: after the fence, not seen by the save
        eng.wait()
        _assert_equal(eng.load(str(tmp_path / "iter_0000001")), want)


@pytest.mark.parametrize("where", ["staging", "pages"])
def test_checksummed_ranges_of_several_copy_pieces_save_and_load(tmp_path, where):
    """The copy threads checksum a range in 4 MiB pieces and combine their crc32c: a save whose checksummed ranges
    (a staging slot's 16 MiB chunks; the memory tier's whole items) span several pieces, uneven ends included,
    loads back verified and equal."""
    from datastates.storage.shared_memory import SharedMemoryStorage
    g = torch.Generator().manual_seed(3)
    state = {"big": torch.randn(9_437_189, generator=g), "odd": torch.randn(1_048_583, generator=g).double()}
    storage = (PosixOptions(writer_threads=1) if where == "staging" else
               SharedMemoryStorage(pinned=False, writer_threads=1))
    with CheckpointEngine(host_buffer_bytes=256 << 20, storage=storage, copy_threads=2) as eng:
        eng.save(state, str(tmp_path / "iter_0000001")).wait()
        _assert_equal(eng.load(str(tmp_path / "iter_0000001")), state)


_NICE_OF_EVERY_THREAD = """
import json, os, sys, threading, torch
from datastates import CheckpointEngine, PosixOptions
root = sys.argv[1]
with CheckpointEngine(host_buffer_bytes=1 << 20, storage=PosixOptions(writer_threads=2), keep_last=1,
                      compress="zstd", encode_threads=2) as eng:
    for it in (1, 2):  # the second save retires the first: the deleter thread runs
        eng.save({"w": torch.arange(300_000.0) + it}, f"{root}/iter_{it:07d}").wait()
    threads, named = {}, {t.native_id: t.name for t in threading.enumerate()}  # Python's; the native: comm
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/comm") as f:
            name = named.get(int(tid), f.read().strip())
        threads.setdefault(name.split("_")[0], set()).add(os.getpriority(os.PRIO_PROCESS, int(tid)))
print(json.dumps({"training": os.getpriority(os.PRIO_PROCESS, 0), **{k: sorted(v) for k, v in threads.items()}}))
"""


@pytest.mark.parametrize("caller_nice", [0, 7])
def test_only_the_snapshot_runs_at_the_callers_priority(tmp_path, caller_nice):
    """Under the caller's nice (a job started with `nice -n 7`), the stages after the snapshot (flush: the memory
    tier's checksums; complete; publish; retention's deleter), the encoder threads and the native writers run
    BACKGROUND_NICE below the caller, never at a fixed value above it; the copier and the native copy pool, which
    the fence waits for, keep the caller's priority."""
    out = subprocess.run(["nice", "-n", str(caller_nice), sys.executable, "-c", _NICE_OF_EVERY_THREAD,
                          str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    nice = json.loads(out.stdout)
    training = nice.pop("training")
    assert training == caller_nice, nice
    for name in ("ds-copy", "ds-copy-pool"):
        assert nice[name] == [training], (name, nice)
    for name in ("ds-flush", "ds-complete", "ds-publish", "ds-delete", "ds-encode", "ds-encode-write", "ds-io"):
        assert nice[name] == [training + BACKGROUND_NICE], (name, nice)


def test_host_copies_leave_training_a_core_and_a_load_takes_them_all():
    """`default_copy_threads` sized by the cores this thread may run on (sched_setaffinity is per thread)."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("needs two cores")
    got = {}

    def on(allowed):
        os.sched_setaffinity(0, allowed)
        got[len(allowed)] = (default_copy_threads(), default_copy_threads(beside_training=False))

    for allowed in (cores[:1], cores[:2]):
        t = threading.Thread(target=on, args=(allowed,))
        t.start()
        t.join()
    assert got == {1: (1, 1), 2: (1, 2)}
