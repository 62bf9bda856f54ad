"""A reader on another node: the versions a relay serves (`python -m datastates.weights.relay` on the trainer's
node), taken over TCP in pieces (`wire`), with the local reader's calls: `newest`, `open`, `wait_next` (a version
the relay leases for as long as it is open here), `tensors()` (packed and TP-sliced by the relay, which then sends
only what the rank holds), `load_into`, and `catch_up` through the deltas. Nothing is buffered beyond the tensor
being received (and, for `catch_up`, the changes, fewer bytes than the version). A torn connection or a damaged
piece is a WeightsError naming the relay and the tensor; the relay and its other readers go on."""
from __future__ import annotations

import socket
from collections.abc import Iterator

import torch

from .deltas import apply
from .reader import WeightsError, load_into
from .wire import Receiver, WireError, connected, send_header


class RemoteReader:
    """The versions served by the relay at `host`:`port`; `timeout_s`: the longest wait for the relay's next bytes
    (a relay that stalls longer is an error, never a hang)."""

    def __init__(self, host: str, port: int, timeout_s: float = 60.0):
        self.host, self.port, self.timeout_s = host, port, timeout_s

    def newest(self) -> RemoteVersion | None:
        """The newest version, leased by the relay while it is open (None: none published yet)."""
        return self._version({"op": "newest"})

    def open(self, iteration: int) -> RemoteVersion:
        """The version of `iteration`; WeightsError when the relay's node no longer holds it (or never did)."""
        return self._version({"op": "open", "iteration": iteration})

    def wait_next(self, after: int | None, timeout_s: float = 60.0) -> RemoteVersion:
        """The newest version once it is newer than `after` (None: any); WeightsError after `timeout_s`."""
        return self._version({"op": "next", "after": after, "timeout_s": timeout_s}, wait_s=timeout_s)

    def catch_up(self, tensors: dict, held: int, timeout_s: float | None = None) -> tuple[int, int]:
        """Bring `tensors` (this reader's own copy of version `held`, Hugging Face names) to the newest version in
        place: (its iteration, the bytes received); `timeout_s`: first wait that long for a version newer than
        `held` (WeightsError if none comes; None: at once, `held` itself when it is the newest). The relay sends
        only the changed elements where its deltas lead there (the tensors changed only once every change has
        arrived whole: a torn transfer leaves them as they were), else the full version, copied in as it
        arrives."""
        with _Link(self, timeout_s or 0.0) as link:
            answer = link.ask({"op": "deltas", "held": held, "timeout_s": timeout_s})
            newest = answer["iteration"]
            if answer.get("kind") == "deltas":
                changes = _changes(link.stream(), tensors, link.where)
                for name, change in changes:
                    apply(tensors[name], change)
                return newest, link.wire.nbytes
            copied = []
            try:
                for header, tensor in link.stream():
                    name = header["name"]
                    if name not in tensors or tensors[name].shape != tensor.shape:
                        raise WeightsError(f"{link.where}: version {newest}'s {name!r} "
                                           f"{tuple(tensor.shape)} is not among the tensors given " +
                                           (f"(there: {tuple(tensors[name].shape)})" if name in tensors else ""))
                    with torch.no_grad():
                        tensors[name].copy_(tensor)
                    copied.append(name)
            except WeightsError as e:
                if copied:  # a full version copied in part: these tensors are no version now
                    raise WeightsError(f"{e}; {len(copied)} tensors were already copied from version {newest}: "
                                       f"read the version whole again") from None
                raise
            return newest, link.wire.nbytes

    def _version(self, request: dict, wait_s: float = 0.0) -> RemoteVersion | None:
        link = _Link(self, wait_s)
        try:
            answer = link.ask(request)
        except BaseException:
            link.close()
            raise
        if answer.get("iteration") is None:
            link.close()
            return None
        return RemoteVersion(link, answer["iteration"], answer.get("config", {}))


class RemoteVersion:
    """One version the relay holds for this reader until `close` (a `with` block); `nbytes`: the bytes received
    for it so far."""

    def __init__(self, link: _Link, iteration: int, config: dict):
        self._link, self.iteration, self.config = link, iteration, config
        self.path = f"version {iteration} at {link.where}"

    @property
    def nbytes(self) -> int:
        return self._link.wire.nbytes

    def tensors(self, packed: bool = False, tp_rank: int = 0, tp_size: int = 1, ep_rank: int = 0, ep_size: int = 1,
                ep_placement: str = "linear") -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) of every weight as it arrives, one tensor at a time, as `Version.tensors` hands them out
        (packed and sliced by the relay: only rank `tp_rank`'s, and EP rank `ep_rank`'s, bytes cross).
        WeightsError for a layout the version cannot take (the version stays open), a torn connection or a damaged
        piece (it is closed). A stream left before its end closes the version (its unread pieces are still on the
        wire)."""
        if self._link.closed:
            raise WeightsError(f"{self.path}: read after close (the relay may free the version once closed)")
        self._link.send({"op": "tensors", "packed": packed, "tp_rank": tp_rank, "tp_size": tp_size,
                         "ep_rank": ep_rank, "ep_size": ep_size, "ep_placement": ep_placement})
        try:
            for header, tensor in self._link.stream():
                yield header["name"], tensor
        except GeneratorExit:
            self.close()
            raise

    def load_into(self, model: torch.nn.Module) -> None:
        """Copy every weight in place into the transformers `model` (`reader.load_into`)."""
        load_into(model, self.tensors(), self.path)

    def close(self) -> None:
        """Give the version back: the relay's lease on it ends."""
        self._link.close()

    def __enter__(self) -> RemoteVersion:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _Link:
    """One connection to the relay; wire errors become WeightsErrors (and end the connection)."""

    def __init__(self, reader: RemoteReader, wait_s: float = 0.0):
        self.where = f"the relay at {reader.host}:{reader.port}"
        try:
            sock = socket.create_connection((reader.host, reader.port), timeout=reader.timeout_s)
        except OSError as e:
            raise WeightsError(f"cannot reach {self.where}: {e}") from None
        self.sock = connected(sock, reader.timeout_s + wait_s)
        self.wire, self.closed = Receiver(self.sock, self.where), False

    def send(self, request: dict) -> None:
        try:
            send_header(self.sock, request)
        except OSError as e:
            self.close()
            raise WeightsError(f"{self.where}: the request {request.get('op')!r} could not be sent: {e}") from None

    def ask(self, request: dict) -> dict:
        """The relay's answer to `request`; WeightsError with the relay's message when it refused it."""
        self.send(request)
        return self.header()

    def header(self) -> dict:
        try:
            header = self.wire.header()
        except WireError as e:
            self.close()
            raise WeightsError(str(e)) from None
        if header is None:
            self.close()
            raise WeightsError(f"{self.where} closed the connection")
        if "error" in header:
            raise WeightsError(f"{self.where}: {header['error']}")
        return header

    def stream(self) -> Iterator[tuple[dict, torch.Tensor]]:
        """The (header, tensor) pairs of an answer, up to its end."""
        count = 0
        while "end" not in (header := self.header()):
            if "name" not in header:
                self.close()
                raise WeightsError(f"{self.where}: a header {sorted(header)} where a tensor or the end belongs")
            try:
                tensor = self.wire.tensor(header)
            except WireError as e:
                self.close()
                raise WeightsError(str(e)) from None
            count += 1
            yield header, tensor
        if header["end"] != count:
            self.close()
            raise WeightsError(f"{self.where}: {count} tensors arrived, the relay says it sent {header['end']}")

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.sock.close()

    def __enter__(self) -> _Link:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _changes(stream, tensors: dict, where: str) -> list[tuple[str, dict]]:
    """Every change of a deltas answer, whole, each checked against `tensors` before any is applied."""
    changes: list[tuple[str, dict]] = []
    for header, tensor in stream:
        name, part = header["name"], header.get("part")
        if name not in tensors:
            raise WeightsError(f"{where}: the deltas change {name!r}, which the tensors given lack")
        size = tensors[name].numel()
        if part == "full" and tensor.numel() == size:
            changes.append((name, {"full": tensor}))
        elif part == "index" and (not tensor.numel() or 0 <= int(tensor.min()) <= int(tensor.max()) < size):
            changes.append((name, {"index": tensor}))
        elif part == "value" and changes and changes[-1][0] == name and "value" not in changes[-1][1] \
                and changes[-1][1].get("index") is not None and len(changes[-1][1]["index"]) == tensor.numel():
            changes[-1][1]["value"] = tensor
        else:
            raise WeightsError(f"{where}: the deltas' {part!r} of {name!r} ({tuple(tensor.shape)}) does not fit "
                               f"its {tuple(tensors[name].shape)} tensor given")
    for name, change in changes:
        if "index" in change and "value" not in change:
            raise WeightsError(f"{where}: the deltas name positions of {name!r} and no values")
    return changes
