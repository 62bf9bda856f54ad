"""The relay's wire (relay.py serves, remote.py reads): frames of a small JSON header and raw bytes, each checked,
so that a version crosses in bounded pieces and nothing but JSON and tensor bytes is ever decoded (no pickle).

    frame     12 bytes `!III`: the header's length (at most HEADER), the payload's length (at most CHUNK), the
              crc32 of header and payload; then the header (UTF-8 JSON; empty on a data frame), then the payload
    tensor    a header frame {"name", "dtype", "shape", ...} with no payload, then the tensor's bytes in data frames
              of at most CHUNK bytes each, received straight into the tensor being built (no other buffer)

A frame cut short is a torn connection, a crc32 that does not match a damaged piece: both a WireError naming where.
"""
from __future__ import annotations

import json
import socket
import struct
import zlib

import torch

CHUNK = 1 << 20   # a data frame's bytes at most: the most either side buffers besides the tensor it sends or builds
HEADER = 1 << 20  # a header's bytes at most (a version's config.json rides in one)
_FRAME = struct.Struct("!III")
DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)}


class WireError(ConnectionError):
    """The connection tore, or a piece arrived damaged or out of the protocol."""


def connected(sock: socket.socket, timeout_s: float | None) -> socket.socket:
    """`sock` set for frames: no Nagle delay on the small header frames, and `timeout_s` on every send and receive."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.settimeout(timeout_s)
    return sock


def send_header(sock: socket.socket, header: dict) -> int:
    """One header frame; the bytes sent."""
    data = json.dumps(header).encode()
    if len(data) > HEADER:
        raise ValueError(f"a header of {len(data)} bytes: the wire takes at most {HEADER}")
    sock.sendall(_FRAME.pack(len(data), 0, zlib.crc32(data)) + data)
    return _FRAME.size + len(data)


def send_tensor(sock: socket.socket, header: dict, tensor: torch.Tensor) -> int:
    """`tensor` under `header` (its dtype and shape added), its bytes in CHUNK pieces; the bytes sent."""
    tensor = tensor.contiguous()
    if str(tensor.dtype).removeprefix("torch.") not in DTYPES:
        raise ValueError(f"{header}: dtype {tensor.dtype} does not cross the wire (these do: {', '.join(DTYPES)})")
    sent = send_header(sock, {**header, "dtype": str(tensor.dtype).removeprefix("torch."),
                              "shape": list(tensor.shape)})
    view = _bytes_of(tensor)
    for at in range(0, len(view), CHUNK):
        piece = view[at:at + CHUNK]
        sock.sendall(_FRAME.pack(0, len(piece), zlib.crc32(piece)))
        sock.sendall(piece)
        sent += _FRAME.size + len(piece)
    return sent


class Receiver:
    """The frames arriving on one socket; `nbytes`: every byte received so far (frames' own included)."""

    def __init__(self, sock: socket.socket, peer: str):
        self.sock, self.peer, self.nbytes = sock, peer, 0

    def header(self) -> dict | None:
        """The next header frame (None: the peer closed the connection between frames)."""
        prefix = bytearray(_FRAME.size)
        if not self._fill(memoryview(prefix), "a frame", at_boundary=True):
            return None
        size, length, crc = _FRAME.unpack(prefix)
        if length or size > HEADER:
            raise WireError(f"{self.peer}: a header frame of {size} header and {length} payload bytes (a header "
                            f"frame has at most {HEADER} header bytes and no payload): not this wire's peer")
        data = bytearray(size)
        self._fill(memoryview(data), "a header")
        if zlib.crc32(data) != crc:
            raise WireError(f"{self.peer}: a header of {size} bytes failed its crc32")
        try:
            header = json.loads(data)
        except ValueError:
            header = None
        if not isinstance(header, dict):
            raise WireError(f"{self.peer}: a header that is no JSON object")
        return header

    def tensor(self, header: dict) -> torch.Tensor:
        """The tensor `header` announces, its data frames received into it."""
        dtype, shape = DTYPES.get(header.get("dtype")), header.get("shape")
        if dtype is None or not isinstance(shape, list) or not all(isinstance(n, int) and n >= 0 for n in shape):
            raise WireError(f"{self.peer}: {header.get('name')!r} announced as dtype {header.get('dtype')!r}, "
                            f"shape {shape!r}: not a tensor this wire carries")
        try:
            tensor = torch.empty(shape, dtype=dtype)
        except RuntimeError as e:  # more bytes than this reader has
            raise WireError(f"{self.peer}: {header.get('name')!r} of shape {shape}: {e}") from None
        view, at = _bytes_of(tensor), 0
        while at < len(view):
            prefix = bytearray(_FRAME.size)
            self._fill(memoryview(prefix), f"{header['name']!r} at byte {at} of {len(view)}")
            size, length, crc = _FRAME.unpack(prefix)
            if size or not 0 < length <= min(CHUNK, len(view) - at):
                raise WireError(f"{self.peer}: {header['name']!r} at byte {at} of {len(view)}: a frame of {size} "
                                f"header and {length} payload bytes where a piece of the tensor belongs")
            piece = view[at:at + length]
            self._fill(piece, f"{header['name']!r} at byte {at} of {len(view)}")
            if zlib.crc32(piece) != crc:
                raise WireError(f"{self.peer}: {header['name']!r}: the piece of bytes {at} to {at + length} "
                                f"failed its crc32")
            at += length
        return tensor

    def _fill(self, view: memoryview, what: str, at_boundary: bool = False) -> bool:
        got = 0
        while got < len(view):
            try:
                n = self.sock.recv_into(view[got:])
            except TimeoutError:
                raise WireError(f"{self.peer}: nothing arrived within {self.sock.gettimeout()} s, in {what}") \
                    from None
            if not n:
                if at_boundary and not got:
                    return False
                raise WireError(f"{self.peer}: the connection closed in the middle of {what} ({got} of {len(view)} "
                                f"bytes)")
            got += n
            self.nbytes += n
        return True


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, shared with it (written through when received into)."""
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())
