"""Upstream Megatron-LM's torch_dcp (an `--use-torch-fsdp2` run's checkpoint) <-> a `Bundle`, in one process.

Reading assembles each DCP tensor whole through PyTorch DCP's own reader (every rank's uneven rows), stacks the
per-layer module names into megatron-core's layer-stacked sharded keys and the optimizer's numbered states into
the keys this trainer's non-distributed optimizer saves (`optimizer.state.{exp_avg,exp_avg_sq,fp32_param}.<key>`,
one `common_step`); writing is the inverse, one DCP chunk per layer built as DCP's writer reaches it (the torch_dist
writer's planner). The names and ids: `megatron.training.checkpointing.torch_dcp`.
"""
from __future__ import annotations

import itertools
import os
import warnings

import torch
from torch.distributed import checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from datastates import SaveRoot, holds_dcp, storage_for
from datastates.paths import DCP_METADATA
from megatron.training.checkpointing import torch_dcp as names
from megatron.training.checkpointing.torch_dcp import TorchDcpError

from .bundle import Bundle
from .paths import ConvertError, resolve_input, resolve_output
from .torch_dist import stacked_lead
from .torch_dist_writer import PiecePlanner, Pieces, publish_dcp

RNG = "rng_state"
STACKED_OBJECT = "._extra_state"


def read_items(ckpt: str) -> tuple[dict[str, torch.Tensor], dict[str, object], list[str]]:
    """(tensors, objects, the tensors' keys in the checkpoint's order) of the DCP checkpoint `ckpt`, whole."""
    reader = dcp.FileSystemReader(ckpt)
    try:
        meta = reader.read_metadata().state_dict_metadata
        tensors = {k: torch.empty(tuple(v.size), dtype=v.properties.dtype) for k, v in meta.items()
                   if not isinstance(v, BytesStorageMetadata)}
        wanted = {k: tensors.get(k) for k in meta}  # an object's place: None until it is read
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(wanted, storage_reader=reader, planner=names.SafeObjectsPlanner(flatten_state_dict=False),
                     no_dist=True)
        objects = {k: v for k, v in wanted.items() if k not in tensors}
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP and unpickling raise many types
        cause = e.failures[0][0] if isinstance(e, CheckpointException) and e.failures else e
        raise ConvertError(f"reading torch_dcp checkpoint {ckpt!r} failed: {type(cause).__name__}: {cause}") \
            from None
    return tensors, objects, list(tensors)


def stack_layers(per_index: dict[str, dict[tuple, torch.Tensor]], what: str) -> dict[str, torch.Tensor]:
    """Each key's tensors by layer (and expert) stacked on leading axes (a key without layers: its one tensor)."""
    out = {}
    for key, parts in per_index.items():
        if list(parts) == [()]:
            out[key] = parts[()]
            continue
        grid = tuple(max(i[d] for i in parts) + 1 for d in range(len(next(iter(parts)))))
        missing = [i for i in itertools.product(*map(range, grid)) if i not in parts]
        if missing:
            raise ConvertError(f"{what}: {key!r} lacks the tensor of layer (and expert) {missing[0]} of {grid}")
        out[key] = torch.stack([parts[i] for i in itertools.product(*map(range, grid))]).reshape(
            *grid, *parts[(0,) * len(grid)].shape)
    return out


def read_torch_dcp(path: str, iteration: int | None) -> Bundle:
    ckpt = resolve_input(path, iteration, "torch_dcp")
    if not holds_dcp(storage_for(ckpt), ckpt):
        raise ConvertError(f"{ckpt!r} is not a torch_dcp checkpoint (no DCP .metadata, or megatron-core's "
                           "metadata.json beside it: read that as --from torch_dist)")
    tensors, objects, order = read_items(ckpt)
    args = objects.get("args")
    if args is None or "iteration" not in objects:
        raise ConvertError(f"{ckpt!r} holds no args or iteration: not a checkpoint upstream Megatron-LM's "
                           "--ckpt-format torch_dcp wrote")
    try:
        return _bundle(ckpt, tensors, objects, order, args)
    except TorchDcpError as e:
        raise ConvertError(f"{ckpt!r}: {e}") from None


def _bundle(ckpt: str, tensors: dict, objects: dict, order: list[str], args) -> Bundle:
    from megatron.training.checkpointing.state import sharded_metadata
    keys_map = names.layer_keys_map()
    params = [k[len(names.MODEL):] for k in order if k.startswith(names.MODEL)]
    where = {p: names.to_sharded(p, keys_map) for p in params}
    model: dict[str, dict] = {}
    for p, (key, index) in where.items():
        model.setdefault(key, {})[index] = tensors[names.MODEL + p]
    bundle = Bundle(ckpt, int(objects["iteration"]))
    bundle.tensors.update(stack_layers(model, ckpt))
    sixteen = bool(getattr(args, "bf16", False) or getattr(args, "fp16", False))
    optimizer_common = _optimizer(bundle, tensors, objects, params, where, sixteen, ckpt)
    for name, value in objects.items():
        if name.startswith(names.MODEL) and name.endswith(STACKED_OBJECT):
            key, index = names.to_sharded(name[len(names.MODEL):], keys_map)
            if index:  # a layer's (expert's): megatron-core's ShardedObject per layer (the output layer: none)
                bundle.objects[(key, index)] = value
                seen = bundle.object_shapes.get(key, (0,) * len(index))
                bundle.object_shapes[key] = tuple(max(n, i + 1) for n, i in zip(seen, index))
    plain = names.plain_args(args)
    consumed = int(getattr(args, "consumed_train_samples", 0) or 0)
    bundle.common = {"args": plain, "checkpoint_version": objects.get("checkpoint_version", 3.0),
                     "iteration": bundle.iteration,
                     "train_state": {"consumed_train_samples": consumed, "iteration": bundle.iteration},
                     "content_metadata": sharded_metadata(plain),
                     "opt_param_scheduler": _fields(objects, "opt_param_scheduler.")}
    if optimizer_common is not None:
        bundle.common["optimizer"] = optimizer_common
    _rng(bundle, objects, tensors, int(getattr(args, "data_parallel_size", 1) or 1))
    return bundle


def _fields(objects: dict, prefix: str) -> dict:
    return {k[len(prefix):]: v for k, v in objects.items() if k.startswith(prefix)}


def _optimizer(bundle: Bundle, tensors: dict, objects: dict, params: list[str], where: dict, sixteen: bool,
               ckpt: str) -> dict | None:
    """The optimizer's tensors into `bundle` under this trainer's names; its common entry (None: none saved)."""
    prefix = names.optimizer_prefix(sixteen)
    groups_saved = []
    while f"{prefix}param_groups.{len(groups_saved)}.params" in objects:
        groups_saved.append(_fields(objects, f"{prefix}param_groups.{len(groups_saved)}."))
    if not groups_saved:
        return None
    shapes = {p: tuple(tensors[names.MODEL + p].shape) for p in params}
    groups = names.param_groups(params, shapes, [g["wd_mult"] != 0 for g in groups_saved])
    state: dict[str, dict] = {}
    steps = set()
    for g, (members, saved) in enumerate(zip(groups, groups_saved)):
        if len(members) != len(saved["params"]):
            raise TorchDcpError(f"optimizer group {g} holds {len(saved['params'])} parameters, megatron-core's "
                                f"default grouping of the model gives it {len(members)}")
        for j, (param, pid) in enumerate(zip(members, saved["params"])):
            key, index = where[param]
            found = {kind: tensors.get(f"{prefix}state.{pid}.{kind}") for kind in names.ADAM}
            if sixteen:
                found["fp32_param"] = tensors.get(f"{names.MAIN_PARAMS}{g}.{j}")
            for kind, t in found.items():
                if t is None:
                    raise TorchDcpError(f"optimizer state {kind} of parameter {pid} ({param}) is missing")
                if tuple(t.shape) != shapes[param]:
                    raise TorchDcpError(f"optimizer state {kind} of parameter {pid} has shape {tuple(t.shape)}, "
                                        f"its parameter {param} {shapes[param]}")
                state.setdefault(f"optimizer.state.{kind}.{key}", {})[index] = t
            step = tensors.get(f"{prefix}state.{pid}.step")
            if step is not None:
                steps.add(float(step))
    if len(steps) > 1:
        raise TorchDcpError(f"the optimizer's step differs between parameters ({sorted(steps)})")
    bundle.tensors.update(stack_layers(state, ckpt))
    inner = {"state": {"common_step": steps.pop()} if steps else {},
             "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in groups_saved]}
    return {"optimizer": inner} if sixteen else inner


def _rng(bundle: Bundle, objects: dict, tensors: dict, dp: int) -> None:
    """Upstream's one RNG state (`rng_state.0`), which its load gives every rank, as this trainer's per-rank
    objects of a (1, 1, dp) grid; none when the checkpoint holds none."""
    prefix = f"{RNG}.0."
    fields = {**_fields(objects, prefix), **{k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}}
    if not fields:
        return
    state = names.rng_state(fields)
    for d in range(dp):
        bundle.objects[(RNG, (0, 0, d))] = [state]
    bundle.object_shapes[RNG] = (1, 1, dp)


# ----- writing -----

def _module_order(bundle: Bundle, keys: list[str], keys_map: dict) -> list[tuple[str, str, tuple]]:
    """(module name, sharded key, layer (and expert) index) of every model tensor in the module's parameter order:
    the keys before the first layer key, each layer's keys in turn (its experts', SequentialMLP's, expert by
    expert where the first of them stands), then the keys after (megatron-core's sharded state dict lists a model's
    keys in module order)."""
    stacked = [k for k in keys if stacked_lead(k, tuple(bundle.tensors[k].shape))]
    experts = [k for k in stacked if k.startswith(names.LAYERS + names.EXPERTS)]
    for k in stacked:
        if not k.startswith(names.LAYERS) or (k not in experts and stacked_lead(k, tuple(bundle.tensors[k].shape))
                                              != 1):
            raise ConvertError(f"{k!r}: torch_dcp is written for GPT models whose stacked tensors are the decoder's "
                               "layers and SequentialMLP's experts; this tensor is stacked over another block")
    first = keys.index(stacked[0]) if stacked else len(keys)
    pre = [k for k in keys[:first] if k not in stacked]
    post = [k for k in keys[first:] if k not in stacked]
    layers = {bundle.tensors[k].shape[0] for k in stacked}
    counts = {bundle.tensors[k].shape[1] for k in experts}
    if len(layers) > 1 or len(counts) > 1:
        raise ConvertError(f"the stacked tensors disagree on the number of layers ({sorted(layers)}) or experts "
                           f"({sorted(counts)})")
    n_experts = counts.pop() if counts else 0
    out = [(k, k, ()) for k in pre]
    for i in range(layers.pop() if layers else 0):
        for k in stacked:
            if k not in experts:
                out.append((names.to_module(k, (i,), keys_map), k, (i,)))
            elif k == experts[0]:
                out += [(names.to_module(x, (i, e), keys_map), x, (i, e)) for e in range(n_experts)
                        for x in experts]
    return out + [(k, k, ()) for k in post]


def _piece(tensor: torch.Tensor, index: tuple) -> Pieces:
    return Pieces(tuple(tensor.shape[len(index):]), tensor.dtype, 0, lambda _: tensor[index] if index else tensor)


def write_torch_dcp(bundle: Bundle, output: str, module_ordered: bool = True) -> str:
    """`bundle` (a checkpoint of a GPT model, read) as upstream's torch_dcp at `output`. `module_ordered`:
    the bundle's keys follow the module's parameter order (a datastates or torch_dcp source), which the optimizer's
    parameter ids need; a source that does not record it is written without an optimizer or not at all."""
    if "optimizer" in bundle.common and not module_ordered:
        raise ConvertError(f"{bundle.source!r} holds optimizer state, whose torch_dcp parameter ids follow the "
                           "model's parameter order, which this format does not record: pass --exclude-prefix "
                           "optimizer. to write the model alone, or convert to datastates with the trainer "
                           "(--load IN --save OUT --save-after-load) first")
    out, _ = resolve_output(output, bundle.iteration)
    keys_map = names.layer_keys_map()
    common = bundle.common
    args = common.get("args")
    if args is None:
        raise ConvertError(f"{bundle.source!r} holds no args: upstream's loader needs them")
    model_keys = [k for k in bundle.tensors if not k.startswith("optimizer.") and "|" not in k]
    order = _module_order(bundle, model_keys, keys_map)
    tensors = {names.MODEL + m: _piece(bundle.tensors[k], i) for m, k, i in order}
    objects = {"args": args, "iteration": bundle.iteration,
               "checkpoint_version": common.get("checkpoint_version", 3.0),
               "num_floating_point_operations_so_far": 0}
    for (key, offset), value in bundle.objects.items():
        if key.endswith(STACKED_OBJECT):
            objects[names.MODEL + names.to_module(key, offset, keys_map)] = value
    if "output_layer.weight" in bundle.tensors:  # megatron-core's output layer keeps a (None) extra state too
        objects[names.MODEL + "output_layer" + STACKED_OBJECT] = None
    for k, v in (common.get("opt_param_scheduler") or {}).items():
        objects[f"opt_param_scheduler.{k}"] = v
    if "optimizer" in common:
        try:
            _write_optimizer(bundle, args, order, tensors, objects)
        except TorchDcpError as e:
            raise ConvertError(f"{bundle.source!r}: {e}") from None
    _write_rng(bundle, tensors, objects)
    root = SaveRoot(storage_for(out), os.path.dirname(os.path.abspath(out)), marker=DCP_METADATA)
    paths = {k: names.nested_path(k) for k in (*tensors, *objects)}
    try:
        publish_dcp(root, out, PiecePlanner(tensors, objects, listed=False, paths=paths), "torch_dcp")
    finally:
        root.storage.close()
    return out


def _write_optimizer(bundle: Bundle, args, order: list, tensors: dict, objects: dict) -> None:
    sixteen = bool(getattr(args, "bf16", False) or getattr(args, "fp16", False))
    if getattr(args, "use_distributed_optimizer", False):
        raise ConvertError(f"{bundle.source!r} holds the distributed optimizer's state; upstream's torch_dcp holds "
                           "a non-distributed one (an FSDP2 run's): convert an FSDP2 or DDP run's checkpoint, pass it "
                           "through the trainer with --use-torch-fsdp2 --save-after-load first, or write the model "
                           "alone with --exclude-prefix optimizer.")
    saved = bundle.common["optimizer"]
    inner = saved["optimizer"] if sixteen else saved
    prefix = names.optimizer_prefix(sixteen)
    shapes = {m: tuple(bundle.tensors[k].shape[len(i):]) for m, k, i in order}
    where = {m: (k, i) for m, k, i in order}
    groups = names.param_groups([m for m, _, _ in order], shapes,
                                [g["wd_mult"] != 0 for g in inner["param_groups"]])
    step = (inner.get("state") or {}).get("common_step")
    pid = 0
    for g, (members, hyper) in enumerate(zip(groups, inner["param_groups"])):
        ids = list(range(pid, pid + len(members)))
        for k, v in hyper.items():
            objects[f"{prefix}param_groups.{g}.{k}"] = v
        objects[f"{prefix}param_groups.{g}.params"] = ids
        for j, (param, i) in enumerate(zip(members, ids)):
            key, index = where[param]
            kinds = [(kind, f"{prefix}state.{i}.{kind}") for kind in names.ADAM]
            if sixteen:
                kinds.append(("fp32_param", f"{names.MAIN_PARAMS}{g}.{j}"))
            for kind, name in kinds:
                source = bundle.tensors.get(f"optimizer.state.{kind}.{key}")
                if source is None:
                    raise ConvertError(f"{bundle.source!r} has no optimizer.state.{kind}.{key}")
                tensors[name] = _piece(source, index)
            if step is not None:
                tensors[f"{prefix}state.{i}.step"] = Pieces.whole(torch.tensor(float(step)))
        pid += len(members)


def _write_rng(bundle: Bundle, tensors: dict, objects: dict) -> None:
    """Rank 0's RNG state as upstream's one `rng_state.0` (what its load gives every rank)."""
    first = bundle.objects.get((RNG, (0, 0, 0)))
    if not first:
        return
    fields, raw = names.rng_fields(first[0])
    objects.update({f"{RNG}.0.{k}": v for k, v in fields.items()})
    tensors.update({f"{RNG}.0.{k}": Pieces.whole(t) for k, t in raw.items()})
