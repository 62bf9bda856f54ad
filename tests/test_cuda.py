"""The CUDA path: pinned staging, a side stream ordered after the compute stream, events. Needs a GPU."""
import pytest
import torch

from datastates import CheckpointEngine

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_device_state_snapshot_is_lazy_pinned_and_fenced(tmp_path):
    torch.manual_seed(0)
    state = {f"p{i}": torch.randn(1024, 1024, device="cuda") for i in range(32)}
    state["step"] = torch.tensor(3, device="cuda")
    with CheckpointEngine(host_buffer_bytes=16 << 20, writer_threads=2) as eng:
        assert eng.pool.pinned
        for t in state.values():  # queued on the compute stream right before save(): the copy must see it
            t.mul_(2)
        expected = {k: v.cpu() for k, v in state.items()}
        eng.save(state, str(tmp_path / "iter_0000001"))
        eng.wait_for_snapshot()
        for t in state.values():  # the optimizer step after the fence
            t.add_(1)
        stats = eng.wait()[0]
        assert stats.peak_staging_bytes <= 16 << 20
        template = {k: torch.zeros_like(v) for k, v in state.items()}
        out = eng.load(str(tmp_path), template=template)
    for k, v in expected.items():
        assert out[k] is template[k] and out[k].is_cuda
        assert torch.equal(out[k].cpu(), v), k


def test_pinned_staging_is_exactly_the_budget_and_copies_overlap(tmp_path):
    """Slots are pinned in place (cudaHostRegister), not through the power-of-two caching host allocator, and
    save() returns while the side-stream copies are still running."""
    state = {f"p{i}": torch.randn(16 << 20, device="cuda") for i in range(8)}  # 512 MiB on the device
    budget = 96 << 20
    with CheckpointEngine(host_buffer_bytes=budget, writer_threads=2) as eng:
        handle = eng.save(state, str(tmp_path / "iter_0000001"))
        assert not handle.snapshot_done, "save() waited for the device->host copies"
        eng.wait_for_snapshot()
        assert handle.snapshot_done
        eng.wait()
        slots = eng.pool._slots
        assert slots and all(s.buffer.is_pinned() for s in slots)
        assert eng.pool.pinned_bytes == eng.pool.allocated_bytes == len(slots) * eng.pool.slot_bytes <= budget
        assert torch.cuda.host_memory_stats().get("allocated_bytes.all.current", 0) == 0


def test_tensor_on_another_device_is_refused(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    from datastates import CheckpointError
    with CheckpointEngine(host_buffer_bytes=16 << 20, writer_threads=1) as eng:
        with pytest.raises(CheckpointError, match=r"'w'.*cuda:1.*one engine per device"):
            eng.save({"w": torch.ones(4, device="cuda:1")}, str(tmp_path / "iter_0000001"))
