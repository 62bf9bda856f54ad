"""Upstream Megatron-LM's `--ckpt-format torch_dcp` (what an `--use-torch-fsdp2` run saves there), as this trainer
reads and writes it: its flat DCP keys, and their map to megatron-core's sharded keys, model-free.

What upstream saves (megatron/training/checkpointing.py of Megatron-LM, 0.19.2's `generate_state_dict`, written by
`torch.distributed.checkpoint.save` into `iter_NNNNNNN/` with `latest_checkpointed_iteration.txt` beside it):
- `model.<name>`: the unwrapped GPTModel's `state_dict_for_save_checkpoint()`, module names (`decoder.layers.3.
  input_layernorm.weight`), each a DTensor sharded on dim 0 (uneven rows as torch's FSDP2 cuts them); every
  megatron-core linear's `_extra_state` as an object;
- `optimizer.`: the optimizer's plain `state_dict()`. 16-bit training: `optimizer.optimizer.state.<id>.{exp_avg,
  exp_avg_sq,step}`, `optimizer.optimizer.param_groups.<g>.<field>` (with `params`: the group's ids) and the fp32
  main parameters `optimizer.fp32_from_fp16_params.<g>.<j>`; fp32 training: `optimizer.state.<id>...` and
  `optimizer.param_groups...`. Ids number the parameters group by group, in the model's parameter order;
- `opt_param_scheduler.<field>`, `rng_state.0.<field>` (one rank's RNG, as upstream restores on every rank),
  `args`, `iteration`, `checkpoint_version`, `num_floating_point_operations_so_far`.

megatron-core keys the same tensors by layer-stacked names (`decoder.layers.self_attention.linear_qkv.
layer_norm_weight`, one axis per layer); its layer spec renames some modules in checkpoints
(`sharded_state_dict_keys_map`: the local spec's `input_layernorm.` is `self_attention.linear_qkv.layer_norm_`).
The parameter ids follow megatron-core's default parameter groups: weight decay on every parameter but biases and
1-D ones (`get_standard_config_overrides`), groups without overrides first, each in the model's parameter order (a
read takes it from the DCP metadata, which keeps the saved state dict's order; a write from the datastates
checkpoint's keys, which keep megatron-core's sharded state dict's). A read checks the groups against what the
checkpoint records (the ids of each group, each state's shape), a write against the saved groups' weight decay, so
a model the rule does not describe is refused, not mis-assigned.
"""
from __future__ import annotations

import io
import pickle
import re
import types

import torch
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

MODEL = "model."
LAYERS = "decoder.layers."
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
ADAM = ("exp_avg", "exp_avg_sq")
EXPERTS = "mlp.experts.experts."  # megatron-core's SequentialMLP: its experts' sharded prefix in a layer
LOCAL_EXPERTS = "mlp.experts.local_experts."  # ... and their module names
_LOCAL_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.+)$")


class TorchDcpError(ValueError):
    """A torch_dcp checkpoint this trainer cannot map; the message names the key or group."""


def layer_keys_map() -> dict[str, str]:
    """megatron-core's renames of a layer's module names in checkpoints (its local GPT layer spec's)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    return dict(get_gpt_layer_local_spec().submodules.sharded_state_dict_keys_map or {})


def to_sharded(name: str, keys_map: dict[str, str]) -> tuple[str, tuple[int, ...]]:
    """(megatron-core's sharded key, index along its stacked axes) of the module name `name`: a layer's tensor is
    stacked over layers, an expert's (SequentialMLP's `local_experts.<e>`, global ids: FSDP2 runs at EP 1) over
    layers and experts."""
    m = _LAYER.match(name)
    if m is None:
        return name, ()
    rest = m[2]
    for old, new in keys_map.items():
        if rest.startswith(old):
            rest = new + rest[len(old):]
            break
    e = _LOCAL_EXPERT.match(rest)
    if e is not None:
        return f"{LAYERS}{EXPERTS}{e[2]}", (int(m[1]), int(e[1]))
    return LAYERS + rest, (int(m[1]),)


def to_module(key: str, index: tuple[int, ...], keys_map: dict[str, str]) -> str:
    """The module name of layer `index` (and expert) of megatron-core's sharded key `key` (`to_sharded`'s
    inverse)."""
    if not key.startswith(LAYERS):
        return key
    rest = key[len(LAYERS):]
    if len(index) == 2:
        return f"{LAYERS}{index[0]}.{LOCAL_EXPERTS}{index[1]}.{rest[len(EXPERTS):]}"
    for old, new in keys_map.items():
        if rest.startswith(new):
            rest = old + rest[len(new):]
            break
    return f"{LAYERS}{index[0]}.{rest}"


def no_weight_decay(name: str, shape: tuple) -> bool:
    """megatron-core's default: biases and 1-D parameters are trained without weight decay."""
    return name.endswith(".bias") or len(shape) == 1


def param_groups(names: list[str], shapes: dict[str, tuple], decays: list[bool]) -> list[list[str]]:
    """The parameters of each optimizer group, in id order: `decays` says whether each group (in its saved order)
    applies weight decay; megatron-core orders the group without overrides (weight decay on) first."""
    out = []
    for decay in decays:
        out.append([n for n in names if no_weight_decay(n, shapes[n]) != decay])
    missing = [n for n in names if not any(n in g for g in out)]
    if missing:
        raise TorchDcpError(f"no optimizer group holds {missing[:3]}: its groups {decays} (weight decay on/off) do "
                            "not follow megatron-core's default grouping")
    return out


def optimizer_prefix(bf16_or_fp16: bool) -> str:
    """Where the Adam state and param groups are: inside Float16OptimizerWithFloat16Params' `optimizer`, or
    FP32Optimizer's own."""
    return "optimizer.optimizer." if bf16_or_fp16 else "optimizer."


MAIN_PARAMS = "optimizer.fp32_from_fp16_params."


TRACKER = "rng_tracker_states."


def as_bytes(t) -> bytes | None:
    """A torch RNG state saved as a uint8 tensor (DCP's form) as the bytes this trainer keeps (anything else, bytes
    or None: as it is)."""
    return t.detach().contiguous().view(torch.uint8).numpy().tobytes() if isinstance(t, torch.Tensor) else t


def rng_state(fields: dict) -> dict:
    """Upstream's RNG fields (`random_rng_state`, `np_rng_state`, `torch_rng_state`, `cuda_rng_state`,
    `rng_tracker_states.<name>`; torch's states as uint8 tensors) as this trainer's RNG state (torch's as bytes)."""
    tracker = {k[len(TRACKER):]: as_bytes(v) for k, v in fields.items() if k.startswith(TRACKER)}
    return {"random_rng_state": fields.get("random_rng_state"), "np_rng_state": fields.get("np_rng_state"),
            "torch_rng_state": as_bytes(fields.get("torch_rng_state")),
            "cuda_rng_state": as_bytes(fields.get("cuda_rng_state")), "rng_tracker_states": tracker}


def rng_fields(state: dict) -> tuple[dict, dict]:
    """`rng_state`'s inverse: (the objects, the uint8 tensors) of upstream's RNG fields for this trainer's
    `state`."""
    objects = {"random_rng_state": state["random_rng_state"], "np_rng_state": state["np_rng_state"]}
    raw = {n: state.get(n) for n in ("torch_rng_state", "cuda_rng_state")}
    raw.update({TRACKER + k: v for k, v in (state.get("rng_tracker_states") or {}).items()})
    tensors = {n: torch.frombuffer(bytearray(as_bytes(v)), dtype=torch.uint8) for n, v in raw.items()
               if v is not None}
    return objects, tensors


def nested_path(key: str) -> tuple:
    """Where the flat DCP key `key` sits in upstream's nested state dict (what DCP's metadata records as its
    `planner_data`, for `dcp_to_torch_save` and loads that flatten): the model's names whole, a list's index as
    an int, a dict's key (the optimizer's state ids included) as a string."""
    if key.startswith(MODEL):
        return ("model", key[len(MODEL):])
    parts = key.split(".")
    return tuple(int(p) if p.isdigit() and parts[i - 1] != "state" else p for i, p in enumerate(parts))


# ----- objects -----

_SAFE = {("builtins", n) for n in ("dict", "list", "tuple", "set", "frozenset", "int", "float", "complex", "str",
                                   "bytes", "bytearray", "bool", "slice", "range")} | {
    ("collections", "OrderedDict"), ("argparse", "Namespace"), ("copyreg", "_reconstructor"), ("_codecs", "encode"),
    ("numpy", "ndarray"), ("numpy", "dtype"), ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"), ("numpy.core.multiarray", "scalar"),
    ("numpy._core.multiarray", "scalar"), ("torch._utils", "_rebuild_tensor_v2"), ("torch", "Size"),
    ("torch.storage", "UntypedStorage")} | {("numpy.dtypes", n) for n in ("UInt32DType", "Float64DType")}


class Unknown:
    """A global of upstream's pickled objects that this process does not trust or does not have (an enum of
    another megatron-core release): kept as its name, never imported."""

    def __init__(self, *args, **kwargs):
        self.args = args

    def __setstate__(self, state):
        self.state = state

    def __repr__(self):
        return f"<{type(self).__module__}.{type(self).__name__}>"


class _Unpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if (module, name) in _SAFE or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)) \
                or (module == "torch" and name.endswith("Storage")):
            return super().find_class(module, name)
        return type(name, (Unknown,), {"__module__": module})


_PICKLE = types.ModuleType("datastates_torch_dcp_pickle")
_PICKLE.Unpickler = _Unpickler
_PICKLE.load = pickle.load


def load_object(data: bytes):
    """An object DCP saved (torch.save bytes), unpickled without importing anything off the allow-list."""
    return torch.load(io.BytesIO(data), weights_only=False, pickle_module=_PICKLE)


class SafeObjectsPlanner(DefaultLoadPlanner):
    """DCP's default load, its objects unpickled by `load_object` (DCP's own `torch.load` would import whatever
    upstream's pickles name, and fail on another megatron-core release's enums)."""

    def load_bytes(self, read_item, value):
        obj = load_object(value.read())
        fqn = read_item.dest_index.fqn
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:  # the caller's own dict (DCP may have copied it)
            self.original_state_dict[fqn] = obj


def read_objects(ckpt_dir: str, keys: tuple[str, ...]) -> dict:
    """Objects `keys` of the DCP checkpoint `ckpt_dir`, read by this process alone (none of its tensors)."""
    import warnings
    from torch.distributed import checkpoint as dcp
    state = dict.fromkeys(keys)
    with warnings.catch_warnings():  # DCP warns that it reads in one process even when told to
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, storage_reader=dcp.FileSystemReader(ckpt_dir),
                 planner=SafeObjectsPlanner(flatten_state_dict=False), no_dist=True)
    return state


def plain_args(args):
    """Upstream's args as a Namespace of plain values (what this trainer's checks and args readers use)."""
    import argparse
    out = argparse.Namespace()
    for k, v in vars(args).items():
        if isinstance(v, (str, int, float, bool, type(None))) or (
                isinstance(v, (list, tuple)) and all(isinstance(x, (str, int, float, bool)) for x in v)):
            setattr(out, k, v)
    return out
