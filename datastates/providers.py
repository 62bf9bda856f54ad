"""State providers: turn a nested training state into a skeleton plus flat items.

Each kind of state has one provider. The container provider walks dicts, lists, tuples (named too) and
OrderedDicts and delegates every child back to the registry, so providers compose: supporting a new kind of
state (megatron-core's ShardedTensor, see datastates/megatron.py) is one `register_provider` call; the package
registers torch's DTensors and `GlobalState` into the default registry (datastates/dtensors.py). Leaves
become `ItemRef`s in the skeleton; the skeleton is saved as a pickled object and, on load, rebuilt with the
loaded values (`unflatten`).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable, Iterator

import torch

from .save_plan import Entry
from .schema import Item, Kind, Scope, dtype_name


class ItemRef:
    """Placeholder for a leaf in the skeleton."""

    __slots__ = ("id",)

    def __init__(self, id: str):
        self.id = id

    def __reduce__(self):
        return (ItemRef, (self.id,))

    def rebuilt(self, value: Any) -> Any:
        """The leaf a load returns for the `value` loaded into this item (a provider's own ref may wrap it)."""
        return value

    def __repr__(self):
        return f"ItemRef({self.id!r})"


class FlattenContext:
    """Collects the entries of one walk; providers call `flatten` for children and `add_*` for leaves."""

    def __init__(self, registry: "ProviderRegistry"):
        self.registry = registry
        self.entries: list[Entry] = []
        self._ids: set[str] = set()
        self._seen_tensors: dict[int, tuple[torch.Tensor, ItemRef]] = {}
        self.batches: dict[Callable[[list], None], list] = {}

    def batch(self, finish: Callable[[list], None]) -> list:
        """The list a provider puts this walk's leaves in when they are completed together: `finish(list)` runs
        once the whole walk is done, before its entries are used (uneven DTensors learn their boxes in one
        collective)."""
        return self.batches.setdefault(finish, [])

    def flatten(self, value: Any, path: str) -> Any:
        return self.registry.find(value, path).flatten(value, path, self)

    def _unique(self, key: str) -> str:
        if key in self._ids:
            n = 1
            while f"{key}~{n}" in self._ids:
                n += 1
            key = f"{key}~{n}"
        self._ids.add(key)
        return key

    def add_tensor(self, key: str, tensor: torch.Tensor, *, scope: Scope = Scope.LOCAL, name: str | None = None,
                   global_shape: tuple | None = None, global_offset: tuple | None = None,
                   write: bool = True) -> ItemRef:
        """Add a tensor leaf. The same tensor object reached twice (tied weights) is stored once."""
        if tensor.is_sparse or tensor.is_quantized or tensor.layout != torch.strided:
            raise TypeError(f"cannot checkpoint {tensor.layout} tensor at {key!r}: only dense tensors are supported")
        original = tensor
        if scope == Scope.LOCAL and id(original) in self._seen_tensors:
            return self._seen_tensors[id(original)][1]
        item = Item(id=self._unique(key), kind=Kind.TENSOR, scope=scope, name=name, dtype=dtype_name(tensor.dtype),
                    shape=tuple(tensor.shape), global_shape=global_shape, global_offset=global_offset,
                    write=write, nbytes=tensor.numel() * tensor.element_size())
        self.entries.append(Entry(item, tensor))
        ref = ItemRef(item.id)
        if scope == Scope.LOCAL:  # keep `original` alive so its id cannot be reused during the walk
            self._seen_tensors[id(original)] = (original, ref)
        return ref

    def add_object(self, key: str, obj: Any, *, scope: Scope = Scope.LOCAL, name: str | None = None,
                   write: bool = True) -> ItemRef:
        item = Item(id=self._unique(key), kind=Kind.OBJECT, scope=scope, name=name, write=write)
        self.entries.append(Entry(item, obj))
        return ItemRef(item.id)


class StateProvider:
    """One kind of state. `accepts` says whether a value is of this kind; `flatten` returns its skeleton."""

    def accepts(self, value: Any) -> bool:
        raise NotImplementedError

    def flatten(self, value: Any, path: str, ctx: FlattenContext) -> Any:
        raise NotImplementedError


def child_path(path: str, key: Any) -> str:
    part = key if isinstance(key, str) else repr(key)
    return f"{path}/{part}" if path else part


class ContainerProvider(StateProvider):
    """dict, OrderedDict, list, tuple and namedtuple: delegates each child to the registry."""

    def accepts(self, value):
        return isinstance(value, (dict, list, tuple))

    def flatten(self, value, path, ctx):
        if isinstance(value, dict):
            out = OrderedDict() if isinstance(value, OrderedDict) else {}
            for k, v in value.items():
                out[k] = ctx.flatten(v, child_path(path, k))
            return out if type(value) in (dict, OrderedDict) else _rebuild_mapping(value, out)
        children = [ctx.flatten(v, child_path(path, i)) for i, v in enumerate(value)]
        if isinstance(value, list):
            return children
        if hasattr(value, "_fields"):  # namedtuple
            return type(value)(*children)
        return tuple(children)


def _rebuild_mapping(original: dict, children: dict) -> dict:
    try:
        out = type(original)()
        out.update(children)
        return out
    except TypeError:
        return dict(children)


class TensorProvider(StateProvider):
    """Dense tensors of any dtype and device, views included (saved as their logical contents)."""

    def accepts(self, value):
        return isinstance(value, torch.Tensor)

    def flatten(self, value, path, ctx):
        return ctx.add_tensor(path, value)


class ObjectProvider(StateProvider):
    """Anything else is pickled (args namespaces, RNG states, counters). Always last in the registry."""

    def accepts(self, value):
        return True

    def flatten(self, value, path, ctx):
        return ctx.add_object(path, value)


class ProviderRegistry:
    def __init__(self, providers: list[StateProvider]):
        self.providers = list(providers)

    def register(self, provider: StateProvider, first: bool = True) -> None:
        """Add a provider; `first` puts it before the built-in ones so it can claim values they would take."""
        if first:
            self.providers.insert(0, provider)
        else:
            self.providers.insert(len(self.providers) - 1, provider)

    def find(self, value: Any, path: str) -> StateProvider:
        for p in self.providers:
            if p.accepts(value):
                return p
        raise TypeError(f"no state provider accepts {type(value).__name__} at {path!r}")

    def flatten(self, state: Any) -> tuple[Any, list[Entry]]:
        ctx = FlattenContext(self)
        skeleton = ctx.flatten(state, "")
        for finish, leaves in ctx.batches.items():
            finish(leaves)
        return skeleton, ctx.entries


default_registry = ProviderRegistry([ContainerProvider(), TensorProvider(), ObjectProvider()])


def register_provider(provider: StateProvider, first: bool = True) -> None:
    default_registry.register(provider, first)


def item_ids(skeleton: Any) -> Iterator[Any]:
    """The id of every ItemRef in a skeleton: what `unflatten` will resolve."""
    if isinstance(skeleton, ItemRef):
        yield skeleton.id
    elif isinstance(skeleton, (dict, list, tuple)):
        for child in skeleton.values() if isinstance(skeleton, dict) else skeleton:
            yield from item_ids(child)


def unflatten(skeleton: Any, resolve: Callable[[str], Any]) -> Any:
    """Rebuild a state from its skeleton, replacing each ItemRef by `resolve(id)`."""
    if isinstance(skeleton, ItemRef):
        return skeleton.rebuilt(resolve(skeleton.id))
    if isinstance(skeleton, dict):
        out = {k: unflatten(v, resolve) for k, v in skeleton.items()}
        return _rebuild_mapping(skeleton, out) if type(skeleton) is not dict else out
    if isinstance(skeleton, list):
        return [unflatten(v, resolve) for v in skeleton]
    if isinstance(skeleton, tuple):
        children = [unflatten(v, resolve) for v in skeleton]
        return type(skeleton)(*children) if hasattr(skeleton, "_fields") else tuple(children)
    return skeleton
