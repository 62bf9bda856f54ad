"""megatron/training/cpu_shim.py: the sites it adapts are checked against the installed megatron-core, a moved
site fails naming it, its adaptations hold only inside `cuda_free()` on the calling thread, and with CUDA present
it does nothing at all."""
from __future__ import annotations

import sys
import threading

import pytest
import torch

from megatron.training import cpu_shim


@pytest.fixture
def shim():
    was = cpu_shim.installed()
    assert cpu_shim.install() is True  # this machine has no CUDA
    yield cpu_shim
    if not was:
        cpu_shim.uninstall()


def test_every_site_is_where_the_shim_expects_it():
    cpu_shim.check_sites()
    names = {s.name for s in cpu_shim.SITES}
    assert "megatron.core.optimizer.distrib_optimizer.DistributedOptimizer._build_model_and_main_param_groups" in names
    assert "megatron.core.models.common.language_module.language_module.LanguageModule." \
           "setup_embeddings_and_output_layer" in names


def test_a_moved_site_fails_loudly_naming_it():
    rewritten = cpu_shim.Site("optimizer.clip_grads", "get_grad_norm_fp32", "device='npu'", "test")
    with pytest.raises(cpu_shim.ShimError, match=r"megatron\.core\.optimizer\.clip_grads\.get_grad_norm_fp32 no "
                                                 r"longer contains \"device='npu'\""):
        cpu_shim.check_sites([rewritten])
    gone = cpu_shim.Site("optimizer.clip_grads", "renamed_in_a_later_version", "x", "test")
    with pytest.raises(cpu_shim.ShimError, match="renamed_in_a_later_version is gone"):
        cpu_shim.check_sites([gone])


def test_adaptations_hold_inside_cuda_free_on_this_thread_only(shim):
    assert torch.cuda.current_device() == "cpu"
    x = torch.ones(3, dtype=torch.bfloat16)
    seen = {}

    def other_thread():
        seen["type"] = x.type()

    with shim.cuda_free():
        t = torch.zeros(2, dtype=torch.int, device="cuda")
        assert t.device.type == "cpu"
        assert torch.tensor([1.0], device="cuda").device.type == "cpu"
        assert x.type() == "torch.cuda.BFloat16Tensor" and x.float().type() == "torch.cuda.FloatTensor"
        assert x.cuda() is x
        assert x.type(torch.float32).dtype == torch.float32  # type(dtype) is a conversion: untouched
        th = threading.Thread(target=other_thread)
        th.start()
        th.join()
    assert seen["type"] == "torch.BFloat16Tensor"  # the engine's threads never see the mode
    assert x.type() == "torch.BFloat16Tensor"
    with pytest.raises((RuntimeError, AssertionError), match="CUDA|NVIDIA"):  # torch's own: no CUDA, or no driver
        torch.zeros(1, device="cuda")


def test_nothing_changes_when_cuda_is_present(monkeypatch):
    was = cpu_shim.installed()
    if was:
        cpu_shim.uninstall()
    originals = {n: getattr(torch.cuda, n) for n in ("current_device", "synchronize", "set_device", "device_count")}
    try:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(cpu_shim, "check_sites", lambda *a: pytest.fail("sites checked with CUDA present"))
        assert cpu_shim.install() is False
        assert not cpu_shim.installed()
        assert {n: getattr(torch.cuda, n) for n in originals} == originals
        from megatron.core.transformer.moe import moe_utils, token_dispatcher
        assert token_dispatcher.maybe_move_tensor_to_cpu is moe_utils.maybe_move_tensor_to_cpu
        assert token_dispatcher.MoEAlltoAllTokenDispatcher.cuda_dtoh_stream is None
        ctx = cpu_shim.cuda_free()
        assert not isinstance(ctx, torch.overrides.TorchFunctionMode)
        with ctx:
            assert torch.ones(1, dtype=torch.bfloat16).type() == "torch.BFloat16Tensor"
    finally:
        monkeypatch.undo()
        if was:
            cpu_shim.install()


def test_the_alltoall_dispatchers_side_stream_and_host_copies_on_cpu(shim):
    """Its side stream is a CPU stream whose recorded events are done; its split sizes come back as numpy arrays,
    as from a CUDA device (what all_to_all_single takes); other tensors pass as they are."""
    from megatron.core.transformer.moe import token_dispatcher
    stream = token_dispatcher.MoEAlltoAllTokenDispatcher.cuda_dtoh_stream
    with torch.cuda.stream(stream):
        assert torch.cuda.current_stream() is stream
    stream.record_event().synchronize()
    splits = token_dispatcher.maybe_move_tensor_to_cpu(torch.tensor([3, 5]), as_numpy=True)
    assert type(splits).__module__ == "numpy" and splits.tolist() == [3, 5]
    counts = torch.tensor([3, 5])
    assert token_dispatcher.maybe_move_tensor_to_cpu(counts) is counts


def test_an_unadapted_torch_cuda_call_on_the_training_thread_names_its_caller(shim):
    """A megatron-core release that adds a CUDA call fails at that call, naming the file and line, on the thread
    that installed the shim; the adapter's answers and device-free queries keep working."""
    assert torch.cuda.device_count() == 0 and torch.cuda.is_available() is False
    torch.cuda.current_stream().wait_stream(torch.cuda.current_stream())  # answered: the CPU stream
    assert torch.cuda.is_current_stream_capturing() is False
    torch.cuda.manual_seed_all(1)  # queued by torch until CUDA starts: harmless
    line = sys._getframe().f_lineno + 2
    with pytest.raises(cpu_shim.ShimError) as e:
        torch.cuda.memory_allocated()
    assert f"torch.cuda.memory_allocated called at {__file__}:{line}" in str(e.value)
    assert "megatron/training/cpu_shim.py does not adapt it" in str(e.value)
    with pytest.raises(cpu_shim.ShimError, match=r"torch\.cuda\.Event called at .*test_cpu_shim\.py"):
        torch.cuda.Event()

    seen = {}

    def engine_thread():  # torch's own behaviour off the training thread (here: no driver)
        try:
            torch.cuda.memory_allocated()
        except Exception as exc:
            seen["error"] = exc
    th = threading.Thread(target=engine_thread)
    th.start()
    th.join()
    assert not isinstance(seen.get("error"), cpu_shim.ShimError)


def test_each_megatron_core_version_has_its_own_sites():
    assert len(cpu_shim.sites_of("0.19.2")) == len(cpu_shim.sites_of("0.16.1")) + 1
    assert any("start_grad_sync" in s.qualname for s in cpu_shim.sites_of("0.19.2"))
