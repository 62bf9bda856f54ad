"""The one place where megatron-core's hard-coded CUDA assumptions are adapted to CPU ranks (gloo).

megatron-core (0.16.1, 0.19.2) is device-agnostic except at the sites listed in `SITES`: scratch buffers placed
on `torch.cuda.current_device()`, small tensors created with ``device='cuda'``, parameter types compared with
``'torch.cuda.BFloat16Tensor'``/``'torch.cuda.FloatTensor'`` strings, ``.cuda()`` on the shared embedding, and
(0.19) the current stream that gradient reduction waits on. On a machine without CUDA every one of them raises
or refuses the parameter.

Two adaptations, both inactive when `torch.cuda.is_available()` is True (then `install()` returns False and
`cuda_free()` is a null context):

- `install()` answers `torch.cuda`'s device functions on CPU: `current_device()` returns ``"cpu"`` (so
  ``device=torch.cuda.current_device()`` allocates on the CPU), `synchronize()` and `set_device()` do nothing,
  `device_count()` returns 0, `current_stream()` is the CPU stream (its waits do nothing), `stream(s)` selects a
  CPU stream, and `is_current_stream_capturing()` is False. The all-to-all token dispatcher's device-to-host
  side stream, which megatron-core creates once per process, is given a CPU stream instead: CPU work is
  synchronous, so its waits do nothing and its events are done when recorded; and its device-to-host copy of
  the split sizes, which only converts CUDA tensors, turns CPU tensors into the same numpy arrays (what
  `all_to_all_single` takes). --use-torch-fsdp2's wrapper asks for its device mesh on "cuda": it gets it on
  the CPU, where torch's `fully_shard` runs on gloo. Every other public `torch.cuda`
  function (and `Stream`/`Event`), called on the thread that installed the shim (the training thread), raises
  `ShimError` naming the calling file and line: a megatron-core release that adds a CUDA call fails there, in a
  test, not with "Found no NVIDIA driver" deep in a user's run. Queries that never touch a device
  (`is_available`, `is_initialized`, seeding, which CUDA queues until it starts) pass through; other threads (the
  checkpoint engine's) see torch's own functions.
- `cuda_free()` is a `TorchFunctionMode`, active on the calling thread only (the checkpoint engine's threads
  never see it), under which ``device='cuda'`` becomes the CPU, ``Tensor.cuda()`` returns the tensor, and
  ``Tensor.type()`` without arguments answers with the CUDA type name that megatron-core compares against.

Without apex or Transformer Engine, megatron-core's local layer spec builds torch norms, which refuse sequence
parallelism only because they do not mark their weights; `sequence_parallel_local_spec()` marks them, and
megatron-core's `finalize_model_grads` then all-reduces their gradients over TP as it does apex's. Its multi-latent
attention passes its query/key and value head widths to the core attention, which only Transformer Engine's
takes; `latent_attention_local_spec()` gives it megatron-core's local DotProductAttention, which needs neither.

Before anything is adapted, `check_sites()` reads each known site's source in the installed megatron-core. A
version that moved or rewrote a site fails with `ShimError` naming it: better than a silent half-adaptation.
"""
from __future__ import annotations

import contextlib
import importlib
import inspect
import os
import sys
import threading
from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode

_ORIGINALS: dict = {}


class ShimError(RuntimeError):
    """The installed megatron-core no longer has a CUDA site the way this module adapts it."""


@dataclass(frozen=True)
class Site:
    module: str       # megatron.core.<module>
    qualname: str     # the function or method holding the CUDA assumption
    fragment: str     # source text that must still be there
    adapted_by: str   # which adaptation makes it work on CPU

    @property
    def name(self) -> str:
        return f"megatron.core.{self.module}.{self.qualname}"


_DEVICE = "install(): torch.cuda.current_device() -> 'cpu'"
_MODE_DEVICE = "cuda_free(): device='cuda' -> cpu"
_MODE_TYPE = "cuda_free(): Tensor.type() -> CUDA type name"
_MODE_DOT_CUDA = "cuda_free(): Tensor.cuda() -> the tensor"
_SP_NORM = "sequence_parallel_local_spec(): torch norms with their weights marked sequence_parallel"
_STREAM = "install(): torch.cuda.current_stream() -> the CPU stream"
_MLA_CORE = "latent_attention_local_spec(): MLA's core attention -> the local DotProductAttention"
_DTOH_NUMPY = "install(): the dispatcher's maybe_move_tensor_to_cpu(as_numpy=True) -> numpy for CPU tensors too"
_DTOH_STREAM = ("install(): the all-to-all dispatcher's device-to-host stream -> a CPU stream; torch.cuda.stream() "
                "-> CPU's")
_FSDP2_MESH = "install(): --use-torch-fsdp2's device mesh on 'cuda' -> on 'cpu' (torch's fully_shard runs on gloo)"

SITES = (
    Site("distributed.param_and_grad_buffer", "_ParamAndGradBuffer.__init__",
         "device=torch.cuda.current_device()", _DEVICE),
    Site("optimizer.optimizer", "MixedPrecisionOptimizer.__init__", "device='cuda'", _MODE_DEVICE),
    Site("optimizer.optimizer", "FP32Optimizer.__init__", "device='cuda'", _MODE_DEVICE),
    Site("optimizer.optimizer", "Float16OptimizerWithFloat16Params.__init__",
         "param.type() in ['torch.cuda.HalfTensor', 'torch.cuda.BFloat16Tensor']", _MODE_TYPE),
    Site("optimizer.distrib_optimizer", "DistributedOptimizer._build_model_and_main_param_groups",
         "model_param.type() in ['torch.cuda.HalfTensor', 'torch.cuda.BFloat16Tensor']", _MODE_TYPE),
    Site("optimizer.distrib_optimizer", "DistributedOptimizer.load_state_dict",
         "device=torch.cuda.current_device()", _DEVICE),
    Site("optimizer.clip_grads", "get_grad_norm_fp32", "device='cuda'", _MODE_DEVICE),
    Site("utils", "local_multi_tensor_l2_norm", 'device="cuda"', _MODE_DEVICE),
    Site("tensor_parallel.mappings", "_reduce_scatter_along_first_dim",
         "device=torch.cuda.current_device()", _DEVICE),
    Site("tensor_parallel.mappings", "_gather_along_first_dim", "device=torch.cuda.current_device()", _DEVICE),
    Site("utils", "GlobalMemoryBuffer.get_tensor", "device=torch.cuda.current_device()", _DEVICE),
    Site("models.common.language_module.language_module", "LanguageModule.setup_embeddings_and_output_layer",
         "weight.data = weight.data.cuda()", _MODE_DOT_CUDA),
    Site("pipeline_parallel.schedules", "forward_backward_no_pipelining", 'device="cuda"', _MODE_DEVICE),
    Site("pipeline_parallel.schedules", "forward_backward_pipelining_without_interleaving", 'device="cuda"',
         _MODE_DEVICE),
    Site("transformer.torch_norm", "WrappedTorchNorm.__new__", "assert not config.sequence_parallel", _SP_NORM),
    Site("distributed.finalize_model_grads", "_allreduce_non_tensor_model_parallel_grads",
         'getattr(param, "sequence_parallel", False)', _SP_NORM),
    Site("pipeline_parallel.p2p_communication", "P2PCommunicator._communicate",
         "device=torch.cuda.current_device()", _DEVICE),
    Site("transformer.multi_latent_attention", "MultiLatentAttention.__init__", "v_channels=self.config.v_head_dim",
         _MLA_CORE),
    Site("transformer.moe.token_dispatcher", "MoEAlltoAllTokenDispatcher.__init__",
         "if MoEAlltoAllTokenDispatcher.cuda_dtoh_stream is None:", _DTOH_STREAM),
    Site("transformer.moe.token_dispatcher", "MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize",
         "with torch.cuda.stream(self.cuda_dtoh_stream):", _DTOH_STREAM),
    Site("transformer.moe.token_dispatcher", "MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize",
         "self.input_splits, as_numpy=True", _DTOH_NUMPY),
    Site("transformer.moe.moe_utils", "maybe_move_tensor_to_cpu", "if torch.is_tensor(tensor) and tensor.is_cuda:",
         _DTOH_NUMPY),
    Site("distributed.torch_fully_sharded_data_parallel", "TorchFullyShardedDataParallel.__init__",
         'DeviceMesh.from_group(self.process_group, "cuda")', _FSDP2_MESH),
)
# Sites of one megatron-core release only, keyed by the first version that has them.
SITES_SINCE = {
    "0.19": (Site("distributed.param_and_grad_buffer", "_ParamAndGradBucketGroup.start_grad_sync",
                  "torch.cuda.current_stream()", _STREAM),),
}


def megatron_core_version() -> str:
    try:
        from megatron.core.package_info import __version__
        return __version__
    except ImportError:
        return "unknown"


def sites_of(version: str) -> tuple:
    """The known sites of megatron-core `version` (the common ones plus those of its release and earlier)."""
    def key(v):
        return tuple(int(p) for p in v.split(".")[:2] if p.isdigit())
    extra = tuple(site for since, sites in SITES_SINCE.items() if key(version) >= key(since) for site in sites)
    return SITES + extra


def _resolve(site: Site):
    obj = importlib.import_module(f"megatron.core.{site.module}")
    for part in site.qualname.split("."):
        obj = getattr(obj, part)
    return obj


def check_sites(sites=None) -> None:
    """Fail, naming the site, when the installed megatron-core moved or rewrote a site this module adapts."""
    version = megatron_core_version()
    for site in sites_of(version) if sites is None else sites:
        try:
            source = inspect.getsource(_resolve(site))
        except (ImportError, AttributeError, OSError, TypeError) as e:
            raise ShimError(f"megatron-core {version}: CPU adaptation site {site.name} is gone ({e}); "
                            f"megatron/training/cpu_shim.py must be updated for this version") from e
        if site.fragment not in source:
            raise ShimError(f"megatron-core {version}: CPU adaptation site {site.name} no longer contains "
                            f"{site.fragment!r} (adapted by {site.adapted_by}); megatron/training/cpu_shim.py "
                            "must be updated for this version")


def needed() -> bool:
    return not torch.cuda.is_available()


def installed() -> bool:
    return bool(_ORIGINALS)


def _current_device():
    return "cpu"


def _synchronize(device=None):
    return None


def _set_device(device):
    return None


def _device_count():
    return 0


def _current_stream(device=None):
    return torch.cpu.current_stream()


def _is_current_stream_capturing():
    return False


def _stream(stream):
    return torch.cpu.stream(stream)


class _CpuSideStream(torch.cpu.Stream):
    """A side stream of a CPU rank: its work is synchronous, so an event recorded on it is done already."""

    def record_event(self, event=None):
        return torch.cpu.Event()


def _to_host(tensor, as_numpy: bool = False, record_stream: bool = False):
    """megatron-core's maybe_move_tensor_to_cpu, which on CUDA gives the split sizes as numpy arrays, doing the
    same for tensors already on the CPU."""
    if as_numpy and torch.is_tensor(tensor) and tensor.device.type == "cpu":
        return tensor.numpy()
    return _ORIGINAL_TO_HOST[0](tensor, as_numpy=as_numpy, record_stream=record_stream)


_ORIGINAL_TO_HOST: list = []


def _adapt_alltoall_dispatcher(install: bool) -> None:
    """The all-to-all dispatcher's side stream and device-to-host copies, adapted (or restored)."""
    from megatron.core.transformer.moe import token_dispatcher
    dispatcher = token_dispatcher.MoEAlltoAllTokenDispatcher
    if install:
        if dispatcher.cuda_dtoh_stream is None:  # megatron-core makes it once, a torch.cuda.Stream, if unset
            dispatcher.cuda_dtoh_stream = _CpuSideStream()
        _ORIGINAL_TO_HOST[:] = [token_dispatcher.maybe_move_tensor_to_cpu]
        token_dispatcher.maybe_move_tensor_to_cpu = _to_host
        return
    if isinstance(dispatcher.cuda_dtoh_stream, _CpuSideStream):
        dispatcher.cuda_dtoh_stream = None
    if _ORIGINAL_TO_HOST:
        token_dispatcher.maybe_move_tensor_to_cpu = _ORIGINAL_TO_HOST.pop()


class _CpuMesh:
    """torch's DeviceMesh as megatron-core's FSDP2 wrapper names it, with a mesh asked for on 'cuda' made on the
    CPU: fully_shard then shards, gathers and reduce-scatters on the CPU ranks' gloo group."""

    @staticmethod
    def from_group(group, device_type, *args, **kwargs):
        from torch.distributed.device_mesh import DeviceMesh
        return DeviceMesh.from_group(group, "cpu" if _is_cuda(device_type) else device_type, *args, **kwargs)


def _adapt_fsdp2_mesh(install: bool) -> None:
    """megatron-core's TorchFullyShardedDataParallel's device mesh, adapted (or restored)."""
    from megatron.core.distributed import torch_fully_sharded_data_parallel as fsdp2
    if install:
        if fsdp2.DeviceMesh is not _CpuMesh:
            _ORIGINAL_MESH[:] = [fsdp2.DeviceMesh]
            fsdp2.DeviceMesh = _CpuMesh
    elif _ORIGINAL_MESH:
        fsdp2.DeviceMesh = _ORIGINAL_MESH.pop()


_ORIGINAL_MESH: list = []


# What install() answers on CPU, by torch.cuda name (one function each: torch._dynamo's trace rules refuse one
# function object under two torch names).
_ANSWERS = {
    "current_device": _current_device,
    "synchronize": _synchronize,
    "set_device": _set_device,
    "device_count": _device_count,
    "current_stream": _current_stream,
    "stream": _stream,
    "is_current_stream_capturing": _is_current_stream_capturing,
}
# Public torch.cuda functions that never touch a device: they keep torch's own behaviour.
_HARMLESS = frozenset({"is_available", "is_initialized", "manual_seed", "manual_seed_all", "seed", "seed_all",
                       "empty_cache", "is_bf16_supported"})
_GUARDED_CLASSES = ("Stream", "Event", "ExternalStream", "CUDAGraph")
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_training_thread: list = []  # the ident of the thread that installed the shim


def _caller() -> str:
    """file:line (function) of the nearest frame outside torch and this module."""
    frame = sys._getframe(2)
    while frame is not None and (frame.f_code.co_filename.startswith(_TORCH_DIR)
                                 or frame.f_code.co_filename == __file__):
        frame = frame.f_back
    if frame is None:
        return "an unknown caller"
    return f"{frame.f_code.co_filename}:{frame.f_lineno} ({frame.f_code.co_name})"


def _unanswered(name: str) -> ShimError:
    return ShimError(f"megatron-core {megatron_core_version()}: torch.cuda.{name} called at {_caller()} on a CPU "
                     "rank; megatron/training/cpu_shim.py does not adapt it (add it there, or refuse the flag "
                     "that leads to it)")


def _guard_function(name: str, original):
    def guarded(*args, **kwargs):
        if _training_thread and threading.get_ident() == _training_thread[0]:
            raise _unanswered(name)
        return original(*args, **kwargs)
    guarded.__name__ = guarded.__qualname__ = name
    guarded.__wrapped__ = original
    return guarded


def _guard_class(name: str, original):
    def __new__(cls, *args, **kwargs):
        if _training_thread and threading.get_ident() == _training_thread[0]:
            raise _unanswered(name)
        return original.__new__(cls, *args, **kwargs)
    return type(original)(name, (original,), {"__new__": __new__, "__module__": original.__module__})


def _replacements() -> dict:
    """Every public torch.cuda callable this shim answers or guards, with its replacement."""
    out = dict(_ANSWERS)
    for name, value in vars(torch.cuda).items():
        if name.startswith("_") or name in out or name in _HARMLESS:
            continue
        if name in _GUARDED_CLASSES:
            out[name] = _guard_class(name, value)
        elif inspect.isfunction(value) or inspect.isbuiltin(value):
            out[name] = _guard_function(name, value)
    return out


def install() -> bool:
    """Check the sites, then answer torch.cuda's device functions on CPU and guard the rest. Idempotent.

    Returns True when the shim is active, False when CUDA is present (nothing is checked or changed then)."""
    if not needed():
        return False
    if _ORIGINALS:
        return True
    check_sites()
    for name, repl in _replacements().items():
        _ORIGINALS[name] = getattr(torch.cuda, name)
        setattr(torch.cuda, name, repl)
    _training_thread[:] = [threading.get_ident()]
    _adapt_alltoall_dispatcher(True)
    _adapt_fsdp2_mesh(True)
    return True


def uninstall() -> None:
    if _ORIGINALS:
        _adapt_alltoall_dispatcher(False)
        _adapt_fsdp2_mesh(False)
    for name, orig in _ORIGINALS.items():
        setattr(torch.cuda, name, orig)
    _ORIGINALS.clear()
    _training_thread.clear()


def _is_cuda(device) -> bool:
    return device is not None and str(device).startswith("cuda")


class _CpuDevices(TorchFunctionMode):
    """``device='cuda'`` -> CPU, ``.cuda()`` -> self, ``.type()`` -> the CUDA type name (see the module doc)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            return func(*args).replace("torch.", "torch.cuda.", 1)
        if _is_cuda(kwargs.get("device")):
            kwargs = dict(kwargs, device="cpu")
        return func(*args, **kwargs)


def cuda_free():
    """A context under which megatron-core's ``'cuda'`` tensors and type checks work on CPU (this thread only).

    A null context when CUDA is present."""
    return _CpuDevices() if installed() else contextlib.nullcontext()


class _SequenceParallelNorm:
    """megatron-core's WrappedTorchNorm, its weights marked as sequence-parallel (replicated over TP, their
    gradients summed over TP by finalize_model_grads). A class: megatron-core's build_module calls classes and
    hands plain functions back uncalled."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **kwargs):
        import dataclasses
        from megatron.core.transformer.torch_norm import WrappedTorchNorm
        norm = WrappedTorchNorm(dataclasses.replace(config, sequence_parallel=False), hidden_size, eps, **kwargs)
        for p in norm.parameters():
            p.sequence_parallel = True
        return norm


def sequence_parallel_local_spec(layer_spec, config):
    """megatron-core's local GPT layer spec as a block spec whose norms accept --sequence-parallel on CPU."""
    import copy
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
    layer_spec = copy.deepcopy(layer_spec)
    layer_spec.submodules.input_layernorm = _SequenceParallelNorm
    layer_spec.submodules.pre_mlp_layernorm = _SequenceParallelNorm
    return TransformerBlockSubmodules(layer_specs=[layer_spec] * get_num_layers_to_build(config),
                                      layer_norm=_SequenceParallelNorm)


class _LatentCoreAttention:
    """megatron-core's local DotProductAttention as multi-latent attention's core attention. MLA builds it with
    k_channels and v_channels, which only Transformer Engine's attention takes; the local one reads queries and
    keys at the width they come in, scales by the softmax_scale MLA passes, and shapes its output by kv_channels,
    which the trainer sets to --v-head-dim. A class, as `_SequenceParallelNorm`."""

    def __new__(cls, config, *args, k_channels=None, v_channels=None, **kwargs):
        from megatron.core.transformer.dot_product_attention import DotProductAttention
        if v_channels is not None and v_channels != config.kv_channels:
            raise ShimError(f"multi-latent attention's value heads are {v_channels} wide but kv_channels is "
                            f"{config.kv_channels}: the local attention would shape its output wrongly")
        return DotProductAttention(config, *args, **kwargs)


def latent_attention_local_spec(spec):
    """A copy of megatron-core's local layer spec, or of a block spec of them, whose multi-latent attention has
    `_LatentCoreAttention` as its core attention."""
    import copy
    spec = copy.deepcopy(spec)
    for layer_spec in getattr(spec, "layer_specs", [spec]):
        layer_spec.submodules.self_attention.submodules.core_attention = _LatentCoreAttention
    return spec
