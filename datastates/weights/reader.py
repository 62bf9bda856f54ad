"""The rollout side's reader of published weight versions: the newest, a named one, or the next to come; each
version leased while it is read (`leases`), its tensors handed out under their Hugging Face names, as vLLM's and
SGLang's `load_weights` take them (or packed and sliced as one rank of the engine's tensor parallelism holds them:
`layouts`), or copied in place into a transformers model."""
from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator

import torch
from safetensors import safe_open

from ..paths import checkpoint_name, iteration_of
from .deltas import BrokenChain, apply, chain, change_bytes, changes_in
from .layouts import Experts, LayoutError, apply_change, places, plan, read
from .leases import lease

INDEX = "model.safetensors.index.json"  # written last into a version (datastates.hf.writer's)
POINTER = "latest"
POLL_S = 0.005  # how often `wait_next` reads the pointer


class WeightsError(Exception):
    """A version that cannot be read (gone, not there yet, or not this model's); the message says which and why."""


class Version:
    """One published version, leased until `close` (a `with` block): its files stay whole while it is open."""

    def __init__(self, path: str, iteration: int, fd: int):
        self.path, self.iteration, self._fd = path, iteration, fd
        with open(os.path.join(path, INDEX)) as f:
            self.weight_map: dict[str, str] = json.load(f)["weight_map"]
        with open(os.path.join(path, "config.json")) as f:
            self.config: dict = json.load(f)

    def shapes(self) -> dict[str, tuple]:
        """Every tensor's shape, from the files' headers."""
        out = {}
        for file in sorted(set(self.weight_map.values())):
            with safe_open(os.path.join(self.path, file), framework="pt") as f:
                out.update({name: tuple(f.get_slice(name).get_shape()) for name in f.keys()})
        return out

    @property
    def nbytes(self) -> int:
        """The bytes of its safetensors files (what a reader of the whole version reads)."""
        return sum(os.path.getsize(os.path.join(self.path, f)) for f in set(self.weight_map.values()))

    def tensors(self, packed: bool = False, tp_rank: int = 0, tp_size: int = 1, ep_rank: int = 0, ep_size: int = 1,
                ep_placement: str = "linear") -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) of every weight, each tensor a copy of its own, so it outlives the lease (what an engine's
        `load_weights(iterable)` takes): the Hugging Face tensors, file by file; or, `packed` and/or `tp_size` or
        `ep_size` > 1, what rank `tp_rank` (and expert-parallel rank `ep_rank`) of an engine with that parallelism
        holds (`layouts`: q/k/v fused as `qkv_proj`, gate/up as `gate_up_proj`, experts stacked; only the rows,
        columns or experts it holds read). WeightsError, before any tensor, for a family without that mapping or
        a tensor the ranks cannot share."""
        self._check_open()
        if packed or tp_size != 1 or ep_size != 1:
            yield from self._held(packed, tp_rank, tp_size, Experts(ep_rank, ep_size, ep_placement))
            return
        for file in sorted(set(self.weight_map.values())):
            with safe_open(os.path.join(self.path, file), framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)

    def _held(self, packed: bool, tp_rank: int, tp_size: int, experts: Experts) -> Iterator[tuple[str, torch.Tensor]]:
        """Every file open at once: the parts of a packed tensor may lie in different files."""
        with contextlib.ExitStack() as stack:
            files = {file: stack.enter_context(safe_open(os.path.join(self.path, file), framework="pt"))
                     for file in sorted(set(self.weight_map.values()))}
            slices = {name: files[file].get_slice(name) for name, file in self.weight_map.items()}
            try:
                held = plan(self.config, {n: tuple(s.get_shape()) for n, s in slices.items()}, packed, tp_rank,
                            tp_size, experts)
            except LayoutError as e:
                raise WeightsError(f"{self.path}: {e}") from None
            for h in held:
                yield h.name, read(h, slices.__getitem__)

    def load_into(self, model: torch.nn.Module) -> None:
        """Copy every weight in place into the transformers `model` (`load_into`)."""
        load_into(model, self.tensors(), self.path)

    def _check_open(self) -> None:
        if self._fd is None:
            raise WeightsError(f"{self.path}: read after close (the version may be freed once closed)")

    def close(self) -> None:
        """Give the lease back: the publisher may free the version from now on."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> Version:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        self.close()


def load_into(model: torch.nn.Module, pairs, where: str) -> None:
    """Copy every (name, tensor) of `pairs` (a version's, read from `where`) in place into the transformers `model`
    (its parameters keep their storage and dtype); every parameter must be in the version, and every weight a
    parameter of the model."""
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: set[int] = set()
    with torch.no_grad():
        for name, tensor in pairs:
            param = params.get(name)
            if param is None:
                raise WeightsError(f"{where}: {name!r} is no parameter of the {type(model).__name__} model")
            if param.shape != tensor.shape:
                raise WeightsError(f"{where}: {name!r} is {tuple(tensor.shape)} in the version, "
                                   f"{tuple(param.shape)} in the model")
            param.copy_(tensor)
            loaded.add(id(param))
    missing = sorted(n for n, p in params.items() if id(p) not in loaded)  # a tied weight is loaded once
    if missing:
        raise WeightsError(f"{where}: the version has no tensor for the model's {', '.join(missing)}")


class WeightsReader:
    """The versions published under `root` (`--publish-weights-dir`): `newest`, `open(iteration)`, `wait_next`."""

    def __init__(self, root: str):
        self.root = root

    def pointed(self) -> int | None:
        """The iteration of the newest whole version (None: none yet)."""
        try:
            with open(os.path.join(self.root, POINTER)) as f:
                return iteration_of(f.read().strip())
        except FileNotFoundError:
            return None

    def published(self) -> list[int]:
        """The iterations of the versions there now, oldest first (whole ones: their index is there)."""
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return []
        its = (iteration_of(n) for n in names)
        return sorted(i for i in its if i is not None and
                      os.path.exists(os.path.join(self.root, checkpoint_name(i), INDEX)))

    def open(self, iteration: int) -> Version:
        """The version of `iteration`, leased; WeightsError when it is not held (retired, or not published)."""
        version = self._try(iteration)
        if version is None:
            held = self.published()
            raise WeightsError(f"version {iteration} under {self.root} is not held: "
                               + (f"it was retired (the versions held now: {held})" if held and iteration < held[-1]
                                  else f"it is not published (the versions held now: {held or 'none'})"))
        return version

    def newest(self) -> Version | None:
        """The newest version, leased (None: none published yet). One retired between reading the pointer and
        taking the lease is passed over for the one the pointer names then."""
        while True:
            iteration = self.pointed()
            if iteration is None:
                return None
            version = self._try(iteration)
            if version is not None:
                return version
            if self.pointed() == iteration:  # the trainer never retires the version `latest` names
                raise WeightsError(f"{self.root}/{POINTER} names version {iteration}, which is not there")

    def wait_next(self, after: int | None, timeout_s: float = 60.0) -> Version:
        """The newest version once it is newer than `after` (None: any), leased; WeightsError after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while True:
            iteration = self.pointed()
            if iteration is not None and (after is None or iteration > after):
                version = self._try(iteration)
                if version is not None:
                    return version
            if time.monotonic() > deadline:
                raise WeightsError(f"no version newer than {after} under {self.root} within {timeout_s} s (the "
                                   f"newest is {iteration})")
            time.sleep(POLL_S)

    def catch_up(self, tensors: dict, held: int, packed: bool = False, tp_rank: int = 0, tp_size: int = 1,
                 ep_rank: int = 0, ep_size: int = 1, ep_placement: str = "linear") -> tuple[int, int]:
        """Bring `tensors` (this reader's own copy of version `held`, e.g. `dict(model.named_parameters())`) to
        the newest version in place, reading only the elements that changed (the trainer's deltas,
        --publish-weights-deltas): (the newest iteration, the bytes read). With the layout options of
        `Version.tensors`, `tensors` are what they hand out (a rank's packed slices, its experts): each takes the
        changes inside it. WeightsError, the tensors untouched, when no chain of deltas leads there, or only one
        larger than the full version: load that instead."""
        with contextlib.ExitStack() as stack:
            try:
                newest, files = self.deltas(stack, held)
            except BrokenChain as e:
                raise WeightsError(f"{e}: version {held} cannot be brought to {e.newest} by deltas; load the "
                                   f"full version") from None
            changed = {key.rpartition(":")[0] for f in files for key in f.keys()}
            if packed or tp_size != 1 or ep_size != 1:
                where, shapes = self._held_places(stack, newest, packed, tp_rank, tp_size,
                                                  Experts(ep_rank, ep_size, ep_placement))
                needed = {p.held for n in changed for p in where.get(n, ())}

                def apply_one(name: str, change: dict) -> None:
                    apply_change(tensors, where.get(name, []), shapes[name], change)
            else:
                needed = changed

                def apply_one(name: str, change: dict) -> None:
                    apply(tensors[name], change)
            lacking = sorted(needed - set(tensors))
            if lacking:  # every name checked before any tensor changes
                raise WeightsError(f"the deltas under {self.root} change {lacking[0]!r}, which the tensors given "
                                   "lack")
            done = 0
            for f in files:
                for name, change in changes_in(f):
                    apply_one(name, change)
                    done += change_bytes(change)
            return newest, done

    def _held_places(self, stack: contextlib.ExitStack, newest: int, packed: bool, tp_rank: int, tp_size: int,
                     experts: Experts) -> tuple[dict, dict]:
        """(where each Hugging Face tensor lies in what the rank holds, the tensors' shapes), from version
        `newest`'s config and headers."""
        version = stack.enter_context(self.open(newest))
        shapes = version.shapes()
        try:
            return places(plan(version.config, shapes, packed, tp_rank, tp_size, experts), shapes), shapes
        except LayoutError as e:
            raise WeightsError(f"{version.path}: {e}") from None

    def deltas(self, stack: contextlib.ExitStack, held: int) -> tuple[int, list]:
        """(the newest iteration, the deltas from version `held` to it, oldest first, open in `stack`; none when
        `held` is the newest); BrokenChain when none lead there, or only some larger than the full version."""
        newest = self.pointed()
        if newest is None or newest <= held:
            return held, []
        try:  # never more bytes than the full version (its index's total; no bound once it is retired)
            with open(os.path.join(self.root, checkpoint_name(newest), INDEX)) as f:
                limit = json.load(f)["metadata"]["total_size"]
        except FileNotFoundError:
            limit = None
        return newest, chain(stack, self.root, held, newest, limit)

    def _try(self, iteration: int) -> Version | None:
        path = os.path.join(self.root, checkpoint_name(iteration))
        fd = lease(path)
        if fd is None:
            return None
        if not os.path.exists(os.path.join(path, INDEX)):  # not a version (no index): never one the trainer names
            os.close(fd)
            return None
        return Version(path, iteration, fd)
