"""Deltas between published weight versions: the elements that changed from one version to the next, so that a
reader holding an older version reaches the newest by reading only those, exactly to the bit.

    root/deltas/iter_0000007.safetensors    from the version before (its metadata's `from`) to 7: for each tensor
                                            that changed, `<name>:index` (flat positions, int32 or int64) and
                                            `<name>:value` (the new elements, in the tensor's dtype), or
                                            `<name>:full` where naming the changes would take as many bytes

Elements are compared by their bits (a NaN or a -0.0 that changed is a change). A delta is written under a
temporary name and renamed, so a reader never sees half of one; deltas outlive the versions they join (their own
retention), and a reader whose chain is broken is told to load the full version.
"""
from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..paths import checkpoint_name

DELTAS = "deltas"
INDEX = "model.safetensors.index.json"
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def delta_path(root: str, iteration: int) -> str:
    return os.path.join(root, DELTAS, checkpoint_name(iteration) + ".safetensors")


def tensors_of(version_dir: str):
    """(name, tensor) of a version's files, file by file (each tensor a copy of its own)."""
    with open(os.path.join(version_dir, INDEX)) as f:
        files = sorted(set(json.load(f)["weight_map"].values()))
    for file in files:
        with safe_open(os.path.join(version_dir, file), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def changes(old: torch.Tensor, new: torch.Tensor) -> dict:
    """What a delta holds of `new` against `old`: {} when no bit changed; the flat positions and new values of
    the elements whose bits differ (`index`, `value`); or the whole tensor (`full`) when naming them would take
    as many bytes."""
    bits = _BITS[new.element_size()]
    flat_new = new.reshape(-1)
    changed = old.reshape(-1).view(bits) != flat_new.view(bits)
    count = int(changed.sum())
    index_size = 4 if new.numel() < 2**31 else 8
    if count * (index_size + new.element_size()) >= new.numel() * new.element_size():
        return {"full": new}
    if not count:
        return {}
    where = torch.nonzero(changed).reshape(-1)
    return {"index": where.to(torch.int32 if index_size == 4 else torch.int64), "value": flat_new[where]}


def write_delta(root: str, previous: int, iteration: int) -> int:
    """The delta from version `previous` to `iteration` (both published under `root`), written whole; its bytes."""
    old = dict(tensors_of(os.path.join(root, checkpoint_name(previous))))
    out = {}
    for name, tensor in tensors_of(os.path.join(root, checkpoint_name(iteration))):
        before = old.get(name)
        if before is None or before.shape != tensor.shape or before.dtype != tensor.dtype:
            raise ValueError(f"{name!r} is not the same tensor in versions {previous} and {iteration}: no delta")
        out.update({f"{name}:{part}": t for part, t in changes(before, tensor).items()})
    path = delta_path(root, iteration)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    save_file(out, path + ".tmp", metadata={"from": str(previous)})
    os.replace(path + ".tmp", path)
    return os.path.getsize(path)


class BrokenChain(LookupError):
    """No chain of deltas leads from the version held to the newest (one was retired, or never written)."""

    def __init__(self, message: str, newest: int):
        super().__init__(message)
        self.newest = newest


def chain(stack: contextlib.ExitStack, root: str, held: int, newest: int, limit: int | None = None) -> list:
    """The deltas from version `held` to `newest`, oldest first, each open in `stack` (readable until it closes,
    even if retired meanwhile); BrokenChain where one is missing or their files take `limit` bytes or more."""
    files, at, size = [], newest, 0
    while at != held:
        try:
            f = stack.enter_context(safe_open(delta_path(root, at), framework="pt"))
            size += os.path.getsize(delta_path(root, at))
        except FileNotFoundError:
            raise BrokenChain(f"no delta to version {at} under {root}", newest) from None
        if limit is not None and size >= limit:
            raise BrokenChain(f"the deltas from version {held} to {newest} under {root} take more bytes than "
                              f"the full version", newest)
        files.append(f)
        at = int(f.metadata()["from"])
        if at < held:
            raise BrokenChain(f"the deltas under {root} pass from {at} over version {held}", newest)
    return files[::-1]


def changes_in(f) -> Iterator[tuple[str, dict]]:
    """(name, its change: {"full": tensor} or {"index": ..., "value": ...}) of each tensor an open delta changes."""
    for key in f.keys():
        name, _, part = key.rpartition(":")
        if part == "full":
            yield name, {"full": f.get_tensor(key)}
        elif part == "index":
            yield name, {"index": f.get_tensor(key), "value": f.get_tensor(f"{name}:value")}


def apply(tensor: torch.Tensor, change: dict) -> None:
    """Apply one tensor's `change` (`changes_in`'s) to `tensor` in place."""
    target = tensor.data.view(-1)
    if "full" in change:
        target.copy_(change["full"].reshape(-1))
    else:
        target[change["index"].long()] = change["value"].to(target.dtype)


def change_bytes(change: dict) -> int:
    """What one tensor's change takes (a reader moves these bytes)."""
    return sum(t.numel() * t.element_size() for t in change.values())


def retire_deltas(root: str, keep: int) -> None:
    """Remove all but the deltas to the newest `keep` versions (a reader that has one open still reads it)."""
    try:
        names = os.listdir(os.path.join(root, DELTAS))
    except FileNotFoundError:
        return
    done = sorted(n for n in names if n.endswith(".safetensors"))
    left = [n for n in names if n.endswith(".tmp")]  # a delta's write that a killed trainer left (one writer)
    for name in left + (done[:-keep] if keep else done):
        os.remove(os.path.join(root, DELTAS, name))
