"""A copy backend that lands every copy late and out of order, standing in for a GPU's side stream in tests of
the save direction (device state into slots) and of the load direction (slots into the target tensors); and a
native copy pool whose one thread is held, so that only a caller lent to its copies lands them."""
import contextlib
import ctypes
import random
import threading

import torch

from datastates import _native, aligned_empty
from datastates.copies import CopyBackend

POISON = 0xAB


class LateCopyBackend(CopyBackend):
    """Lands every copy late, in random order, on a thread of its own; poisons the destination until then."""

    def __init__(self, seed: int, max_delay_s: float = 0.003):
        super().__init__()
        self.rng = random.Random(seed)
        self.max_delay_s = max_delay_s
        self.pending: list[tuple[torch.Tensor, torch.Tensor, threading.Event]] = []
        self.cv = threading.Condition()
        self.landed = 0
        self.closed = False
        self.thread = threading.Thread(target=self._land, daemon=True)
        self.thread.start()

    def copy(self, dst, src, ordering):
        if dst.is_contiguous():
            # what a reader of dst before the copy landed would see (as_strided: a one-element view may carry
            # any stride, which view(uint8) refuses)
            dst.as_strided((dst.numel(),), (1,)).view(torch.uint8).fill_(POISON)
        done = threading.Event()
        with self.cv:
            self.pending.append((dst, src, done))
            self.cv.notify()
        self._completes(done.wait)

    def _land(self):
        while True:
            with self.cv:
                self.cv.wait_for(lambda: self.pending or self.closed)
                if not self.pending:
                    return
            threading.Event().wait(self.rng.uniform(0, self.max_delay_s))
            with self.cv:
                dst, src, done = self.pending.pop(self.rng.randrange(len(self.pending)))
            self._put(dst, src)  # reads the live state now, not at save(): only the fence keeps it unchanged
            self.landed += 1
            done.set()

    def _put(self, dst, src):
        dst.copy_(src)

    def close(self):
        with self.cv:
            self.closed = True
            self.cv.notify()
        self.thread.join()


class LateAddressCopyBackend(LateCopyBackend):
    """Late as above, and like the native host copy pool a contiguous copy holds only its source's address, not the
    tensor: a source freed before its copy lands is read after it was freed. Strided copies are done at once, as
    there."""

    def copy(self, dst, src, ordering):
        if not (src.is_contiguous() and dst.is_contiguous()):
            dst.copy_(src)
            return
        super().copy(dst, (src.data_ptr(), src.numel() * src.element_size()), ordering)

    def _put(self, dst, src):
        ctypes.memmove(dst.data_ptr(), *src)


@contextlib.contextmanager
def copy_thread_held(pool: _native.CopyPool):
    """Holds the one thread of `pool` in a checksum that waits for another pool's long run of copies (2 GiB on one
    thread, a few milliseconds of checksum before it) while the body runs; its checksum is checked once the hold
    ends. Yields `holding()`: whether the hold still lasts. Copies the body queues on `pool` land while it lasts
    only if a caller runs them (`run_copies`, the fence's lending)."""
    other = _native.CopyPool(1)
    try:
        big = aligned_empty(32 << 20)
        big.view(torch.int32).copy_(torch.arange(8 << 20, dtype=torch.int32))  # cheaper than random bytes
        big_copy, held_by = torch.zeros_like(big), _native.CopyBatch()
        for _ in range(64):
            other.copy(held_by, big_copy.data_ptr(), big.data_ptr(), big.numel())
        first = pool.checksum(None, big.data_ptr(), [(0, 4 << 20)])  # one piece: `held` is queued before it ends
        held = pool.checksum(held_by, big_copy.data_ptr(), [(0, 4096)])  # taken right after `first`: it waits
        assert first.wait() == [_native.crc32c(big[:4 << 20].numpy())]
        yield lambda: not held_by.done()
        assert held.wait() == [_native.crc32c(big[:4096].numpy())]
    finally:
        other.close()
