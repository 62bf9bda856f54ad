"""A whole checkpoint in memory, format-neutral, and reading one from datastates with the engine's reader.

The input is audited first (`datastates.audit`: published, every rank's files, every global tensor covered) and
refused with every problem listed. Its global tensors are then read whole through the engine's reader, which
assembles each from every rank's shards and verifies every chunk's crc32c; the reads collect every damaged
chunk rather than stop at the first, so a refusal names them all.
"""
from __future__ import annotations

import re

import torch

from datastates import Audit, CheckpointError, CheckpointReader, Problems, audit_checkpoint
from datastates import format as fmt
from datastates.audit import NotACheckpointError
from datastates.providers import (ContainerProvider, ItemRef, ObjectProvider, ProviderRegistry, StateProvider,
                                  TensorProvider)
from datastates.schema import dtype_from_name

from .paths import ConvertError, resolve_input
from .text import progress

OBJ_NAME_RE = re.compile(r"^(?P<key>.+)@(?P<offset>\d+(?:,\d+)*)$")
COMMON_PREFIX = "common:"


class Bundle:
    """A whole checkpoint in memory, format-neutral."""

    def __init__(self, source: str, iteration):
        self.source = source
        self.iteration = iteration
        self.tensors: dict[str, torch.Tensor] = {}  # sharded key -> full (unsharded) tensor
        self.objects: dict[tuple, object] = {}  # (key, grid offset) -> value
        self.object_shapes: dict[str, tuple] = {}  # key -> grid shape
        self.common: dict = {}


class _Whole:
    def __init__(self, name, tensor):
        self.name, self.tensor = name, tensor


class _GlobalObject:
    def __init__(self, name):
        self.name = name


class _WholeProvider(StateProvider):
    """Asks the engine's reader for a whole logical tensor (global offset 0) or a named global object."""

    def accepts(self, value):
        return isinstance(value, (_Whole, _GlobalObject))

    def flatten(self, value, path, ctx):
        if isinstance(value, _GlobalObject):
            return ctx.add_object(path, None, scope="global", name=value.name)
        t = value.tensor
        return ctx.add_tensor(path, t, scope="global", name=value.name, global_shape=tuple(t.shape),
                              global_offset=(0,) * t.dim())


def _audited(ckpt: str) -> Audit:
    """The input's audit; ConvertError listing every problem if any."""
    try:
        found = audit_checkpoint(ckpt)
    except NotACheckpointError as e:
        raise ConvertError(str(e)) from None
    if found.problems:
        raise ConvertError(f"input checkpoint {ckpt!r} is unusable:\n{found.problems.summary()}")
    return found


def read_datastates(path: str, iteration: int | None, threads: int = 4) -> Bundle:
    ckpt = resolve_input(path, iteration, "datastates")
    found = _audited(ckpt)
    tensors, objects = found.global_tensors(), found.objects()
    bundle = Bundle(ckpt, found.index.iteration)
    registry = ProviderRegistry([_WholeProvider(), ContainerProvider(), TensorProvider(), ObjectProvider()])
    problems = Problems()
    try:
        with CheckpointReader.open(ckpt, threads=threads, staging_bytes=1 << 30, registry=registry) as reader:
            bundle.tensors = _read_tensors(reader, tensors, problems, ckpt)
            globals_ = reader.load(0, {name: _GlobalObject(name) for name in objects["global"]}, problems)
            own = reader.items(0)
            skeleton = reader.read_item(0, own[fmt.SKELETON_ID])
            local_values = {it.id: reader.read_item(0, it) for it in own.values()
                            if it.scope == "local" and it.id != fmt.SKELETON_ID}
    except CheckpointError as e:
        raise ConvertError(f"reading {ckpt!r} failed: {e}") from None
    if problems:
        raise ConvertError(f"input checkpoint {ckpt!r} is damaged ({len(problems)} problem(s), nothing "
                           f"written):\n{problems.summary()}")
    _add_objects(bundle, globals_)
    bundle.common = _common_state(ckpt, skeleton, own, globals_, local_values)
    return bundle


def _read_tensors(reader: CheckpointReader, tensors: dict, problems: Problems, ckpt: str) -> dict:
    """Every global tensor whole, one load each (for the progress bar); damaged reads go to `problems`."""
    out = {}
    bar = progress(sum(_nbytes(t) for t in tensors.values()), f"read {ckpt}")
    try:
        for name, t in tensors.items():
            whole = _Whole(name, torch.empty(t["global_shape"], dtype=dtype_from_name(t["dtype"])))
            out[name] = reader.load(0, {name: whole}, problems)[name]
            bar.update(_nbytes(t))
    finally:
        bar.close()
    return out


def _nbytes(t: dict) -> int:
    n = dtype_from_name(t["dtype"]).itemsize
    for s in t["global_shape"]:
        n *= s
    return n


def _add_objects(bundle: Bundle, globals_: dict) -> None:
    """Global objects `key@o1,o2` (megatron-core ShardedObjects) by key and grid offset, and each key's grid."""
    for name, value in globals_.items():
        if name.startswith(COMMON_PREFIX):
            continue
        m = OBJ_NAME_RE.match(name)
        key, offset = (m.group("key"), tuple(int(x) for x in m.group("offset").split(","))) if m else (name, (0,))
        bundle.objects[(key, offset)] = value
    for key in {k for k, _ in bundle.objects}:
        offs = [o for k, o in bundle.objects if k == key]
        bundle.object_shapes[key] = tuple(max(o[d] for o in offs) + 1 for d in range(len(offs[0])))


def _common_state(ckpt: str, skeleton, own: dict, globals_: dict, local_values: dict) -> dict:
    """Rank 0's state skeleton with its common objects and rank-local items filled in, sharded items dropped."""
    drop = object()

    def kept(v, r) -> bool:
        """A value of the common state: not a sharded item, nor a container that held only sharded items."""
        return r is not drop and not (_container(v) and _container(r) and not r)

    def resolve(node):
        if isinstance(node, ItemRef):
            it = own.get(node.id)
            if it is None:
                raise ConvertError(f"{ckpt!r}: the state skeleton of rank 0 refers to item {node.id!r}, which its "
                                   f"manifest lacks")
            if it.scope == "global":
                return globals_[it.name] if it.kind == "object" and it.name.startswith(COMMON_PREFIX) else drop
            return local_values[it.id]
        if isinstance(node, dict):
            out = type(node)() if type(node) is not dict else {}
            for k, v in node.items():
                r = resolve(v)
                if kept(v, r):
                    out[k] = r
            return out
        if isinstance(node, (list, tuple)):
            vals = [r for v, r in ((v, resolve(v)) for v in node) if kept(v, r)]
            if isinstance(node, list):
                return vals
            return type(node)(*vals) if hasattr(node, "_fields") else tuple(vals)
        return node

    common = resolve(skeleton)
    if not isinstance(common, dict):
        common = {"state": common}
    # drop the redundant `a/b` copies the datastates writer adds (see writers._common_paths)
    return {k: v for k, v in common.items()
            if not (isinstance(k, str) and "/" in k and k.split("/", 1)[0] in common)}


def _container(x) -> bool:
    return isinstance(x, (dict, list, tuple))
