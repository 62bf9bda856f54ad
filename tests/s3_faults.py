"""A fault-injecting HTTP proxy in front of the SeaweedFS of tests/s3_store.py, so that the S3 backend's retry
paths meet real network failures (a 503 SlowDown answer, a connection reset before the reply or in the middle of
a body) with a real store behind them: the project never mocks S3.

    proxy = FaultProxy(s3_server.endpoint)      # AWS_ENDPOINT_URL=proxy.url sends boto3 through it
    proxy.inject("UploadPart", "slow_down", times=2)
    ...
    proxy.requests                              # (kind, target, Range, fault) of every request, faulted or not
    FaultProxy(s3_server.endpoint, link_bytes_per_s=100e6)   # and every body paced to a 100 MB/s link, shared


It parses just enough HTTP/1.1 for boto3 and SeaweedFS: a head and a Content-Length body each way (both send one
for every request and response here; anything else is refused, not guessed at), on keep-alive connections.
"""
import contextlib
import fcntl
import socket
import struct
import termios
import threading
import time
from urllib.parse import urlsplit

SLOW_DOWN = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
             b'<Message>Please reduce your request rate.</Message><RequestId>fault-proxy</RequestId></Error>')


def kind_of(method: str, target: str, headers: dict) -> str:
    """The S3 operation a request is, as far as the faults need to tell: UploadPart, PutObject, RangedGet, else
    the method (GET of a whole object or a listing, HEAD, POST, DELETE)."""
    if method == "PUT":
        return "UploadPart" if "partNumber=" in urlsplit(target).query else "PutObject"
    if method == "GET" and "range" in headers:
        return "RangedGet"
    return method


def range_length(headers: dict) -> int:
    """How many bytes a `Range: bytes=a-b` header asks for; 0 without one."""
    first, _, last = headers.get("range", "bytes=0--1")[len("bytes="):].partition("-")
    return int(last) - int(first) + 1


def read_head(reader) -> bytes | None:
    """A request's or response's head, up to and with its blank line; None at a clean end of the connection."""
    lines = []
    while True:
        line = reader.readline(65537)
        if not line:
            if lines:
                raise ConnectionError("the connection ended inside a head")
            return None
        lines.append(line)
        if line in (b"\r\n", b"\n"):
            return b"".join(lines)


def parse_head(head: bytes) -> tuple[list[str], dict]:
    """(the first line's words, headers with lower-case names)."""
    first, *rest = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in rest:
        if line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    return first.split(" ", 2), headers


def copy(reader, sock, n: int, pace=lambda n: None) -> None:
    """`n` bytes from `reader` to `sock`, each piece `pace`d first."""
    while n:
        chunk = reader.read(min(n, 1 << 16))
        if not chunk:
            raise ConnectionError("the connection ended inside a body")
        pace(len(chunk))
        sock.sendall(chunk)
        n -= len(chunk)


def arm_reset(sock) -> None:
    """Make the socket's close send an RST instead of a FIN (SO_LINGER 0): the peer sees ECONNRESET, as when a
    store or a load balancer drops a connection. Waits until the peer has acknowledged the bytes sent so far: an
    RST discards what is still queued, and the test means the peer to get exactly those bytes."""
    deadline = time.monotonic() + 5
    while unacknowledged(sock) and time.monotonic() < deadline:
        time.sleep(0.001)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


def unacknowledged(sock) -> int:
    """Bytes sent on `sock` that its peer has not acknowledged yet (Linux's SIOCOUTQ)."""
    return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0" * 4))[0]


class FaultProxy:
    """Forwards every connection on 127.0.0.1:<free port> to `upstream` (one upstream connection per client
    connection), failing the requests that `inject` names. Serves on daemon threads until `close`.
    `link_bytes_per_s`: the bodies of every connection, both ways, share a link of that bandwidth (a node's network
    to an object store, where the store itself is faster: benchmarks/compression.py --link-mbps)."""

    def __init__(self, upstream: str, link_bytes_per_s: float | None = None):
        u = urlsplit(upstream)
        self.upstream = (u.hostname, u.port)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.rules: list[dict] = []
        self.requests: list[tuple[str, str, str | None, str | None]] = []
        self.lock = threading.Lock()
        self.sockets: set[socket.socket] = set()
        self.link_bytes_per_s, self.link_free_at = link_bytes_per_s, 0.0
        threading.Thread(target=self._accept, daemon=True, name="fault-proxy").start()

    def inject(self, kind: str, fault: str, times: int = 1, after: int = 0) -> None:
        """Fail the next `times` requests of `kind` (see `kind_of`):
        - "slow_down": answered 503 SlowDown by the proxy (before the body when the client waits for `100
          Continue`, so none is sent, as S3 does), never forwarded;
        - "reset": the request is read whole, then its connection reset before any response;
        - "reset_body": a ranged GET of more than `after` bytes (shorter ones pass) is forwarded, and its
          connection reset after `after` bytes of the response's body."""
        with self.lock:
            self.rules.append({"kind": kind, "fault": fault, "times": times, "after": after})

    def seen(self, kind: str) -> list[str]:
        """The targets (path and query) of the requests of `kind` received so far, retries included."""
        with self.lock:
            return [target for k, target, _, _ in self.requests if k == kind]

    def close(self) -> None:
        """Stop listening and drop every connection still open (boto3's pooled ones)."""
        self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()
        with self.lock:
            for s in self.sockets:
                with contextlib.suppress(OSError):  # already reset by its peer
                    s.shutdown(socket.SHUT_RDWR)

    def _accept(self):
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True, name="fault-proxy-conn").start()

    def _pace(self, n: int) -> None:
        """Wait for `n` bytes' turn on the link: each body piece reserves the link's next n/bandwidth seconds."""
        if self.link_bytes_per_s is None:
            return
        with self.lock:
            now = time.monotonic()
            self.link_free_at = max(self.link_free_at, now) + n / self.link_bytes_per_s
            wait = self.link_free_at - now
        time.sleep(wait)

    def _fault(self, kind: str, target: str, headers: dict) -> dict | None:
        """Log the request and take the first rule that matches it, if any."""
        with self.lock:
            rule = next((r for r in self.rules if r["kind"] == kind and r["times"] > 0
                         and (r["fault"] != "reset_body" or range_length(headers) > r["after"])), None)
            if rule is not None:
                rule["times"] -= 1
            self.requests.append((kind, target, headers.get("range"), rule and rule["fault"]))
            return rule

    def _serve(self, client: socket.socket) -> None:
        """One client connection: its requests in turn, each faulted or forwarded, until either side closes."""
        upstream = up_reader = None
        reader = client.makefile("rb")
        with self.lock:
            self.sockets.add(client)
        try:
            while True:
                head = read_head(reader)
                if head is None:
                    return
                (method, target, _), headers = parse_head(head)
                if "transfer-encoding" in headers:
                    raise NotImplementedError("a request body without Content-Length")
                rule = self._fault(kind_of(method, target, headers), target, headers)
                fault = rule and rule["fault"]
                expects = headers.get("expect", "").lower() == "100-continue"
                if fault == "slow_down" and expects:
                    client.sendall(self._slow_down(close=True))  # the body never comes: the connection is done
                    return
                if expects:
                    client.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
                length = int(headers.get("content-length", 0))
                if fault in ("slow_down", "reset"):
                    reader.read(length)
                    if fault == "reset":
                        arm_reset(client)  # closed below
                        return
                    client.sendall(self._slow_down(close=False))
                    continue
                if upstream is None:
                    upstream = socket.create_connection(self.upstream)
                    up_reader = upstream.makefile("rb")
                if expects:  # answered here already: the store gets the body at once
                    head = b"".join(line for line in head.splitlines(keepends=True)
                                    if not line.lower().startswith(b"expect:"))
                upstream.sendall(head)
                copy(reader, upstream, length, self._pace)  # cut through: the store takes it as the link passes it
                if not self._relay(up_reader, client, method, rule["after"] if fault == "reset_body" else None):
                    return
        except OSError:  # either side went away (or was reset here): the connection is over
            return
        finally:
            with self.lock:
                self.sockets.discard(client)
            reader.close()
            client.close()
            if upstream is not None:
                up_reader.close()
                upstream.close()

    @staticmethod
    def _slow_down(close: bool) -> bytes:
        return (b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\n"
                + f"Content-Length: {len(SLOW_DOWN)}\r\n".encode()
                + (b"Connection: close\r\n" if close else b"") + b"\r\n" + SLOW_DOWN)

    def _relay(self, up_reader, client: socket.socket, method: str, reset_after: int | None) -> bool:
        """The store's response to `client`, its connection reset after `reset_after` bytes of body if given.
        Whether the connection stays open for the next request."""
        head = read_head(up_reader)
        if head is None:
            raise ConnectionError("the store closed the connection without a response")
        (_, status, _), headers = parse_head(head)
        client.sendall(head)
        keep = headers.get("connection", "").lower() != "close"
        if method == "HEAD" or status in ("204", "304"):
            return keep
        if "content-length" not in headers:
            raise NotImplementedError(f"a response without Content-Length: {head!r}")
        n = int(headers["content-length"])
        if reset_after is not None:  # < n: the rule took a longer range
            copy(up_reader, client, reset_after)
            arm_reset(client)  # the caller closes it
            return False
        copy(up_reader, client, n, self._pace)
        return keep


if __name__ == "__main__":  # python tests/s3_faults.py UPSTREAM LINK_MB_PER_S: a link in a process of its own
    import sys
    proxy = FaultProxy(sys.argv[1], link_bytes_per_s=float(sys.argv[2]) * 1e6)
    print(proxy.url, flush=True)
    sys.stdin.read()  # serves until the caller closes the pipe (or exits)
