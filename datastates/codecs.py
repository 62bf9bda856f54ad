"""Lossless codecs of a saved chunk (docs/compression.md has the measurements they were chosen by).

A codec turns a chunk's raw bytes into stored bytes and back; its name is what an item's manifest record says
(`Item.codec`). Each codec's library is imported on first use, so the engine imports and saves uncompressed
without any of them; a checkpoint naming a codec whose library is missing is refused naming the package.
Byte grouping puts byte k of every element together (the exponent bytes of bf16 and fp32 values repeat, their
low mantissa bytes do not), so the compressor sees runs of alike bytes.
"""
from __future__ import annotations

import importlib
import logging
import threading

import numpy as np

from .errors import CheckpointError

log = logging.getLogger(__name__)

ZSTD_LEVEL = 1  # levels 3 and above cost 2-4x the time for a few per cent more (docs/compression.md)


def _module(name: str, package: str):
    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise CheckpointError(f"compression codec needs the PyPI package {package!r}, which is not installed "
                              f"(pip install {package})") from e


def group_bytes(data: memoryview, itemsize: int) -> np.ndarray:
    """Byte k of every element together, k = 0..itemsize-1 (a copy)."""
    raw = np.frombuffer(data, np.uint8)
    return raw if itemsize == 1 else np.ascontiguousarray(raw.reshape(-1, itemsize).T)


def ungroup_bytes(grouped: np.ndarray, itemsize: int, out: np.ndarray) -> None:
    """The inverse of `group_bytes`, into `out` (uint8, the raw size)."""
    columns, n = out.reshape(-1, itemsize), out.size // itemsize
    for k in range(itemsize):  # one column at a time: 6x faster than assigning the transposed view at once
        columns[:, k] = grouped[k * n:(k + 1) * n]


class Codec:
    """One named encoding of a chunk. `encode` returns the stored bytes; `decode` fills `out` (uint8, the raw
    size) or raises ValueError when the stored bytes are not a valid encoding of that many bytes."""

    name = ""
    module = ""  # what it imports
    package = ""  # the PyPI package that provides it

    def encode(self, data: memoryview, itemsize: int) -> bytes:
        raise NotImplementedError

    def decode(self, data: memoryview, out: np.ndarray, itemsize: int) -> None:
        raise NotImplementedError


class _Zstd(Codec):
    """zstd level 1 with its frame's content checksum (what is restored is checked too), after byte grouping
    when `grouped`. python-zstandard releases the GIL while it works; one compressor per thread."""

    module, package = "zstandard", "zstandard"

    def __init__(self, name: str, grouped: bool):
        self.name, self.grouped = name, grouped
        self._local = threading.local()

    def _zstd(self):
        local = self._local
        if not hasattr(local, "c"):
            zstd = _module(self.module, self.package)
            local.c = zstd.ZstdCompressor(level=ZSTD_LEVEL, write_checksum=True, write_content_size=True)
            local.d = zstd.ZstdDecompressor()
            local.error = zstd.ZstdError
        return local

    def encode(self, data, itemsize):
        src = group_bytes(data, itemsize) if self.grouped else data
        return self._zstd().c.compress(src)

    def decode(self, data, out, itemsize):
        z = self._zstd()
        try:
            raw = z.d.decompress(data, max_output_size=out.nbytes)
        except z.error as e:
            raise ValueError(f"not a valid {self.name} frame: {e}") from None
        if len(raw) != out.nbytes:
            raise ValueError(f"decodes to {len(raw)} bytes, not {out.nbytes}")
        src = np.frombuffer(raw, np.uint8)
        if self.grouped:
            ungroup_bytes(src, itemsize, out)
        else:
            out[:] = src


CODECS: dict[str, Codec] = {c.name: c for c in (_Zstd("zstd", grouped=False), _Zstd("bytegroup-zstd", grouped=True))}


def codec(name, where: str = "") -> Codec:
    """The codec `name` (as a manifest records it); an unknown one is refused naming `where`."""
    found = CODECS.get(name) if isinstance(name, str) else None
    if found is None:
        raise CheckpointError(f"{where + ': ' if where else ''}unknown compression codec {name!r} (this datastates "
                              f"knows {', '.join(sorted(CODECS))})")
    return found


SETTINGS = ("off", "auto", *CODECS)  # what --ckpt-compress / CheckpointEngine(compress=) take
AUTO = "bytegroup-zstd"  # what `auto` uses where it compresses


def for_storage(setting: str, storage) -> Codec | None:
    """The codec a save to `storage` uses for `setting` ("off", "auto" or a codec's name), its library imported
    now (a missing one fails the engine's set-up, not a save). `auto` compresses on object stores, where each
    byte is transfer time, requests and money, and not on file systems, whose writers are faster than the codec
    on one core, nor on the memory tier, where it was 3x slower to durable for 1.23x the room and would take the
    pages a storage save writes from (docs/compression.md): what the storage declares (`Storage.object_store`)
    decides. On an object store without the codec's library it saves uncompressed, saying so."""
    if setting not in SETTINGS:
        raise ValueError(f"compress must be one of {', '.join(SETTINGS)}, not {setting!r}")
    if setting == "off" or (setting == "auto" and not storage.object_store):
        return None
    found = CODECS[AUTO if setting == "auto" else setting]
    try:
        _module(found.module, found.package)
    except CheckpointError as e:
        if setting != "auto":
            raise
        log.warning("--ckpt-compress auto saves uncompressed: %s", e)
        return None
    return found
