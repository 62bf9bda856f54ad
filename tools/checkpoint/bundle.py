"""A whole checkpoint in memory, format-neutral, and reading one from datastates with the engine's reader.

The input is audited first (`datastates.audit`: published, every rank's files, every global tensor covered) and
refused with every problem listed. Its global tensors are then read whole through the engine's reader, which
assembles each from every rank's shards and verifies every chunk's crc32c; the reads collect every damaged
chunk rather than stop at the first, so a refusal names them all.
"""
from __future__ import annotations

import torch

from datastates import Audit, CheckpointError, CheckpointReader, NotACheckpointError, Problems, audit_checkpoint
from datastates.names import common_path, parse_shard_name

from .paths import ConvertError, resolve_input
from .text import progress


class Bundle:
    """A whole checkpoint in memory, format-neutral."""

    def __init__(self, source: str, iteration):
        self.source = source
        self.iteration = iteration
        self.tensors: dict[str, torch.Tensor] = {}  # sharded key -> full (unsharded) tensor
        self.objects: dict[tuple, object] = {}  # (key, grid offset) -> value
        self.object_shapes: dict[str, tuple] = {}  # key -> grid shape
        self.common: dict = {}

    def without(self, prefixes: list[str]) -> "Bundle":
        """This checkpoint less every tensor, object and common entry whose name starts with one of `prefixes`
        (a common entry `optimizer` is named `optimizer.` here)."""
        def kept(name: str) -> bool:
            return not any(name.startswith(p) for p in prefixes)
        out = Bundle(self.source, self.iteration)
        out.tensors = {k: v for k, v in self.tensors.items() if kept(k)}
        out.objects = {k: v for k, v in self.objects.items() if kept(k[0])}
        out.object_shapes = {k: v for k, v in self.object_shapes.items() if kept(k)}
        out.common = {k: v for k, v in self.common.items() if kept(f"{k}.")}
        return out


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
    bundle = Bundle(ckpt, found.index.iteration)
    problems = Problems()
    try:
        with CheckpointReader.open(ckpt, threads=threads, staging_bytes=1 << 30) as reader:
            bundle.tensors = _read_tensors(reader, problems, ckpt)
            globals_ = {name: reader.object(name, problems) for name in reader.objects()}
            common = reader.common(problems)
    except CheckpointError as e:
        raise ConvertError(f"reading {ckpt!r} failed: {e}") from None
    if problems:
        raise ConvertError(f"input checkpoint {ckpt!r} is damaged ({len(problems)} problem(s), nothing "
                           f"written):\n{problems.summary()}")
    _add_objects(bundle, globals_)
    bundle.common = _without_path_copies(common if isinstance(common, dict) else {"state": common})
    return bundle


def _read_tensors(reader: CheckpointReader, problems: Problems, ckpt: str) -> dict:
    """Every global tensor whole, one read each (for the progress bar); damaged reads go to `problems`."""
    tensors = reader.tensors()
    out = {}
    bar = progress(sum(_nbytes(shape, dtype) for shape, dtype in tensors.values()), f"read {ckpt}")
    try:
        for name, (shape, dtype) in tensors.items():
            out[name] = reader.tensor(name, problems=problems)
            bar.update(_nbytes(shape, dtype))
    finally:
        bar.close()
    return out


def _nbytes(shape: tuple, dtype: torch.dtype) -> int:
    n = dtype.itemsize
    for s in shape:
        n *= s
    return n


def _add_objects(bundle: Bundle, globals_: dict) -> None:
    """Global objects `key@o1,o2` (megatron-core ShardedObjects) by key and grid offset, and each key's grid."""
    for name, value in globals_.items():
        if common_path(name) is not None:
            continue
        bundle.objects[parse_shard_name(name) or (name, (0,))] = value
    for key in {k for k, _ in bundle.objects}:
        offs = [o for k, o in bundle.objects if k == key]
        bundle.object_shapes[key] = tuple(max(o[d] for o in offs) + 1 for d in range(len(offs[0])))


def _without_path_copies(common: dict) -> dict:
    """The common state less the redundant `a/b` copies the datastates writer adds (see writers._common_state)."""
    return {k: v for k, v in common.items()
            if not (isinstance(k, str) and "/" in k and k.split("/", 1)[0] in common)}
