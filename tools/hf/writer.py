"""Sharded safetensors written tensor by tensor into a directory that appears whole or not at all.

The safetensors library writes a file from a dict of tensors held at once; a model's shard would then sit in
memory whole. The format is fixed (an 8-byte little-endian header length, a JSON header of names, dtypes,
shapes and byte ranges, then the raw bytes), and every name, shape and dtype is known before any tensor is
read, so each shard's header is written first and its tensors streamed after it, one at a time. The files are
read back by safetensors and transformers in the tests.
"""
from __future__ import annotations

import json
import os
import shutil
import struct
import sys
from dataclasses import dataclass

import torch

from datastates import fsync_dir, write_file

from . import HFError

SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                      torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                      torch.uint8: "U8", torch.bool: "BOOL"}
INDEX = "model.safetensors.index.json"


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
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    return struct.pack("<Q", len(raw)) + raw


def shard_files(shards: list[list[Planned]]) -> list[str]:
    n = len(shards)
    return [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]


def write_index(directory: str, shards: list[list[Planned]]) -> None:
    """model.safetensors.index.json: which file holds each tensor, and the total size."""
    files = shard_files(shards)
    weight_map = {e.name: files[k] for k, shard in enumerate(shards) for e in shard}
    total = sum(e.nbytes for shard in shards for e in shard)
    doc = {"metadata": {"total_size": total}, "weight_map": weight_map}
    write_file(os.path.join(directory, INDEX), json.dumps(doc, indent=2).encode(), True)


class ShardedWriter:
    """Takes the planned tensors in plan order; writes `model-0000k-of-0000n.safetensors` and the index.

    `mine`: only these shards (by index), and no index: several processes each write their share of one model's
    files (the trainer's --save-hf), and one writes the index once all are done."""

    def __init__(self, directory: str, shards: list[list[Planned]], progress=None, mine: set[int] | None = None):
        if sys.byteorder != "little":
            raise HFError("safetensors stores little-endian bytes; this host is big-endian")
        self.directory, self.shards, self.progress, self.mine = directory, shards, progress, mine
        self.files = shard_files(shards)
        self._queue = [(k, e) for k, shard in enumerate(shards) for e in shard if mine is None or k in mine]
        self._next = 0
        self._file = None
        self._shard = -1

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if self._next >= len(self._queue):
            raise HFError(f"internal: tensor {name!r} was not planned")
        shard, planned = self._queue[self._next]
        if (name, tuple(tensor.shape), tensor.dtype) != (planned.name, planned.shape, planned.dtype):
            raise HFError(f"internal: got {name!r} {tuple(tensor.shape)} {tensor.dtype}, planned {planned}")
        if shard != self._shard:
            self._open(shard)
        data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
        self._file.write(memoryview(data))
        self._next += 1
        if self.progress is not None:
            self.progress.update(planned.nbytes)

    def _open(self, shard: int) -> None:
        self._close_file()
        self._shard = shard
        self._file = open(os.path.join(self.directory, self.files[shard]), "wb")
        self._file.write(_header(self.shards[shard]))

    def _close_file(self) -> None:
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            self._file = None

    def close(self) -> None:
        """Finish the last shard and write the index (which names every tensor's file)."""
        self._close_file()
        if self._next != len(self._queue):
            raise HFError(f"internal: {len(self._queue) - self._next} planned tensors were never written")
        if self.mine is None:
            write_index(self.directory, self.shards)

    def abort(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def write_json(directory: str, name: str, doc: dict) -> None:
    write_file(os.path.join(directory, name), (json.dumps(doc, indent=2) + "\n").encode(), True)


def copy_in(directory: str, source: str) -> None:
    """A copy of the file `source` in `directory`, fsynced."""
    target = os.path.join(directory, os.path.basename(source))
    shutil.copyfile(source, target)
    with open(target, "rb") as f:
        os.fsync(f.fileno())


class OutputDirectory:
    """A directory written as `<final>.partial.<pid>` and renamed to `<final>` once complete; removed on failure."""

    def __init__(self, final: str):
        self.final = os.path.normpath(final)
        if os.path.exists(self.final) and (not os.path.isdir(self.final) or os.listdir(self.final)):
            raise HFError(f"output {self.final!r} already exists and is not empty: refusing to overwrite it")
        self.path = f"{self.final}.partial.{os.getpid()}"

    def __enter__(self) -> "OutputDirectory":
        os.makedirs(self.path)
        return self

    def write_json(self, name: str, doc: dict) -> None:
        write_json(self.path, name, doc)

    def copy_in(self, source: str) -> None:
        copy_in(self.path, source)

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            shutil.rmtree(self.path, ignore_errors=True)
            return
        fsync_dir(self.path)
        os.rename(self.path, self.final)  # replaces an empty directory of that name
        fsync_dir(os.path.dirname(self.final) or ".")
