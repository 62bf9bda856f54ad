"""Kept bytes: a save's staged bytes of chosen tensors, kept past the save for a consumer that reads them later
(the trainer's Hugging Face export), so that it needs no second device-to-host copy and no read back from storage.

`CheckpointEngine.save(..., keep=...)` names the global tensors to keep; the flusher copies each chosen chunk out of
its staging slot (or the memory tier's pages), once the snapshot's copies into it landed and before the slot is
written or reused, into the save's own buffer (`Kept`). What all saves keep at once is bounded (`KeepBudget`, the
engine's staging budget): a save whose chosen tensors do not fit in what is left keeps nothing and says why. It
never waits for room: a save that waited would hold the fence.
"""
from __future__ import annotations

import threading

import torch

from .save_plan import align_up, aligned_empty
from .schema import Item, dtype_from_name



class KeepBudget:
    """The bytes every save's kept tensors may hold at once; taken without waiting, given back on release.

    The largest buffer given back since the last take waits for the next one (`idle`); a take reuses it when it is
    large enough and frees it otherwise, so what is held, in use or idle, never exceeds the budget."""

    def __init__(self, budget_bytes: int):
        self.budget_bytes = budget_bytes
        self.used = 0
        self.idle: torch.Tensor | None = None
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> torch.Tensor | None:
        """A block-aligned buffer of at least `nbytes`, counted whole, or None when they do not fit in what is
        left (the idle buffer then stays)."""
        if not nbytes:
            return aligned_empty(0)
        with self._lock:
            idle = self.idle
            if idle is not None and idle.numel() >= nbytes:  # used + idle never exceeds the budget
                self.idle, self.used = None, self.used + idle.numel()
                return idle
            if self.used + nbytes > self.budget_bytes:
                return None
            self.idle, self.used = None, self.used + nbytes
        del idle  # freed before the new buffer is allocated
        return aligned_empty(nbytes)

    def give(self, buffer: torch.Tensor) -> None:
        with self._lock:
            self.used -= buffer.numel()
            if buffer.numel() > (0 if self.idle is None else self.idle.numel()):
                self.idle = buffer


class Kept:
    """One save's kept tensors by item id, filled as the save stages them: complete once every chosen byte was
    taken (`wait_filled`), which is before the save is durable, as the flusher takes each chunk before writing it.

    `why` is None when every chosen tensor is kept, else why none is (the budget was short). The consumer reads
    `tensor(id)` (the item's dtype and local shape; the index names each rank's items) and calls `release`."""

    def __init__(self, items: list[Item], budget: KeepBudget):
        self._budget, self._views, self._items = budget, {}, {}
        total = sum(align_up(it.nbytes) for it in items)
        self.nbytes = 0
        self.why: str | None = None
        self._left = 0  # the chosen bytes not yet taken
        self._settled = threading.Event()  # every chosen byte taken, or the bytes given back first
        self._lock = threading.Lock()  # a release waits for a take under way: the buffer may be the next save's
        self._buffer = budget.take(total)
        if self._buffer is None:
            self.why = (f"its {total / 2**20:.1f} MiB of tensors to keep do not fit in the "
                        f"{(budget.budget_bytes - budget.used) / 2**20:.1f} MiB left of the "
                        f"{budget.budget_bytes / 2**20:.1f} MiB staging budget")
            self._settled.set()
            return
        self._left = sum(it.nbytes for it in items)
        if not self._left:
            self._settled.set()
        self.nbytes = self._buffer.numel()
        offset = 0
        for it in items:
            self._views[it.id] = self._buffer[offset:offset + it.nbytes]
            self._items[it.id] = it
            offset += align_up(it.nbytes)

    def take(self, buffer: torch.Tensor, segments: list) -> None:
        """The flusher's hand-over: the chunks of chosen items among a slot's (offset, length, item, chunk index)
        segments, copied before the slot is written."""
        with self._lock:
            for start, n, item, index in segments:
                view = self._views.get(item.id)
                if view is not None:
                    at = index * (item.chunk_bytes or item.nbytes)
                    view[at:at + n].copy_(buffer[start:start + n])
                    self._left -= n
                    if not self._left:
                        self._settled.set()

    def wait_filled(self, timeout: float | None = None) -> bool:
        """Wait until every chosen byte is kept (True), or until the save ended or gave the bytes back before that,
        or nothing was kept (`why`) (False); False too on timeout."""
        self._settled.wait(timeout)
        return self.why is None and not self._left and bool(self._views or not self.nbytes)

    def save_ended(self) -> None:
        """The save is over (the engine's call): nothing more is taken, so a waiter for the rest wakes."""
        self._settled.set()

    def ids(self) -> list[str]:
        """The item ids kept (none once released, or when nothing fitted)."""
        return list(self._views)

    def items(self) -> list[Item]:
        """The items kept, as the save planned them (their names, dtypes and global boxes; none once released)."""
        return list(self._items.values())

    def tensor(self, item_id: str) -> torch.Tensor:
        """A kept item's bytes as its tensor (valid until `release`)."""
        it = self._items[item_id]
        return self._views[item_id].view(dtype_from_name(it.dtype)).reshape(it.shape)

    def release(self) -> None:
        """Give the bytes back to the budget (once; later calls do nothing)."""
        with self._lock:
            if self._buffer is not None:
                self._views, self._items = {}, {}
                self._budget.give(self._buffer)
                self._buffer = None
        self._settled.set()
