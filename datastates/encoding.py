"""The encoding stage of the save pipeline (`--ckpt-compress`): a data sink that wraps the storage's own, as PyTorch
DCP's stream transforms wrap a stream. The writers hand it slots as they would any sink; it encodes each tensor
chunk on the encoder threads, packs the stored chunks back to back (a chunk the codec does not make smaller, and
every object, stored raw), writes them through the inner sink in submission order and records what the manifest
needs: each tensor's codec and stored chunk sizes and each item's stored offset. Neither the writers nor the
storage know a codec.
"""
from __future__ import annotations

import functools
import queue
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from .codecs import Codec
from .errors import CheckpointError
from .priority import background_nice, lower_priority
from .schema import Item, Kind
from .storage import DataSink


class Encoder:
    """One engine's encoding stage: its codec, the threads that encode (at the writers' priority, below training and
    the snapshot copies), and the thread that writes the encoded slots of every save through their inner sinks,
    one after the other in the order they were submitted (each position depends on the stored sizes before it)."""

    def __init__(self, codec: Codec, threads: int):
        self.codec, self.threads = codec, threads
        self._nice = background_nice()
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="ds-encode", initializer=lower_priority,
                                        initargs=(self._nice,))
        self._writes: queue.Queue = queue.Queue()  # (sink, slot) in submission order; None stops the writer
        self._writer = threading.Thread(target=self._write_all, name="ds-encode-write", daemon=True)
        self._writer.start()

    def encode(self, buffer: torch.Tensor, run: list) -> Future:
        """A run of a slot's segments, encoded on a thread of this stage (`_encode`)."""
        return self._pool.submit(_encode, self.codec, buffer, run)

    def wrap(self, sink: DataSink, items: list[Item]) -> "EncodingSink":
        """`sink` (one save's data) behind this stage; `items`: every item of the save."""
        return EncodingSink(sink, self, items)

    def write(self, sink: "EncodingSink", slot: "_Slot") -> None:
        """Queue `slot` of `sink` for the writer thread."""
        self._writes.put((sink, slot))

    def _write_all(self) -> None:
        lower_priority(self._nice)
        while (work := self._writes.get()) is not None:
            sink, slot = work
            try:
                sink._write(slot)
            finally:
                slot.written.set()

    def close(self) -> None:
        """After every save's last wait: stop the writer, then the encoder threads."""
        self._writes.put(None)
        self._writer.join()
        self._pool.shutdown()


class _Slot:
    """One submitted slot: its encoding runs, and the inner submits of its stored bytes once written."""

    __slots__ = ("buffer", "runs", "submitted", "written")

    def __init__(self, buffer: torch.Tensor, runs: list[tuple[list, Future]]):
        self.buffer, self.runs, self.submitted, self.written = buffer, runs, [], threading.Event()


class EncodingSink(DataSink):
    """A save's data, encoded on its way to `inner`. Its segments carry their item: (start, length, item, chunk
    index), as the staging slots hold them. A slot is written by the stage's writer thread once it is encoded, run
    by run, each at the next stored position, while the next slots encode and the runs before it are still being
    written. `close` applies the stored offsets and returns the stored length. A failure to encode or submit
    fails every later wait for checksums (an OSError as it came, anything else as a CheckpointError naming the
    file)."""

    pages = None

    def __init__(self, inner: DataSink, encoder: Encoder, items: list[Item]):
        self.inner, self.encoder, self.items = inner, encoder, items
        self.path, self.direct = inner.path, inner.direct
        self.position = 0  # where the next stored bytes go (the writer thread's)
        self._placed: list[tuple[Item, int]] = []  # (item, its stored offset), applied at close
        self._error: BaseException | None = None

    def submit(self, buffer, offset, segments):
        """Encode `segments` of `buffer`: the slot of a save's first bytes one run per chunk (on a link-bound object
        store the wait for its encoding was most of what a compressed save added before its first byte went up),
        later slots one run per encoding thread, so that every thread works on the slot at once."""
        runs = _runs(segments, len(segments) if offset == 0 else self.encoder.threads)
        slot = _Slot(buffer, [(run, self.encoder.encode(buffer, run)) for run in runs])
        self.encoder.write(self, slot)
        return functools.partial(self._done, slot)

    def _done(self, slot: _Slot) -> list[int]:
        """The crc32c of each of the slot's stored chunks, once written (the slot is lent until this returns)."""
        slot.written.wait()
        crcs = [crc for done in slot.submitted for crc in _drained(done, self._error)]
        if self._error is not None:
            raise self._error
        return crcs

    def _write(self, slot: _Slot) -> None:
        """Pack the slot's stored chunks to its front and submit them at the next position, run by run as each is
        encoded. Every run is waited for (the slot goes back to the pool after); after a failure nothing more is
        written (the save fails with the first error)."""
        out, pos = slot.buffer.numpy(), 0
        for run, future in slot.runs:
            try:
                encoded = future.result()
                if self._error is not None:
                    continue
                first, stored = pos, []
                for (start, n, item, index), data in zip(run, encoded):
                    m = n if data is None else len(data)
                    out[pos:pos + m] = out[start:start + n] if data is None else np.frombuffer(data, np.uint8)
                    self._record(item, index, m, pos)
                    stored.append((pos - first, m))
                    pos += m
                slot.submitted.append(self.inner.submit(slot.buffer[first:pos], self.position + first, stored))
            except BaseException as e:  # noqa: BLE001 - every later wait raises it: the save fails, not the engine
                self._error = self._error or (e if isinstance(e, (OSError, CheckpointError)) else CheckpointError(
                    f"encoding {self.path!r} ({self.encoder.codec.name}) failed: {type(e).__name__}: {e}"))
        self.position += pos

    def _record(self, item: Item, index: int, stored: int, pos: int) -> None:
        """What the manifest says of a chunk stored at slot position `pos`: its stored size (tensors), and the
        item's stored offset (its first chunk's, applied at close: the copier lays out later chunks by the plan's)."""
        if index == 0:
            self._placed.append((item, self.position + pos))
        if item.kind == Kind.TENSOR:
            if item.stored is None:
                item.codec, item.stored = self.encoder.codec.name, [0] * len(item.crcs)
            item.stored[index] = stored

    def close(self, nbytes):
        """Every slot was waited for: the items' offsets become their stored ones (an item with nothing stored at
        0, so that none lies past the stored bytes) and the inner sink is closed at the stored length, which is
        returned (`nbytes`, the planned length, no longer applies)."""
        for item in self.items:
            if item.nbytes == 0:
                item.offset = 0
        for item, offset in self._placed:
            item.offset = offset
        self.inner.close(self.position)
        return self.position

    def discard(self):
        self.inner.discard()


def _drained(done, error: BaseException | None) -> list[int]:
    """The checksums of one inner submit; after a failure it is only waited for (the inner sink may still read
    the slot)."""
    if error is None:
        return done()
    try:
        done()
    except Exception:  # noqa: BLE001 - the save failed already: its own error is the one reported
        pass
    return []


def _runs(segments: list, n: int) -> list[list]:
    """A slot's segments cut, in order, into at most `n` runs of about equal bytes, one encoder job each."""
    total, runs, run, done = sum(seg[1] for seg in segments) or 1, [], [], 0
    for seg in segments:
        run.append(seg)
        done += seg[1]
        if done * n >= total * (len(runs) + 1):
            runs.append(run)
            run = []
    return runs + [run] if run else runs


def _encode(codec: Codec, buffer: torch.Tensor, segments: list) -> list[bytes | None]:
    """Each segment of a run encoded (tensor chunks), or None where it is stored raw (objects, and chunks the codec
    does not make smaller); on an encoder thread."""
    raw = buffer.numpy()
    out = []
    for start, n, item, _ in segments:
        data = codec.encode(memoryview(raw[start:start + n]), item.element_size) if item.kind == Kind.TENSOR else None
        out.append(data if data is not None and len(data) < n else None)
    return out

