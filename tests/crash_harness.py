"""Crash-consistency harness: multi-rank lazy checkpointing killed with SIGKILL at random moments.

A small deterministic "training" job (2 ranks, gloo) drives the engine directly: every iteration it fences,
mutates a few MB of state as a pure function of (rank, iteration), and saves lazily; it resumes from
`tracker.read_latest` after `clean_stale` on rank 0 and a barrier. So the exact content of every checkpoint is
computable from its iteration number alone.

A trial starts the job (resuming from whatever the previous trial left), SIGKILLs one rank or the whole job after
a random (seeded) delay, and then checks on what is on disk:

  - the tracker (`latest_checkpointed_iteration.txt`), if present, names a published directory;
  - every published checkpoint loads bit-exact for every rank (expected content computed from its iteration);
  - the latest published iteration never goes backwards (a lost checkpoint);
  - the next start removes every leftover of the killed save (`.partial`, `.deleting`, tracker temp files) and
    resumes from exactly the iteration `read_latest` names, verifying the loaded state bit-exact.

Which phase a kill landed in is read back from the disk (a `.partial` without manifests: snapshot/flush; with some
manifests; with all of them but unpublished; metadata written but not renamed; published but the tracker still
old; retention leftovers). The last trial lets a resumed run finish.

Starting Python + torch costs seconds on a loaded machine, so the ranks are forked from a "zygote" process that
imported torch and datastates once (it never starts a thread before forking).

Standalone long mode:   python tests/crash_harness.py --trials 500 [--seed 1] [--mb 8] [--dir /tmp/crash]
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import time

from rank_launcher import LineServer

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
WORLD = 2
N_TENSORS = 4
PHASES = ("before ready (start-up, clean, resume)", "snapshot/flush (.partial, no manifest)",
          "manifest (some ranks done)", "all manifests, unpublished", "metadata written, not renamed",
          "published, tracker not updated", "retention pending", "retention (.deleting leftover)",
          "tracker temp file", "between saves (nothing in flight)")


# ----------------------------------------------------------------------------------- the deterministic state

_bases: dict = {}


def _base(rank: int, k: int, numel: int):
    import torch
    key = (rank, k, numel)
    if key not in _bases:
        gen = torch.Generator().manual_seed(1000 * rank + k + 1)
        _bases[key] = torch.randn(numel, generator=gen)
    return _bases[key]


def tensor_numel(mb: float) -> int:
    return max(1, int(mb * (1 << 20) / 4 / N_TENSORS))


def expected_state(rank: int, iteration: int, mb: float) -> dict:
    """The state of `rank` after optimizer step `iteration` (0: the initial state)."""
    import torch
    numel = tensor_numel(mb)
    state = {f"w{k}": torch.add(_base(rank, k, numel), iteration) for k in range(N_TENSORS)}
    state["idx"] = torch.arange(1000, dtype=torch.int64) * iteration + rank
    state["meta"] = {"iteration": iteration, "rank": rank, "tag": f"r{rank}i{iteration}"}
    return state


def mutate(state: dict, rank: int, iteration: int, mb: float) -> None:
    """The "optimizer step": in place, bit-identical to expected_state(rank, iteration)."""
    import torch
    numel = tensor_numel(mb)
    for k in range(N_TENSORS):
        state[f"w{k}"].copy_(_base(rank, k, numel)).add_(iteration)
    torch.mul(torch.arange(1000, dtype=torch.int64), iteration, out=state["idx"]).add_(rank)
    state["meta"] = {"iteration": iteration, "rank": rank, "tag": f"r{rank}i{iteration}"}


def same(a, b) -> bool:
    import torch
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)))
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


# ------------------------------------------------------------------------------------------ the job (a rank)

def driver(a: argparse.Namespace) -> int:
    """One rank of the job. Prints CLEANED / RESUMED / READY / CKPT-ERROR / DONE lines to stdout."""
    import datetime

    import torch
    import torch.distributed as dist

    from datastates import CheckpointEngine, PosixOptions, CheckpointError, paths, tracker

    def log(*words):
        print(*words, flush=True)

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{a.store}", rank=a.rank, world_size=a.world,
                            timeout=datetime.timedelta(seconds=a.barrier_timeout))
    eng = CheckpointEngine(host_buffer_bytes=int(a.budget_mb * (1 << 20)),
                           storage=PosixOptions(writer_threads=2, fsync=a.fsync),
                           keep_last=a.keep_last, publish_timeout_s=a.publish_timeout)
    if a.rank == 0:
        log("CLEANED", json.dumps(sorted(tracker.clean_leftovers(a.root))))
    dist.barrier()
    latest = tracker.read_latest(a.root)
    state = expected_state(a.rank, 0, a.mb)
    if latest is not None:
        state = eng.load(paths.checkpoint_dir(a.root, latest), template=state)
        if not same(state, expected_state(a.rank, latest, a.mb)):
            log("MISMATCH", latest)
            return 5
        log("RESUMED", latest)
    log("READY")
    for it in range((latest or 0) + 1, a.iters + 1):
        eng.wait_for_snapshot()  # the fence, right before the step mutates saved state
        mutate(state, a.rank, it, a.mb)
        eng.save(state, paths.checkpoint_dir(a.root, it))
        try:  # the "stop" policy: a failed save ends the job (maybe_finalize raises or returns it, by version)
            failed = [h.error for h in eng.maybe_finalize() or [] if getattr(h, "error", None) is not None]
        except CheckpointError as e:
            failed = [e]
        if failed:
            log("CKPT-ERROR", str(failed[0]).replace("\n", " "))
            return 3
    try:
        eng.wait()
    except CheckpointError as e:
        log("CKPT-ERROR", str(e).replace("\n", " "))
        return 3
    log("DONE", tracker.read_latest(a.root))
    eng.close()
    return 0


def driver_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--store", required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, default=WORLD)
    p.add_argument("--iters", type=int, default=10 ** 6)
    p.add_argument("--mb", type=float, default=8.0)
    p.add_argument("--budget-mb", type=float, default=2.0)
    p.add_argument("--keep-last", type=int, default=2)
    p.add_argument("--publish-timeout", type=float, default=30.0)
    p.add_argument("--barrier-timeout", type=float, default=60.0)
    p.add_argument("--fsync", type=int, default=1)
    return p


# -------------------------------------------------------------------------------------------------- zygote

def zygote_main() -> None:
    """Import once, then fork a rank per request. Protocol: one JSON object per line on stdin/stdout."""
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401

    import datastates  # noqa: F401
    from datastates import paths, tracker  # noqa: F401
    out = sys.stdout
    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    reaped: dict[int, int] = {}
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "spawn":
            pid = os.fork()
            if pid == 0:
                code = 70
                try:
                    os.setpgid(0, 0)
                    fd = os.open(cmd["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                    os.dup2(fd, 1)
                    os.dup2(fd, 2)
                    sys.stdin.close()
                    code = driver(driver_parser().parse_args(cmd["args"]))
                except BaseException:  # noqa: BLE001
                    import traceback
                    traceback.print_exc()
                finally:
                    sys.stdout.flush()
                    sys.stderr.flush()
                    os._exit(code)
            reply = {"pid": pid}
        elif cmd["op"] == "wait":
            deadline = time.monotonic() + cmd["timeout"]
            status = reaped.get(cmd["pid"])
            while status is None:
                try:
                    done, st = os.waitpid(cmd["pid"], os.WNOHANG)
                except ChildProcessError:
                    break
                if done:
                    status = reaped[done] = -os.WTERMSIG(st) if os.WIFSIGNALED(st) else os.WEXITSTATUS(st)
                    break
                if time.monotonic() > deadline:
                    break
                time.sleep(0.01)
            reply = {"status": status}
        else:
            break
        out.write(json.dumps(reply) + "\n")
        out.flush()


class Zygote(LineServer):
    def __init__(self):
        super().__init__([sys.executable, os.path.abspath(__file__), "zygote"],
                         dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")))

    def spawn(self, args: list[str], log: str) -> int:
        return self._call(op="spawn", args=args, log=log)["pid"]

    def wait(self, pid: int, timeout: float):
        return self._call(op="wait", pid=pid, timeout=timeout)["status"]


# ------------------------------------------------------------------------------------------ trial checking

def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _log_lines(path: str) -> list[str]:
    try:
        with open(path) as f:
            return f.read().splitlines()
    except FileNotFoundError:
        return []


def _field(lines: list[str], word: str):
    for ln in lines:
        if ln.startswith(word + " ") or ln == word:
            return ln[len(word):].strip()
    return None


def inspect_disk(root: str, world: int, keep_last: int) -> tuple[set, list[str]]:
    """(phases the disk shows a save was killed in, leftover paths a next start must remove)."""
    from datastates import paths, tracker
    phases, leftovers = set(), []
    names = sorted(os.listdir(root)) if os.path.isdir(root) else []
    for n in names:
        path = os.path.join(root, n)
        if n.endswith(paths.PARTIAL):
            leftovers.append(path)
            inside = set(os.listdir(path))
            done = sum(paths.manifest_file(r) in inside for r in range(world))
            if paths.METADATA in inside:
                phases.add("metadata written, not renamed")
            elif done == 0:
                phases.add("snapshot/flush (.partial, no manifest)")
            elif done < world:
                phases.add("manifest (some ranks done)")
            else:
                phases.add("all manifests, unpublished")
        elif paths.DELETING in n:
            leftovers.append(path)
            phases.add("retention (.deleting leftover)")
        elif n.startswith(paths.TRACKER) and ".tmp." in n:
            leftovers.append(path)
            phases.add("tracker temp file")
    published = tracker.published_iterations(root)
    named = _tracker(root)
    if published and (named is None or named < published[-1]):
        phases.add("published, tracker not updated")
    elif len(published) > keep_last:
        phases.add("retention pending")
    if not phases:
        phases.add("between saves (nothing in flight)")
    return phases, leftovers


def _tracker(root: str):
    from datastates import paths
    try:
        with open(os.path.join(root, paths.TRACKER)) as f:
            text = f.read().strip()
    except FileNotFoundError:
        return None
    return int(text) if text.isdigit() else text


class Verifier:
    """Loads published checkpoints in this process and compares them with the computed expectation."""

    def __init__(self, mb: float):
        from datastates import CheckpointEngine, PosixOptions
        self.mb = mb
        self.engine = CheckpointEngine(host_buffer_bytes=4 << 20, storage=PosixOptions(writer_threads=2), rank=0,
                                       world_size=WORLD)
        self.verified: dict[str, set] = collections.defaultdict(set)  # root -> iterations already checked
        self.loads = 0

    def check(self, root: str, previous_latest) -> tuple[int | None, list[str]]:
        """Check the invariants on `root`; returns (latest, violations)."""
        from datastates import paths, tracker
        bad = []
        named = _tracker(root)
        if named is not None and (not isinstance(named, int)
                                    or not tracker.is_published(paths.checkpoint_dir(root, named))):
            bad.append(f"tracker names {named!r}, which is not a published checkpoint")
        latest = tracker.read_latest(root)
        if previous_latest is not None and (latest is None or latest < previous_latest):
            bad.append(f"latest went back from {previous_latest} to {latest}: a published checkpoint was lost")
        for it in tracker.published_iterations(root):
            path = paths.checkpoint_dir(root, it)
            try:  # a checkpoint directory is identified by its metadata (re-saves replace the directory)
                stamp = (it, os.stat(os.path.join(path, paths.METADATA)).st_ino)
            except FileNotFoundError:
                bad.append(f"{path} vanished while checking")
                continue
            if stamp in self.verified[root]:
                continue
            for r in range(WORLD):
                try:
                    got = self.engine.load(path, rank=r)
                    self.loads += 1
                except Exception as e:  # noqa: BLE001
                    bad.append(f"published {path} rank {r} does not load: {type(e).__name__}: {e}")
                    continue
                if not same(got, expected_state(r, it, self.mb)):
                    bad.append(f"published {path} rank {r} is not bit-exact with iteration {it}")
            self.verified[root].add(stamp)
        return latest, bad

    def close(self):
        self.engine.close()


# ------------------------------------------------------------------------------------------------- trials

class Campaign:
    def __init__(self, workdir: str, seed: int = 0, mb: float = 8.0, budget_mb: float = 2.0, keep_last: int = 2,
                 max_delay: float = 1.5, verbose: bool = False):
        self.workdir, self.mb, self.budget_mb, self.keep_last = workdir, mb, budget_mb, keep_last
        self.max_delay = max_delay
        self.rng = random.Random(seed)
        self.root = os.path.join(workdir, "ckpt")
        self.logs = os.path.join(workdir, "logs")
        os.makedirs(self.root, exist_ok=True)
        os.makedirs(self.logs, exist_ok=True)
        self.zygote = Zygote()
        self.verifier = Verifier(mb)
        self.runs = 0
        self.latest = None
        self.leftovers: list[str] = []
        self.stats = collections.Counter()
        self.phases = collections.Counter()
        self.violations: list[str] = []
        self.verbose = verbose

    def _start(self, iters: int) -> tuple[list[int], list[str]]:
        self.runs += 1
        store = os.path.join(self.workdir, f"store_{self.runs}")
        pids, logs = [], []
        for r in range(WORLD):
            log = os.path.join(self.logs, f"run{self.runs:04d}_rank{r}.log")
            args = ["--root", self.root, "--store", store, "--rank", str(r), "--world", str(WORLD),
                    "--iters", str(iters), "--mb", str(self.mb), "--budget-mb", str(self.budget_mb),
                    "--keep-last", str(self.keep_last)]
            pids.append(self.zygote.spawn(args, log))
            logs.append(log)
        return pids, logs

    def _check_start(self, logs: list[str], trial: str) -> None:
        """The start of a run resumed from exactly `latest`, bit-exact, after removing every leftover."""
        lines = [_log_lines(p) for p in logs]
        cleaned = _field(lines[0], "CLEANED")
        if cleaned is not None:
            missed = set(self.leftovers) - set(json.loads(cleaned))
            if missed:
                self.violations.append(f"{trial}: leftovers not cleaned at the next start: {sorted(missed)}")
            self.stats["leftovers cleaned"] += len(self.leftovers)
        for r, ln in enumerate(lines):
            if any(x.startswith("MISMATCH") for x in ln):
                self.violations.append(f"{trial}: rank {r} resumed state is not bit-exact")
            resumed = _field(ln, "RESUMED")
            if "READY" in ln:
                want = None if self.latest is None else str(self.latest)
                if resumed != want:
                    self.violations.append(f"{trial}: rank {r} resumed from {resumed}, latest was {want}")
                else:
                    self.stats["resumes verified"] += 1

    def _ready(self, logs: list[str], pids: list[int], timeout: float = 180.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            lines = [_log_lines(p) for p in logs]
            if all("READY" in ln for ln in lines):
                return True
            if any(x.startswith(("MISMATCH", "Traceback", "CKPT-ERROR")) for ln in lines for x in ln):
                return False
            time.sleep(0.02)
        return False

    def trial(self, index: int) -> None:
        name = f"trial {index}"
        pids, logs = self._start(10 ** 6)
        early = self.rng.random() < 0.1
        mode = self.rng.choice(["job", "rank0", "rank1"])
        delay = self.rng.uniform(0, self.max_delay if not early else 0.3)
        if not early and not self._ready(logs, pids):
            for p in pids:
                _kill(p)
            self.violations.append(f"{name}: the job did not get ready in time; logs: {logs}")
        time.sleep(delay)
        if mode == "job":
            for p in pids:
                _kill(p)
        else:
            victim = int(mode[-1])
            _kill(pids[victim])
            time.sleep(self.rng.uniform(0, 0.5))  # the launcher notices and tears the job down
            _kill(pids[1 - victim])
        for p in pids:
            if self.zygote.wait(p, 60) is None:
                self.violations.append(f"{name}: rank pid {p} survived SIGKILL")
        self._check_start(logs, name)
        phases, self.leftovers = inspect_disk(self.root, WORLD, self.keep_last)
        lines = [_log_lines(p) for p in logs]
        if not all("READY" in ln for ln in lines):
            phases = {"before ready (start-up, clean, resume)"} | (phases - {"between saves (nothing in flight)"})
        self.phases.update(phases)
        self.stats[f"kills: {'whole job' if mode == 'job' else 'one rank (' + mode + ') then the job'}"] += 1
        latest, bad = self.verifier.check(self.root, self.latest)
        self.violations.extend(f"{name}: {b}" for b in bad)
        if bad and any("lost" in b or "not bit-exact" in b or "does not load" in b for b in bad):
            self.stats["checkpoints lost"] += 1
        self.latest = latest if latest is not None else self.latest
        self.stats["trials"] += 1
        if self.verbose:
            print(f"{name}: {mode:5s} delay {delay:.2f}s latest {latest} phases {sorted(phases)}", flush=True)

    def finish(self, extra: int = 3) -> None:
        """A resumed run that is not killed carries on to the end."""
        target = (self.latest or 0) + extra
        pids, logs = self._start(target)
        statuses = [self.zygote.wait(p, 300) for p in pids]
        self._check_start(logs, "final run")
        for r, (st, log) in enumerate(zip(statuses, logs)):
            lines = _log_lines(log)
            if st != 0 or _field(lines, "DONE") != str(target):
                self.violations.append(f"final run rank {r}: exit {st}, log tail {lines[-5:]}")
        latest, bad = self.verifier.check(self.root, self.latest)
        self.violations.extend(f"final run: {b}" for b in bad)
        if latest != target:
            self.violations.append(f"final run: latest {latest}, expected {target}")
        self.latest = latest
        _, self.leftovers = inspect_disk(self.root, WORLD, self.keep_last)
        if self.leftovers:
            self.violations.append(f"final run left {self.leftovers}")

    def close(self):
        self.zygote.close()
        self.verifier.close()

    def table(self) -> str:
        rows = [("trials run (SIGKILL)", self.stats["trials"]),
                *[(k, v) for k, v in sorted(self.stats.items()) if k.startswith("kills")],
                ("resumed starts verified bit-exact (per rank)", self.stats["resumes verified"]),
                ("leftovers removed at next start", self.stats["leftovers cleaned"]),
                ("published checkpoint loads verified (per rank)", self.verifier.loads),
                ("checkpoints lost", self.stats["checkpoints lost"]),
                ("invariant violations", len(self.violations))]
        out = ["| what | count |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows]
        out += ["", "| kill landed in (from the disk) | trials |", "|---|---|"]
        out += [f"| {p} | {self.phases.get(p, 0)} |" for p in PHASES]
        return "\n".join(out)


def run_campaign(trials: int, workdir: str, seed: int = 0, mb: float = 8.0, verbose: bool = False,
                 max_delay: float = 1.5) -> Campaign:
    c = Campaign(workdir, seed=seed, mb=mb, verbose=verbose, max_delay=max_delay)
    try:
        for i in range(trials):
            c.trial(i)
        c.finish()
    finally:
        c.close()
    return c


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "zygote":
        zygote_main()
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trials", type=int, default=int(os.environ.get("CRASH_TRIALS", 30)))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mb", type=float, default=8.0, help="state per rank (MB)")
    p.add_argument("--max-delay", type=float, default=1.5)
    p.add_argument("--dir", default=None)
    p.add_argument("--keep", action="store_true", help="keep the work directory")
    p.add_argument("-v", "--verbose", action="store_true")
    a = p.parse_args()
    sys.path.insert(0, ROOT)
    workdir = a.dir or tempfile.mkdtemp(prefix="crash_harness_")
    t0 = time.monotonic()
    c = run_campaign(a.trials, workdir, seed=a.seed, mb=a.mb, verbose=a.verbose, max_delay=a.max_delay)
    print(c.table())
    print(f"\n{a.trials} trials in {time.monotonic() - t0:.0f} s; work dir {workdir}")
    for v in c.violations:
        print("VIOLATION:", v)
    if not a.keep and not c.violations:
        shutil.rmtree(workdir, ignore_errors=True)
    sys.exit(1 if c.violations else 0)


if __name__ == "__main__":
    main()
