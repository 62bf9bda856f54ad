"""Sharded safetensors written tensor by tensor into a directory that appears whole or not at all.

The safetensors library writes a file from a dict of tensors held at once; a model's shard would then sit in
memory whole. The format is fixed (an 8-byte little-endian header length, a JSON header of names, dtypes,
shapes and byte ranges, then the raw bytes), and every name, shape and dtype is known before any tensor is
read, so each shard's header is written first and its tensors streamed after it, one at a time. The files are
read back by safetensors and transformers in the tests. Every file goes through the engine's storage contract
(`datastates.Storage`): a shard is one data object (a file, or an object store's multipart upload), the small
files are `write_bytes`, so one writer serves a file system and s3:// / msc:// alike.
"""
from __future__ import annotations

import collections
import json
import os
import struct
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from datastates import SaveRoot, Storage, aligned_empty
from datastates.paths import join as join_path, normalize as normalize_path, parent, scheme as url_scheme

from . import HFError

SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                      torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                      torch.uint8: "U8", torch.bool: "BOOL"}
INDEX = "model.safetensors.index.json"
# The header is padded with spaces (as the format allows) so that the tensors' bytes start on a 4 KiB boundary:
# a tensor held at a block-aligned address is then written with O_DIRECT straight from its pages, and readers
# that map or O_DIRECT-read the file find block-aligned data.
DATA_ALIGN = 4096


@dataclass(frozen=True)
class Planned:
    name: str
    shape: tuple
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for d in self.shape:
            n *= d
        return n


def plan_shards(entries: list[Planned], max_bytes: int) -> list[list[Planned]]:
    """Consecutive entries in shards of at most max_bytes (a larger tensor gets a shard of its own)."""
    shards: list[list[Planned]] = [[]]
    size = 0
    for e in entries:
        if shards[-1] and size + e.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(e)
        size += e.nbytes
    return shards


def _header(entries: list[Planned]) -> bytes:
    head, offset = {"__metadata__": {"format": "pt"}}, 0
    for e in entries:
        head[e.name] = {"dtype": SAFETENSORS_DTYPES[e.dtype], "shape": list(e.shape),
                        "data_offsets": [offset, offset + e.nbytes]}
        offset += e.nbytes
    raw = json.dumps(head, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % DATA_ALIGN)  # the data starts at a block boundary (see DATA_ALIGN)
    return struct.pack("<Q", len(raw)) + raw


def shard_files(shards: list[list[Planned]]) -> list[str]:
    n = len(shards)
    return [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]


def write_index(storage: Storage, directory: str, shards: list[list[Planned]]) -> None:
    """model.safetensors.index.json: which file holds each tensor, and the total size."""
    files = shard_files(shards)
    weight_map = {e.name: files[k] for k, shard in enumerate(shards) for e in shard}
    total = sum(e.nbytes for shard in shards for e in shard)
    doc = {"metadata": {"total_size": total}, "weight_map": weight_map}
    storage.write_bytes(join_path(directory, INDEX), json.dumps(doc, indent=2).encode())


class ShardedWriter:
    """Takes the planned tensors in plan order; writes `model-0000k-of-0000n.safetensors` and the index into
    `directory` of `storage`.

    `mine`: only these shards (by index), and no index: several processes each write their share of one model's
    files (the trainer's --save-hf), and one writes the index once all are done.

    `in_flight_bytes`: how many bytes of tensors already handed over may still be being written when `write`
    returns. 0 (the default): none, for a caller that reuses a tensor's memory once `write` returns. More keeps
    several writes in flight (an O_DIRECT write waits for the device: one at a time, small files would wait on
    its latency), for a caller whose tensors stay valid until `close` (the trainer's kept weights)."""

    def __init__(self, storage: Storage, directory: str, shards: list[list[Planned]], progress=None,
                 mine: set[int] | None = None, in_flight_bytes: int = 0):
        if sys.byteorder != "little":
            raise HFError("safetensors stores little-endian bytes; this host is big-endian")
        self.storage, self.directory, self.shards, self.progress, self.mine = storage, directory, shards, progress, mine
        self.files = shard_files(shards)
        self._queue = [(k, e) for k, shard in enumerate(shards) for e in shard if mine is None or k in mine]
        self._next = 0
        self._sink = None  # the open shard's data object
        self._offset = 0
        self._shard = -1
        # a finished file is closed (made durable: fsync, or an upload completed) once its writes are done, while
        # the next ones are written
        self._closer = ThreadPoolExecutor(1, thread_name_prefix="hf-close")
        self._closing: list = []
        self._in_flight_bytes = in_flight_bytes
        self._writes: collections.deque[_Write] = collections.deque()  # in flight, oldest first
        self._writing = 0  # their bytes
        self._file_writes: list[_Write] = []  # the open file's

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if self._next >= len(self._queue):
            raise HFError(f"internal: tensor {name!r} was not planned")
        shard, planned = self._queue[self._next]
        if (name, tuple(tensor.shape), tensor.dtype) != (planned.name, planned.shape, planned.dtype):
            raise HFError(f"internal: got {name!r} {tuple(tensor.shape)} {tensor.dtype}, planned {planned}")
        if shard != self._shard:
            self._open(shard)
        tensor = tensor.detach()
        if not tensor.is_contiguous():  # a split's strided view: copied where O_DIRECT writes it from its pages
            tensor = aligned_empty(planned.nbytes).view(tensor.dtype).view(tensor.shape).copy_(tensor)
        self._submit(tensor.reshape(-1).view(torch.uint8))
        self._next += 1
        if self.progress is not None:
            self.progress.update(planned.nbytes)

    def _submit(self, data: torch.Tensor) -> None:
        """Returns once at most `in_flight_bytes` of what was handed over is still being written."""
        write = _Write(self._sink.submit(data, self._offset, []), data)
        self._writes.append(write)
        self._file_writes.append(write)
        self._offset += data.numel()
        self._writing += data.numel()
        while self._writes and self._writing > self._in_flight_bytes:
            write = self._writes.popleft()
            self._writing -= write.nbytes
            write.wait()

    def _open(self, shard: int) -> None:
        self._close_sink()
        header = _header(self.shards[shard])
        size = len(header) + sum(e.nbytes for e in self.shards[shard])
        self._shard, self._offset = shard, 0
        self._sink = self.storage.open_data(join_path(self.directory, self.files[shard]), size)
        self._submit(torch.frombuffer(bytearray(header), dtype=torch.uint8))

    def _close_sink(self) -> None:
        if self._sink is not None:
            sink, self._sink, writes, self._file_writes = self._sink, None, self._file_writes, []
            self._closing.append(self._closer.submit(_close_after, sink, writes, self._offset))

    def _closed(self) -> None:
        """Wait for every write and every file's close; raise the first failure."""
        closing, self._closing = self._closing, []
        try:
            while self._writes:
                self._writes.popleft().wait()
        finally:
            self._closer.shutdown()
            self._writes.clear()
            self._writing = 0
        for done in closing:
            done.result()

    def close(self) -> None:
        """Finish the last shard (every file durable) and write the index (which names every tensor's file)."""
        self._close_sink()
        self._closed()
        if self._next != len(self._queue):
            raise HFError(f"internal: {len(self._queue) - self._next} planned tensors were never written")
        if self.mine is None:
            write_index(self.storage, self.directory, self.shards)

    def abort(self) -> None:
        if self._sink is not None:
            self._sink.discard()
            self._sink = None
        for write in self._writes:  # every write handed over ends before its bytes are let go
            write.wait(raises=False)
        try:
            self._closed()
        except Exception:  # noqa: BLE001 - the export failed already: its own error is the one raised
            pass


class _Write:
    """A write in flight, with its bytes: waited for once, by the writer (its window) or its file's close."""

    def __init__(self, done, data: torch.Tensor):
        self._done, self._data, self.nbytes = done, data, data.numel()
        self._lock = threading.Lock()
        self._error: BaseException | None = None

    def wait(self, raises: bool = True) -> None:
        with self._lock:
            if self._done is not None:
                try:
                    self._done()
                except BaseException as e:  # noqa: BLE001 - raised to whichever waiter asks
                    self._error = e
                self._done = self._data = None  # written: its bytes are let go
        if self._error is not None and raises:
            raise self._error


def _close_after(sink, writes: list[_Write], nbytes: int) -> None:
    """Close a file once its writes are done (durable where the storage syncs)."""
    for write in writes:
        write.wait()
    sink.close(nbytes)


def write_json(storage: Storage, directory: str, name: str, doc: dict) -> None:
    storage.write_bytes(join_path(directory, name), (json.dumps(doc, indent=2) + "\n").encode())


def copy_in(storage: Storage, directory: str, source: str) -> None:
    """A copy of the local file `source` in `directory` (a small file: a tokenizer's)."""
    with open(source, "rb") as f:
        storage.write_bytes(join_path(directory, os.path.basename(source)), f.read())


class OutputDirectory:
    """A model directory published through the save-root policy (`SaveRoot`, its index the marker, no pointer):
    written where the storage stages it under a name of this process alone (a file system's
    `<final>.<pid>-<random>.partial`, renamed to `<final>` once complete: two conversions to one output never
    write into one directory; an object store's final prefix, whose index, written last, publishes it) and
    committed on a clean exit, never over an output another process completed meanwhile; removed on failure."""

    def __init__(self, storage: Storage, final: str):
        self.storage, self.final = storage, normalize_path(final)
        self._refuse_occupied()
        self.policy = SaveRoot(storage, parent(self.final), marker=INDEX, pointer=None)
        self.path = self.final

    def _refuse_occupied(self) -> None:
        local_file = url_scheme(self.final) is None and os.path.exists(self.final) and not os.path.isdir(self.final)
        if local_file or self.storage.list(self.final):
            raise HFError(f"output {self.final!r} already exists and is not empty: refusing to overwrite it")

    def __enter__(self) -> "OutputDirectory":
        self.path = self.policy.stage(self.final, private=True)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.storage.remove(self.path)
            return
        try:  # the index was written last; replaces an empty directory only
            self.policy.commit(self.path, self.final, replace=False)
        except FileExistsError:
            self.storage.remove(self.path)
            self._refuse_occupied()
            raise
