"""The relay: a process on the publishing node that serves its versions to readers on other nodes over TCP
(`remote.RemoteReader`), in bounded pieces (`wire`). The trainer knows nothing of it: the relay reads the versions
as any local reader does, each leased for as long as a connection holds it, so retention passes over it and the
trainer never waits. A thread per connection: a slow reader holds only its own thread, and a dead one only until
the kernel says so (its lease then given back); the others go on.

    python -m datastates.weights.relay --dir /dev/shm/policy --port 7070 [--host 0.0.0.0] [--idle-timeout-s 300]

A connection asks, one request at a time (a header frame each; see `remote` for the answers):
    {"op": "newest"} | {"op": "open", "iteration": N} | {"op": "next", "after": N, "timeout_s": T}
        -> {"iteration": N, "config": {...}}: that version leased for the connection ({"iteration": null}: none)
    {"op": "tensors", "packed": false, "tp_rank": 0, "tp_size": 1, "ep_rank": 0, "ep_size": 1, "ep_placement": "linear"}
        -> each tensor the local reader's `Version.tensors` yields with those options, then {"end": count}
    {"op": "deltas", "held": N[, "timeout_s": T]}   (T: wait that long for a version newer than N first)
        -> {"iteration": M, "kind": "deltas"}, each change of the deltas from N to the newest M, oldest first
           ({"name", "part": "index"|"value"|"full"}), then {"end": count}; or, where no chain leads there (or
           only one larger than it), {"kind": "full", "why": ...} and the newest version's tensors
A request that fails (a version not held, a layout the version cannot take, a malformed one) is answered
{"error": message}, and the connection goes on.
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import socketserver
import sys

from .deltas import BrokenChain, changes_in
from .reader import Version, WeightsError, WeightsReader
from .wire import Receiver, connected, send_header, send_tensor

log = logging.getLogger(__name__)
MAX_WAIT_S = 3600.0  # the longest `next` a connection may ask the relay to wait


class Relay(socketserver.ThreadingTCPServer):
    """Serves the versions under `root` on `address` ((host, 0): a free port; `server_address` says which);
    `serve_forever` until `shutdown`. A connection that neither asks nor takes bytes for `idle_timeout_s` is
    dropped, its lease given back (a reader on a node that vanished without a word)."""
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, root: str, address: tuple[str, int] = ("0.0.0.0", 0), idle_timeout_s: float = 300.0):
        self.reader, self.idle_timeout_s = WeightsReader(root), idle_timeout_s
        super().__init__(address, _Connection)


class _Connection(socketserver.BaseRequestHandler):
    """One reader's connection: its requests answered in turn, the version it holds leased until the next one or
    its end."""

    def setup(self) -> None:
        self.peer = "%s:%d" % self.client_address[:2]
        self.wire = Receiver(connected(self.request, self.server.idle_timeout_s), f"reader {self.peer}")
        self.version: Version | None = None

    def handle(self) -> None:
        try:
            while (request := self.wire.header()) is not None:
                try:
                    self.answer(request)
                except (WeightsError, ValueError, TypeError) as e:  # a bad request: said, the connection goes on
                    send_header(self.request, {"error": str(e)})
        except OSError as e:  # torn, timed out, or damaged: this connection ends, the others go on
            log.info("relay: reader %s gone: %s", self.peer, e)

    def finish(self) -> None:
        self._release()

    def answer(self, request: dict) -> None:
        op, reader = request.get("op"), self.server.reader
        if op in ("newest", "open", "next"):
            self._release()  # never two versions held by one connection, nor an old one while it waits
            if op == "newest":
                self.version = reader.newest()
            elif op == "open":
                self.version = reader.open(_int(request, "iteration"))
            else:
                after = None if request.get("after") is None else _int(request, "after")
                self.version = reader.wait_next(after, min(float(request.get("timeout_s", 60.0)), MAX_WAIT_S))
            send_header(self.request, {"iteration": None} if self.version is None else
                        {"iteration": self.version.iteration, "config": self.version.config})
        elif op == "tensors":
            if self.version is None:
                raise WeightsError("no version held on this connection: ask for one first (newest, open, next)")
            placement = request.get("ep_placement", "linear")
            self._stream(self.version.tensors(bool(request.get("packed", False)), _int(request, "tp_rank", 0),
                                              _int(request, "tp_size", 1), _int(request, "ep_rank", 0),
                                              _int(request, "ep_size", 1), str(placement)))
        elif op == "deltas":
            held = _int(request, "held")
            if request.get("timeout_s") is not None:  # a newer version first (WeightsError once it is past)
                reader.wait_next(held, min(float(request["timeout_s"]), MAX_WAIT_S)).close()
            self._deltas(held)
        else:
            raise WeightsError(f"unknown request {op!r} (these are: newest, open, next, tensors, deltas)")

    def _release(self) -> None:
        """Give back the lease of the version held (the publisher may free it from now on)."""
        if self.version is not None:
            self.version.close()
            self.version = None

    def _stream(self, pairs) -> None:
        """Each (name, tensor) of `pairs`, then the end; a WeightsError before the first is the request's error."""
        count = 0
        for name, tensor in pairs:
            send_tensor(self.request, {"name": name}, tensor)
            count += 1
        send_header(self.request, {"end": count})

    def _deltas(self, held: int) -> None:
        reader = self.server.reader
        with contextlib.ExitStack() as stack:
            try:
                newest, files = reader.deltas(stack, held)
            except BrokenChain as e:
                why = f"{e}: version {held} cannot be brought to {e.newest} by deltas"
            else:
                send_header(self.request, {"iteration": newest, "kind": "deltas"})
                count = 0
                for f in files:
                    for name, change in changes_in(f):
                        for part, tensor in change.items():
                            send_tensor(self.request, {"name": name, "part": part}, tensor)
                            count += 1
                send_header(self.request, {"end": count})
                return
        with reader.newest() as version:  # `latest` names it: never retired, so never None here
            send_header(self.request, {"iteration": version.iteration, "kind": "full", "why": why})
            self._stream(version.tensors())


def _int(request: dict, key: str, default: int | None = None) -> int:
    value = request.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool):
        raise WeightsError(f"the request's {key!r} must be an integer, got {value!r}")
    return value


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m datastates.weights.relay",
                                 description="Serve the policy versions under --dir to readers on other nodes.")
    ap.add_argument("--dir", required=True, help="the trainer's --publish-weights-dir on this node")
    ap.add_argument("--port", type=int, required=True, help="the TCP port (0: any free one, printed)")
    ap.add_argument("--host", default="0.0.0.0", help="the address to listen on (default: every interface)")
    ap.add_argument("--idle-timeout-s", type=float, default=300.0,
                    help="drop a connection that neither asks nor takes bytes for this long (default 300)")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    try:
        relay = Relay(a.dir, (a.host, a.port), a.idle_timeout_s)
    except OSError as e:
        sys.exit(f"relay: cannot listen on {a.host}:{a.port}: {e}")
    with relay:
        host, port = relay.server_address[:2]
        newest = relay.reader.pointed()
        print(f"relay: serving {a.dir} on {host}:{port} (newest version: {newest})", flush=True)
        relay.serve_forever()


if __name__ == "__main__":
    main()
