"""Trainer jobs forked from a process that imported torch and megatron-core once (tests only).

Starting Python, torch and megatron-core costs about 5 s of CPU per process on this 2-core machine, and a
4-rank torchrun pays it five times. A launcher process (one per interpreter, for the test session) imports
them once; each job is forked from it, and the job forks its ranks. A rank gets what torchrun gives a worker:
RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, ..., and a TCPStore that its job hosts on a port
the kernel picked (TORCHELASTIC_USE_AGENT_STORE, as under torchrun's agent), so no port is ever guessed. As
under torchrun, the first rank that fails stops the others and the job exits 1, and a job is over when its last
process is: ranks whose job process was killed (as a whole-job kill kills torchrun's agent) run on and are
waited for.

A job of no ranks (nproc None) runs its script in the job process itself, as `python script` would: the
tools, the reference scripts, megatron-core's own single-process runs.

Runs whose subject is torchrun itself (entry points, signals to the launcher, whole-job kills of torchrun)
use real torchrun (megatron_helpers.torchrun_command).

Protocol on the launcher's stdin/stdout: one JSON object per line, {"op": "spawn", ...} -> {"pid": P},
{"op": "wait", "pid": P, "timeout": T} -> {"status": code, or -signal, or null while running},
{"op": "kill", "pid": P} -> {} (SIGKILL to the job's whole process group).

A job that runs past its timeout is first sent DUMP_SIGNAL: every process of it (the job process and each rank)
writes every thread's Python stack into the job's log (faulthandler), which the TimeoutExpired raised shows, so
a hang seen once (in CI) says where each rank waited.
"""
from __future__ import annotations

import faulthandler
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The environment every launch has: OpenMP reads OMP_NUM_THREADS when torch is imported, Python reads
# PYTHONWARNINGS at start, and this repository's megatron.training must come before megatron-core 0.17+'s.
BASE_ENV = {"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "PYTHONPATH": ROOT}
# Rank processes get SIGTERM, then SIGKILL after this long, once a rank of their job has failed (torchrun: 30 s).
STOP_GRACE_S = 10.0
DUMP_SIGNAL = signal.SIGUSR1  # a job past its timeout: every thread's stack into its log (the trainer leaves it be)
DUMP_SETTLE_S, DUMP_MAX_S = 1.0, 10.0  # a process's dump is in once the log has not grown for this long
LOG_TAIL = 60000  # characters of a timed-out job's log in the exception's message: the dumps, and what came before


def environment(env: dict | None = None) -> dict:
    """This process's environment, BASE_ENV, then `env`: what a launched script sees."""
    return dict(os.environ, **BASE_ENV, **(env or {}))


def _preload() -> None:
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401

    import datastates  # noqa: F401
    import megatron.core.tokenizers.text  # noqa: F401  (imports transformers: seconds, for every tokenizer)
    import megatron.training.training  # noqa: F401  (megatron-core's models, optimizer, dist_checkpointing)


def _status(wait_status: int) -> int:
    return -os.WTERMSIG(wait_status) if os.WIFSIGNALED(wait_status) else os.WEXITSTATUS(wait_status)


def _rank(script: str, args: list[str], env: dict, port_pipe: int) -> None:
    """Run `script` as a worker (never returns: its SystemExit ends this process as a normal interpreter exit,
    with atexit handlers and non-daemon threads joined)."""
    with os.fdopen(port_pipe) as f:
        port = f.read().strip()
    if not port:  # the job failed before it had a store
        os._exit(1)
    os.environ.update(env, MASTER_PORT=port)
    _script(script, args)


def _script(script: str, args: list[str]) -> None:
    """Run `script` as `python script args` would, ending this process (see _rank)."""
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python script` puts it
    import runpy
    runpy.run_path(script, run_name="__main__")
    raise SystemExit(0)


def _job(cmd: dict) -> None:
    """The job process: fork the ranks, host their store, supervise them as torchrun does; never returns."""
    os.setsid()  # the test can kill the job and its ranks as one process group
    fd = os.open(cmd["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    # into the job's log: a job of no ranks, and each rank (forked below, it keeps the handler); the job process
    # itself answers with _dump_job once its ranks are forked
    faulthandler.register(DUMP_SIGNAL, all_threads=True)
    os.environ.clear()
    os.environ.update(cmd["env"])
    os.chdir(cmd["cwd"])
    nproc = cmd["nproc"]
    if nproc is None:
        _script(cmd["script"], cmd["args"])
    ranks, pipes = {}, []
    for rank in range(nproc):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(w)
            for other in pipes:
                os.close(other)
            _rank(cmd["script"], cmd["args"], {
                "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc),
                "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1",
                "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(nproc), "ROLE_NAME": "default",
                "MASTER_ADDR": "127.0.0.1", "TORCHELASTIC_USE_AGENT_STORE": "True",
                "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
                "TORCHELASTIC_RUN_ID": f"launcher-{os.getpid()}"}, r)
        os.close(r)
        ranks[pid] = rank
        pipes.append(w)
    signal.signal(DUMP_SIGNAL, lambda *_: _dump_job(ranks))
    code = 1
    try:
        import torch.distributed as dist
        store = dist.TCPStore("127.0.0.1", 0, nproc, is_master=True, wait_for_workers=False)
        for w in pipes:
            os.write(w, f"{store.port}\n".encode())
            os.close(w)
        code = _supervise(ranks)
    except BaseException:  # noqa: BLE001  (into the job's log; the ranks see their pipe close and exit)
        import traceback
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _dump_job(ranks: dict[int, int]) -> None:
    """The job process's answer to DUMP_SIGNAL: which rank each pid still running is, and its own stack."""
    print(f"[rank_launcher] the job process; its ranks still running, by pid: {ranks}", file=sys.stderr, flush=True)
    faulthandler.dump_traceback(all_threads=True)


def _supervise(ranks: dict[int, int]) -> int:
    signal.signal(signal.SIGTERM, lambda *_: [_signal(p, signal.SIGTERM) for p in ranks])
    failed = None
    while ranks:
        pid, st = os.wait()
        rank = ranks.pop(pid, None)
        if rank is None or _status(st) == 0:
            continue
        print(f"[rank_launcher] rank {rank} (pid {pid}) exited with {_status(st)}", file=sys.stderr, flush=True)
        if failed is None:
            failed = rank
            for p in ranks:
                _signal(p, signal.SIGTERM)
            deadline = time.monotonic() + STOP_GRACE_S
            while ranks and time.monotonic() < deadline:
                done, _ = os.waitpid(-1, os.WNOHANG)
                if done:
                    ranks.pop(done, None)
                else:
                    time.sleep(0.05)
            for p in ranks:
                _signal(p, signal.SIGKILL)
    return 0 if failed is None else 1


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _running(group: int) -> bool:
    try:
        os.killpg(group, 0)
        return True
    except ProcessLookupError:
        return False


def serve() -> None:
    _preload()
    import ctypes
    # PR_SET_CHILD_SUBREAPER: the ranks of a job whose process was killed become this process's children, so
    # they are reaped here and a job is over only when its last process is (what EOF on torchrun's pipes says)
    ctypes.CDLL(None).prctl(36, 1)
    out = sys.stdout
    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    # job pid -> its exit status, None while it runs. Only this session's jobs are kept, each from its spawn:
    # pids wrap (pid_max is 32768 here), and a status kept from an earlier process of the same pid would
    # answer a wait for a job not yet started (exit 0, empty log).
    jobs: dict[int, int | None] = {}

    def reap() -> None:
        while True:
            try:
                done, st = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if not done:
                return
            if done in jobs:  # else an orphaned rank, reaped as subreaper
                jobs[done] = _status(st)

    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "spawn":
            pid = os.fork()
            if pid == 0:
                _job(cmd)
            jobs[pid] = None
            reply = {"pid": pid}
        elif cmd["op"] == "wait":
            deadline = time.monotonic() + cmd["timeout"]
            job = cmd["pid"]  # also its process group (the job called setsid)
            reap()
            while (jobs[job] is None or _running(job)) and time.monotonic() < deadline:
                time.sleep(0.02)
                reap()
            reply = {"status": None if _running(job) else jobs[job]}
        elif cmd["op"] == "kill":
            try:
                os.killpg(cmd["pid"], signal.SIGKILL)
            except ProcessLookupError:
                pass
            reply = {}
        else:
            raise ValueError(f"rank_launcher: unknown op {cmd['op']!r}")
        out.write(json.dumps(reply) + "\n")
        out.flush()


class LineServer:
    """A child process that answers each JSON line on its stdin with one on its stdout, after a first
    {"ready": true} (this launcher, and crash_harness's zygote)."""

    def __init__(self, argv: list[str], env: dict):
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT,
                                     env=env)
        assert self._read().get("ready"), f"{argv} did not start"

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.proc.args[1]} died (exit {self.proc.poll()})")
        return json.loads(line)

    def _call(self, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)
        except Exception:  # noqa: BLE001
            self.proc.kill()


class JobTimedOut(subprocess.TimeoutExpired):
    """A job killed past its timeout; its message ends with the job's log, every process's stacks last."""

    def __str__(self) -> str:
        return f"{super().__str__()}; the end of its log (each process's threads last):\n{self.output[-LOG_TAIL:]}"


def _group(group: int) -> list[int]:
    """The pids of process group `group`, the job process (its leader) first."""
    pids = []
    for name in os.listdir("/proc"):
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # after the command's name, which may hold spaces
        except (OSError, IndexError):
            continue
        if name.isdigit() and int(fields[2]) == group:
            pids.append(int(name))
    return sorted(pids, key=lambda p: (p != group, p))


def _dump_stacks(group: int, log: str) -> None:
    """Each process of the job in turn writes its threads' stacks into the job's log (DUMP_SIGNAL), under a line
    naming its pid (the job process, first, names its ranks' pids): one at a time, each once the log stopped
    growing."""
    for pid in _group(group):
        with open(log, "a") as f:
            f.write(f"\n[rank_launcher] past the timeout: the threads of pid {pid}"
                    f"{' (the job process)' if pid == group else ''}:\n")
        try:
            os.kill(pid, DUMP_SIGNAL)
        except ProcessLookupError:
            continue
        size, still, deadline = -1, time.monotonic(), time.monotonic() + DUMP_MAX_S
        while time.monotonic() < deadline and time.monotonic() - still < DUMP_SETTLE_S:
            now = os.path.getsize(log)
            if now != size:
                size, still = now, time.monotonic()
            time.sleep(0.1)


class Launcher(LineServer):
    """The test side: one launcher process per interpreter, started on first use."""
    _started: dict[str, "Launcher"] = {}

    @classmethod
    def for_python(cls, python: str) -> "Launcher":
        launcher = cls._started.get(python)
        if launcher is None or launcher.proc.poll() is not None:
            launcher = cls._started[python] = cls(python)
        return launcher

    def __init__(self, python: str):
        super().__init__([python, os.path.abspath(__file__)], environment())

    def run(self, nproc: int | None, script: str, args: list[str], env: dict, cwd: str,
            timeout: float) -> tuple[int, str]:
        """Run `script` on `nproc` ranks (None: as one plain process) with environment `env`; (exit code, the
        output, the ranks' interleaved).
        Raises JobTimedOut, a subprocess.TimeoutExpired (after dumping every process's stacks into the log and
        killing the job), past `timeout` seconds."""
        with tempfile.NamedTemporaryFile("r", prefix="rank_launcher_", suffix=".log") as log:
            pid = self._call(op="spawn", nproc=nproc, script=script, args=list(args), env=env, cwd=cwd,
                             log=log.name)["pid"]
            status = self._call(op="wait", pid=pid, timeout=timeout)["status"]
            if status is None:
                _dump_stacks(pid, log.name)
                self._call(op="kill", pid=pid)
                self._call(op="wait", pid=pid, timeout=30)
                raise JobTimedOut([script, *args], timeout, output=log.read())
            return status, log.read()


def run_python(script: str, *args: str, env: dict | None = None, cwd: str = ROOT, timeout: float = 300,
               python: str = sys.executable) -> tuple[int, str]:
    """`python script args` (relative to ROOT), forked from the launcher of `python`: (exit code, output)."""
    return Launcher.for_python(python).run(None, os.path.join(ROOT, script), list(args), environment(env), cwd,
                                           timeout)


if __name__ == "__main__":
    serve()
