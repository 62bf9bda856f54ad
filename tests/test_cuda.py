"""The CUDA path: pinned staging, a side stream ordered after the compute stream, events. Needs a GPU.

Each test queues work on the compute stream that the checkpoint must see (a long `torch.cuda._sleep`, then an in-place
update), computes what it expects on the host from values it made there, and never synchronises before save(): a
copy that is not ordered after the queued work, a save() that waits for it, or a fence that opens before the copy
ends, each fails a test.
"""
import subprocess
import sys

import pytest
import torch

from datastates import CheckpointEngine, PosixOptions
from test_snapshot import views_of_one_buffer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _sleep_cycles(seconds: float) -> int:
    """Clock cycles that `torch.cuda._sleep` spins for about `seconds` on this device."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles = 10_000_000
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return int(cycles * seconds * 1000 / max(start.elapsed_time(end), 1e-3))


def _host_and_device(n: int, numel: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    host = {f"p{i}": torch.randn(numel, generator=g) for i in range(n)}
    device = {k: v.cuda() for k, v in host.items()}
    torch.cuda.synchronize()  # set-up only: from here on nothing synchronises before save()
    return host, device


def test_copy_is_ordered_after_work_queued_before_save(tmp_path):
    host, state = _host_and_device(8, 1 << 20)
    cycles = _sleep_cycles(0.5)
    with CheckpointEngine(host_buffer_bytes=16 << 20, storage=PosixOptions(writer_threads=2)) as eng:
        torch.cuda._sleep(cycles)  # the step that produced the state is still running at save()
        for t in state.values():
            t.mul_(2)
        expected = {k: v * 2 for k, v in host.items()}
        eng.save(state, str(tmp_path / "iter_0000001"))
        eng.wait_for_snapshot()
        for t in state.values():  # the optimizer step, after the fence: not in the checkpoint
            t.add_(1)
        eng.wait()
        template = {k: torch.zeros_like(v) for k, v in state.items()}
        out = eng.load(str(tmp_path), template=template)
    for k, v in expected.items():
        assert torch.equal(out[k].cpu(), v), f"{k}: the checkpoint is not the state the queued work produced"


def test_save_returns_before_the_copy_and_the_fence_waits_for_it(tmp_path):
    _, state = _host_and_device(4, 16 << 20)  # 256 MiB
    cycles = _sleep_cycles(1.0)  # far longer than save() takes to return
    with CheckpointEngine(host_buffer_bytes=1 << 30, storage=PosixOptions(writer_threads=2)) as eng:
        torch.cuda._sleep(cycles)
        for t in state.values():
            t.add_(1)
        produced = torch.cuda.Event()
        produced.record()
        handle = eng.save(state, str(tmp_path / "iter_0000001"))
        assert not produced.query(), "save() waited for the compute stream"
        assert not handle.snapshot_done, "save() returned with the snapshot already taken"
        eng.wait_for_snapshot()
        assert produced.query(), "the fence opened before the work the copy is ordered after had run"
        assert handle.snapshot_done
        eng.wait()


def test_pinned_staging_is_exactly_the_budget_pinned_at_start_and_copies_overlap(tmp_path):
    """The whole budget is pinned in place (cudaHostRegister, not the power-of-two caching host allocator) when the
    engine starts, by default with CUDA; saves pin nothing more, and save() returns while the side-stream copies
    are still running."""
    host, state = _host_and_device(8, 16 << 20)  # 512 MiB on the device
    budget = 96 << 20
    with CheckpointEngine(host_buffer_bytes=budget, storage=PosixOptions(writer_threads=2)) as eng:
        assert eng.pool.pinned and eng.staging_ready(timeout=60)
        pinned = eng.pool.pinned_bytes
        assert pinned == eng.pool.allocated_bytes == eng.pool.max_slots * eng.pool.slot_bytes
        assert budget - eng.pool.slot_bytes < pinned <= budget
        for it in (1, 2):
            handle = eng.save(state, str(tmp_path / f"iter_{it:07d}"))
            assert not handle.snapshot_done, "save() waited for the device->host copies"
            eng.wait_for_snapshot()
            stats = eng.wait()[0]
            assert stats.peak_staging_bytes <= budget
            assert stats.staging_pinned_bytes == stats.staging_allocated_bytes == pinned, "a save pinned more"
        assert eng.pool.pinned_bytes == pinned
        assert torch.cuda.host_memory_stats().get("allocated_bytes.all.current", 0) == 0
        out = eng.load(str(tmp_path / "iter_0000002"))
    for k, v in host.items():
        assert torch.equal(out[k].cpu(), v), k


def test_load_lands_in_the_device_tensors_given(tmp_path):
    host, state = _host_and_device(6, 3 << 20)
    with CheckpointEngine(host_buffer_bytes=16 << 20, storage=PosixOptions(writer_threads=2)) as eng:
        eng.save(state, str(tmp_path / "iter_0000001"))
        eng.wait()
        template = {k: torch.full_like(v, float("nan")) for k, v in state.items()}
        out = eng.load(str(tmp_path), template=template)
    for k, v in host.items():
        assert out[k] is template[k] and out[k].is_cuda, f"{k} was not loaded in place on the device"
        assert torch.equal(out[k].cpu(), v), k


def test_dtypes_views_and_tensors_larger_than_the_budget(tmp_path):
    g = torch.Generator().manual_seed(1)
    host = {"bf16": torch.randn(3000, 1024, generator=g).to(torch.bfloat16),
            "big": torch.randn(12 << 20, generator=g),  # 48 MiB through a 16 MiB budget: chunked
            "wide": torch.randn(512, 768, generator=g),
            "step": torch.tensor(7, dtype=torch.int64)}
    state = {k: v.cuda() for k, v in host.items()}
    state["wide_t"] = state["wide"].t()  # a non-contiguous view of a device tensor
    torch.cuda.synchronize()
    with CheckpointEngine(host_buffer_bytes=16 << 20, storage=PosixOptions(writer_threads=2)) as eng:
        eng.save(state, str(tmp_path / "iter_0000001"))
        eng.wait()
        template = {k: torch.zeros_like(v) for k, v in state.items() if k != "wide_t"}
        template["wide_t"] = torch.zeros(768, 512, device="cuda")
        out = eng.load(str(tmp_path), template=template)
    for k, v in {**host, "wide_t": host["wide"].t()}.items():
        assert out[k].dtype == v.dtype and torch.equal(out[k].cpu(), v), k


def test_tensor_on_another_device_is_refused(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    from datastates import CheckpointError
    with CheckpointEngine(host_buffer_bytes=16 << 20, storage=PosixOptions(writer_threads=1)) as eng:
        with pytest.raises(CheckpointError, match=r"'w'.*cuda:1.*one engine per device"):
            eng.save({"w": torch.ones(4, device="cuda:1")}, str(tmp_path / "iter_0000001"))


def test_views_of_one_device_buffer_land_exactly_whether_their_copies_join_or_not(tmp_path):
    """Device tensors back to back in one buffer (megatron-core's parameter buffers) go as one side-stream copy
    where their slot offsets continue too, one by one where they do not; every byte lands where it belongs, in
    both directions."""
    flat = torch.randn(3_000_000, generator=torch.Generator().manual_seed(5))
    host = views_of_one_buffer(flat, [1024, 2048, 1024 * 700, 1000, 3, 1024 * 1000, 77_777, 1024])
    device_flat = flat.cuda()
    state = {k: device_flat[v.storage_offset():v.storage_offset() + v.numel()] for k, v in host.items()}
    torch.cuda.synchronize()
    with CheckpointEngine(host_buffer_bytes=8 << 20, storage=PosixOptions(writer_threads=2)) as eng:
        eng.save(state, str(tmp_path / "iter_0000001"))
        eng.wait_for_snapshot()
        device_flat.add_(1)  # after the fence: not seen by the save
        eng.wait()
        device_flat.zero_()
        eng.load(str(tmp_path), template=state)
    for k, v in host.items():
        assert torch.equal(state[k].cpu(), v), k


_ON_THE_LAST_DEVICE = """
import os, sys, torch, pynvml
from datastates import CheckpointEngine, PosixOptions
last = torch.cuda.device_count() - 1
torch.cuda.set_device(last)
state = {f"p{i}": torch.randn(1 << 20, device=last) for i in range(4)}
with CheckpointEngine(host_buffer_bytes=32 << 20, storage=PosixOptions(writer_threads=2), keep_last=1) as eng:
    assert eng.staging_ready(timeout=60)
    for it in (1, 2):
        eng.save(state, os.path.join(sys.argv[1], f"iter_{it:07d}"))
        eng.wait()
    eng.load(sys.argv[1], template=state)
pynvml.nvmlInit()
uuid = torch.cuda.get_device_properties(0).uuid  # torch's device 0, whatever CUDA_VISIBLE_DEVICES maps it to
first = next(h for h in map(pynvml.nvmlDeviceGetHandleByIndex, range(pynvml.nvmlDeviceGetCount()))
             if str(uuid) in str(pynvml.nvmlDeviceGetUUID(h)))
print("PIDS ON DEVICE 0", [p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(first)], "SELF", os.getpid())
assert os.getpid() not in [p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(first)]
"""


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="a stray context shows on another device than the engine's")
def test_no_thread_of_the_engine_makes_a_context_on_another_device(tmp_path):
    """An engine on the last device, in a process of its own: its staging thread, stage threads and deleter bind
    that device, so the process holds no context (no memory) on device 0. (A thread that touches CUDA bound to no
    device makes one there, about 0.5 GiB a rank.)"""
    pytest.importorskip("pynvml", reason="the contexts per device are read through NVML")
    done = subprocess.run([sys.executable, "-c", _ON_THE_LAST_DEVICE, str(tmp_path)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
