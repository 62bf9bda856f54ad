"""Upstream Megatron-LM's `--ckpt-format fsdp_dtensor` (a `--use-megatron-fsdp` run's checkpoint, or what its
converter `checkpoint_inspector.py convert-torch-dist-to-fsdp-dtensor` writes) <-> a `Bundle`, in one process.

What upstream holds (megatron-core 0.19.2's `preprocess_fsdp_dtensor_state_dict` and
`DistributedOptimizer.sharded_param_state_fsdp_dtensor`; the converter writes the same keys): plain DCP files of
FQN-keyed tensors, each a DTensor `Shard(0)`-ed unevenly over the ranks (DCP's metadata lists every rank's chunk):
- `model.module.<name>`: one tensor per layer (`decoder.layers.3.mlp.linear_fc2.weight`), the names of
  megatron-core's sharded keys (Transformer Engine's modules: `self_attention.linear_qkv.layer_norm_weight`; a run
  of the local spec saves `input_layernorm.weight`, read as megatron-core's checkpoint rename says); SwiGLU's
  `linear_fc1.weight` stored as its two halves `linear_fc1.weight_w` (the gate, megatron-core's first half) and
  `..._v`; experts under their global ids; no `_extra_state`;
- `optimizer.state.module.module.module.<name>.<state>`: Adam's `exp_avg`, `exp_avg_sq` (and, converted from a
  distributed optimizer, the fp32 main parameter: `fp32_param` in megatron-core 0.16, `param` in 0.19) per
  parameter name, fc1's split as the parameter's;
- `optimizer.param_to_group_meta.<...>.<name>.<field>` (a training save: each parameter's group), the common
  state flattened to dotted keys (`args`, `iteration`, `opt_param_scheduler.max_lr`,
  `optimizer.param_groups.0.lr`, ...), and `rng_state.(<pp>, <tp>).<dp>.<field>` (a training save; the converter
  drops RNG).

Read: every tensor whole through DCP's reader (after checking from the metadata alone that each tensor's chunks
cover it), layers stacked into megatron-core's sharded keys, fc1's halves joined back in megatron-core's order,
the common state unflattened. Write: the inverse, as upstream's converter lays it out (one chunk per tensor; a
reader takes whatever rows it wants). MoE checkpoints (global expert ids) are refused by name, not mis-read.
"""
from __future__ import annotations

import argparse
import os
import re

import torch
from torch.distributed import checkpoint as dcp
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from datastates import Box, SaveRoot, holds_dcp, storage_for
from datastates.paths import DCP_METADATA
from megatron.training.checkpointing import torch_dcp as names

from .bundle import Bundle
from .paths import ConvertError, resolve_input, resolve_output
from .torch_dcp import read_items, stack_layers
from .torch_dist import stacked_lead
from .torch_dist_writer import PiecePlanner, Pieces, publish_dcp

MODEL = "model.module."
STATE = "optimizer.state."
OWNER = "module.module.module."  # the optimizer's parameter names: the wrapped model's (the converter's default)
GROUP_META = "optimizer.param_to_group_meta."
RNG = "rng_state."
KINDS = ("exp_avg", "exp_avg_sq", "fp32_param", "param")  # the fp32 main parameter: 0.16's name, 0.19's
HALVES = ("_w", "_v")
_FC1 = re.compile(r"\.mlp\.(shared_experts\.)?linear_fc1\.(weight|bias)$")
_EXPERT = re.compile(r"\.mlp\.experts\.")
_RNG = re.compile(r"^rng_state\.\((\d+), (\d+)\)\.(\d+)\.(.+)$")
# a torch_dist ShardedObject the converter copies through as it found it (0.19's `common_state/shard_0_1`, a
# second copy of the common state it also flattens): not part of what a training save holds
_COPIED_OBJECT = re.compile(r"/shard_[\d._]+$")


def check_coverage(ckpt: str, meta: dict) -> None:
    """Every tensor's chunks lie inside it, do not overlap and cover it whole (from DCP's metadata alone)."""
    for key, item in meta.items():
        if isinstance(item, BytesStorageMetadata):
            continue
        size = tuple(item.size)
        boxes, covered = [], 0
        for c in item.chunks:
            box = Box(tuple(c.offsets), tuple(c.sizes))
            if any(o < 0 or o + n > s for o, n, s in zip(box.offset, box.shape, size)):
                raise ConvertError(f"fsdp_dtensor checkpoint {ckpt!r}: a chunk of {key!r} at {box.offset} of "
                                   f"{box.shape} lies outside its global shape {size}")
            if any(box.overlap(b) is not None for b in boxes):
                raise ConvertError(f"fsdp_dtensor checkpoint {ckpt!r}: chunks of {key!r} overlap at {box.offset}")
            boxes.append(box)
            covered += torch.Size(box.shape).numel()
        if covered != torch.Size(size).numel():
            raise ConvertError(f"fsdp_dtensor checkpoint {ckpt!r}: the shards of {key!r} (global shape {size}) do "
                               f"not cover it: {covered} of {torch.Size(size).numel()} elements saved")


def holds_fsdp_dtensor(meta: dict) -> bool:
    """Upstream's fsdp_dtensor (its model under `model.module.`), not an FSDP2 run's torch_dcp (`model.`)."""
    return any(k.startswith(MODEL) for k in meta)


def read_fsdp_dtensor(path: str, iteration: int | None) -> Bundle:
    ckpt = resolve_input(path, iteration, "fsdp_dtensor")
    if not holds_dcp(storage_for(ckpt), ckpt):
        raise ConvertError(f"{ckpt!r} is not an fsdp_dtensor checkpoint (no DCP .metadata, or megatron-core's "
                           "metadata.json beside it: read that as --from torch_dist)")
    meta = dcp.FileSystemReader(ckpt).read_metadata().state_dict_metadata
    if not holds_fsdp_dtensor(meta):
        raise ConvertError(f"{ckpt!r} holds no 'model.module.' tensors: not upstream's fsdp_dtensor (an FSDP2 "
                           "run's torch_dcp? read it as --from torch_dcp)")
    experts = next((k for k in meta if _EXPERT.search(k)), None)
    if experts is not None:
        raise ConvertError(f"{ckpt!r}: {experts!r} is an expert's: MoE fsdp_dtensor checkpoints (global expert "
                           "ids) are not read yet")
    check_coverage(ckpt, meta)
    tensors, objects, _ = read_items(ckpt)
    if "args" not in objects or "iteration" not in objects:
        raise ConvertError(f"{ckpt!r} holds no args or iteration: not a checkpoint upstream wrote")
    bundle = Bundle(ckpt, int(objects["iteration"]))
    keys_map = names.layer_keys_map()
    per_index: dict[str, dict] = {}
    for k, t in tensors.items():
        where = _tensor_place(k, keys_map)
        if where is not None:
            key, index, half = where
            per_index.setdefault(key, {}).setdefault(index, {})[half] = t
    for key, parts in per_index.items():
        for index, halves in parts.items():
            parts[index] = _joined(ckpt, key, index, halves)
    bundle.tensors.update(stack_layers(per_index, ckpt))
    _read_rng(bundle, objects, tensors)
    bundle.common = _common(objects, tensors)
    plain = bundle.common["args"] = names.plain_args(objects["args"])  # upstream's enums are not kept
    consumed = int(getattr(plain, "consumed_train_samples", 0) or 0)
    bundle.common.setdefault("train_state", {"consumed_train_samples": consumed, "iteration": bundle.iteration})
    return bundle


def _tensor_place(k: str, keys_map: dict) -> tuple[str, tuple, str] | None:
    """(bundle key, layer index, fc1 half or "") of the DCP tensor `k`; None for what is not model or Adam."""
    if k.startswith(MODEL):
        name, kind = k[len(MODEL):], None
    elif k.startswith(STATE):
        rest = k[len(STATE):]
        while rest.startswith("module."):
            rest = rest[len("module."):]
        name, _, kind = rest.rpartition(".")
        if kind not in KINDS:
            return None
    else:
        return None
    half = ""
    if name.endswith(HALVES) and _FC1.search(name[:-2]):
        name, half = name[:-2], name[-2:]
    key, index = names.to_sharded(name, keys_map)
    return (key if kind is None else f"optimizer.state.{kind}.{key}"), index, half


def _joined(ckpt: str, key: str, index: tuple, halves: dict) -> torch.Tensor:
    """A tensor of one layer; SwiGLU's fc1 from its `_w` and `_v` halves, in megatron-core's order."""
    if set(halves) == {""}:
        return halves[""]
    if set(halves) != set(HALVES):
        raise ConvertError(f"fsdp_dtensor checkpoint {ckpt!r}: {key!r} of layer {index} has halves "
                           f"{sorted(halves)}, not both of {HALVES}")
    return torch.cat([halves["_w"], halves["_v"]])


def _unflatten(flat: dict) -> dict:
    """The nested dict the converter flattened to dotted keys; a level whose keys are 0..n-1 is a list."""
    root: dict = {}
    for key, value in flat.items():
        *path, last = key.split(".")
        node = root
        for p in path:
            node = node.setdefault(p, {})
        node[last] = value

    def lists(node):
        if not isinstance(node, dict) or not node:
            return node
        node = {k: lists(v) for k, v in node.items()}
        if sorted(node) == [str(i) for i in range(len(node))]:
            return [node[str(i)] for i in range(len(node))]
        return node
    return lists(root)


def _common(objects: dict, tensors: dict) -> dict:
    """megatron-core's common state dict from the flattened objects (the distributed optimizer's param groups
    back under `optimizer.optimizer.`, where megatron-core keeps them)."""
    flat = {k: v for k, v in objects.items()
            if not k.startswith((GROUP_META, RNG, MODEL, STATE)) and not _COPIED_OBJECT.search(k)}
    flat.update({k: v for k, v in tensors.items() if not k.startswith((MODEL, STATE, RNG))})
    common = _unflatten(flat)
    optimizer = common.get("optimizer")
    if isinstance(optimizer, dict) and "param_groups" in optimizer:
        optimizer.setdefault("optimizer", {})["param_groups"] = optimizer.pop("param_groups")
    return common


def _read_rng(bundle: Bundle, objects: dict, tensors: dict) -> None:
    """A training save's `rng_state.(pp, tp).dp.<field>` as this trainer's per-rank RNG objects of a
    (pp, tp, dp) grid (torch's states as bytes, as the torch_dcp reader gives them); none when the checkpoint
    holds none (the converter's)."""
    states: dict[tuple, dict] = {}
    for k, v in {**objects, **tensors}.items():
        m = _RNG.match(k)
        if m:
            states.setdefault((int(m[1]), int(m[2]), int(m[3])), {})[m[4]] = v
    for offset, fields in states.items():
        bundle.objects[("rng_state", offset)] = [names.rng_state(fields)]
    if states:
        bundle.object_shapes["rng_state"] = tuple(max(o[i] for o in states) + 1 for i in range(3))


# ----- writing -----

def _flatten(obj, prefix: str, out: dict) -> None:
    """The converter's flattening of the common state: dicts and lists to dotted keys, anything else a value."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            _flatten(v, f"{prefix}.{k}" if prefix else str(k), out)
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            _flatten(v, f"{prefix}.{i}" if prefix else str(i), out)
    else:
        out[prefix] = obj


def _names(key: str, shape: tuple) -> list[tuple[str, tuple]]:
    """(upstream's name, layer index) of each layer of the bundle's tensor `key` (the name of its sharded key)."""
    lead = stacked_lead(key, shape)
    if lead == 0:
        return [(key, ())]
    if lead != 1 or not key.startswith(names.LAYERS):
        raise ConvertError(f"{key!r}: fsdp_dtensor is written for dense GPT models (decoder layers only); this "
                           "tensor is stacked over experts or another block")
    return [(f"{names.LAYERS}{i}.{key[len(names.LAYERS):]}", (i,)) for i in range(shape[0])]


def _pieces(tensor: torch.Tensor, index: tuple, name: str, swiglu: bool) -> dict[str, Pieces]:
    """One layer of `tensor` under `name`; SwiGLU's fc1 as its `_w` and `_v` halves."""
    def piece(rows: slice | None) -> Pieces:
        def build(_):
            t = tensor[index] if index else tensor
            return t if rows is None else t[rows]
        shape = tuple(tensor.shape[len(index):])
        if rows is not None:
            shape = (shape[0] // 2, *shape[1:])
        return Pieces(shape, tensor.dtype, 0, build)
    if not (swiglu and _FC1.search(name)):
        return {name: piece(None)}
    rows = tensor.shape[len(index)]
    if rows % 2:
        raise ConvertError(f"{name!r} has {rows} rows: SwiGLU's fc1 splits into two equal halves")
    return {f"{name}_w": piece(slice(0, rows // 2)), f"{name}_v": piece(slice(rows // 2, rows))}


def write_fsdp_dtensor(bundle: Bundle, output: str) -> str:
    """`bundle` (a datastates or torch_dist checkpoint of a dense GPT model, read) as upstream's fsdp_dtensor."""
    out, _ = resolve_output(output, bundle.iteration)
    args = bundle.common.get("args")
    if args is None:
        raise ConvertError(f"{bundle.source!r} holds no args: upstream's loader needs them")
    swiglu = bool(getattr(args, "swiglu", False))
    tensors: dict[str, Pieces] = {}
    for key, t in bundle.tensors.items():
        if "|" in key:
            raise ConvertError(f"{bundle.source!r} holds the distributed optimizer's flat ranges ({key!r}): "
                               "convert a checkpoint saved with its state in model space")
        kind = next((k for k in KINDS if key.startswith(f"optimizer.state.{k}.")), None)
        if key.startswith("optimizer.") and kind is None:
            raise ConvertError(f"{bundle.source!r}: optimizer tensor {key!r} has no place in fsdp_dtensor")
        base = key if kind is None else key[len(f"optimizer.state.{kind}."):]
        if _EXPERT.search(base):
            raise ConvertError(f"{bundle.source!r}: {key!r} is an expert's: MoE models are not written to "
                               "fsdp_dtensor yet")
        for name, index in _names(base, tuple(t.shape)):
            for n, p in _pieces(t, index, name, swiglu).items():
                tensors[MODEL + n if kind is None else f"{STATE}{OWNER}{n}.{kind}"] = p
    objects: dict[str, object] = {}
    common = dict(bundle.common)
    train = common.pop("train_state", None)  # this trainer's; upstream keeps the samples in its args
    if train is not None:
        common["args"] = argparse.Namespace(**{**vars(args), "consumed_train_samples":
                                               train["consumed_train_samples"]})
    _flatten(common, "", objects)
    for k in [k for k in objects if k.startswith("optimizer.optimizer.param_groups.")]:
        objects[k.replace("optimizer.optimizer.", "optimizer.", 1)] = objects.pop(k)
    objects.setdefault("checkpoint_version", 3.0)
    _write_rng(bundle, tensors, objects)
    root = SaveRoot(storage_for(out), os.path.dirname(os.path.abspath(out)), marker=DCP_METADATA)
    try:
        publish_dcp(root, out, PiecePlanner(tensors, objects, listed=False), "fsdp_dtensor")
    finally:
        root.storage.close()
    return out


def _write_rng(bundle: Bundle, tensors: dict, objects: dict) -> None:
    """Each data-parallel rank's RNG state as a training save's `rng_state.(pp, tp).dp.<field>` (torch_dist keeps
    a (pp, tp) grid of lists over dp, this trainer a (pp, tp, dp) grid of one-state lists)."""
    for (key, offset), value in bundle.objects.items():
        if key != "rng_state" or not value:
            continue
        states = enumerate(value) if len(offset) == 2 else [(offset[2], value[0])]
        for d, state in states:
            prefix = f"{RNG}({offset[0]}, {offset[1]}).{d}."
            fields, raw = names.rng_fields(state)
            objects.update({prefix + k: v for k, v in fields.items()})
            tensors.update({prefix + k: Pieces.whole(t) for k, t in raw.items()})
