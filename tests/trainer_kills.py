"""Whole-job kills of the real trainer: pretrain_gpt.py, 4 ranks (TP2 x DP2, or with --moe a mixture of experts on
EP2 x DP2; gloo) under torchrun, lazy async checkpoints every iteration with retention, SIGKILLed as a whole at
random moments, checked, and resumed. A kill waits for the run to publish a checkpoint of its own, then a random
extra delay (one run in ten is killed earlier instead, during start-up or its first saves), and always lands
KILL_MARGIN iterations before the end at the latest: whatever the machine's speed, a run neither dies before it
published anything nor finishes before its kill.

A whole-job kill must reach every process: torchrun starts its workers in sessions of their own, so a process
group kill misses them. The launcher's tree is walked through /proc, stopped (SIGSTOP: nothing forks or reacts
meanwhile; walked again until no new process shows up), then SIGKILLed, and every member is checked gone.

After each kill:
  - `tools/inspect_checkpoint.py SAVE --verify` passes (the latest published checkpoint: every byte, every
    checksum), and latest never went back;
  - the next run (the next trial, or the final one) removes the leftovers, resumes from exactly that latest
    iteration, and every loss it prints equals the loss any run printed for that iteration (CPU training is
    deterministic: a resume that is not exact shows as a different loss);
When the next run could not be killed before its end the save directory starts over ("cycles").

    python tests/trainer_kills.py --kills 200 [--seed 0] [--dir /tmp/kills] [--moe]
    (tests/test_trainer_kills.py runs one kill of each model)
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [HERE, ROOT]

import crash_harness  # noqa: E402
from megatron_helpers import LOSS_RE, TINY  # noqa: E402
from rank_launcher import environment  # noqa: E402

WORLD = 4
KEEP_LAST = 2
LOADED_RE = re.compile(r"successfully loaded checkpoint from .* at iteration (\d+)")
ITERATION_RE = re.compile(r"iteration\s+(\d+)/")
# A kill lands at least this many iterations before --train-iters (each with its save), so that no machine is fast
# enough for a run to finish between the decision to kill it and the kill: runs are killed by the iterations they
# reached and the checkpoints they published, not after a fixed time.
KILL_MARGIN = 5


DENSE = ["--tensor-model-parallel-size", "2"]  # TP2 x DP2
# EP2 x DP2: megatron-core's MoE layers and its chain of a dense and an expert distributed optimizer
MOE = ["--num-experts", "4", "--expert-model-parallel-size", "2", "--moe-router-topk", "2", "--disable-bias-linear",
       "--use-distributed-optimizer"]


def trainer_args(save: str, train_iters: int, model: list[str]) -> list[str]:
    return TINY + model + ["--global-batch-size", "8", "--train-iters", str(train_iters), "--save", save, "--load",
                           save, "--save-interval", "1", "--async-ckpt", "--ckpt-keep-last", str(KEEP_LAST)]


# -------------------------------------------------------------------------------------------- process trees

def _children() -> dict[int, list[int]]:
    kids = collections.defaultdict(list)
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue  # gone meanwhile
            kids[ppid].append(int(name))
    return kids


def tree(pid: int) -> set[int]:
    """`pid` and every process descended from it, whatever its session or process group."""
    kids, out, todo = _children(), set(), [pid]
    while todo:
        p = todo.pop()
        if p not in out:
            out.add(p)
            todo += kids.get(p, [])
    return out


def _alive(pid: int) -> bool:
    """Running (not gone, not a zombie waiting to be reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _survivors(pids: set[int], patience_s: float = 30.0) -> list[int]:
    """The processes still running once the kernel had time to tear the killed ones down."""
    deadline = time.monotonic() + patience_s
    while (alive := sorted(p for p in pids if _alive(p))) and time.monotonic() < deadline:
        time.sleep(0.05)
    return alive


def kill_tree(pid: int) -> set[int]:
    """Freeze the whole tree, then SIGKILL all of it; returns the processes killed."""
    members: set[int] = set()
    while True:
        new = tree(pid) - members
        if not new:
            break
        for p in new:
            try:
                os.kill(p, signal.SIGSTOP)
            except ProcessLookupError:
                pass
        members |= new
    for p in members:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return members


# ---------------------------------------------------------------------------------------------------- trials

@dataclasses.dataclass
class Run:
    log: str
    loaded: int | None  # the iteration it resumed from (None: started from scratch, or killed before loading)
    started_fresh: bool
    losses: dict[int, str]


class Campaign:
    def __init__(self, workdir: str, seed: int = 0, train_iters: int = 30, max_delay: float = 3.0,
                 verbose: bool = False, model: list[str] = DENSE):
        self.workdir, self.train_iters, self.max_delay, self.verbose = workdir, train_iters, max_delay, verbose
        self.model = model
        self.rng = random.Random(seed)
        self.save = os.path.join(workdir, "ckpt")
        self.losses: dict[int, str] = {}  # iteration -> the loss every run must print for it
        self.latest: int | None = None
        self.runs = 0
        self.stats = collections.Counter()
        self.phases = collections.Counter()
        self.violations: list[str] = []

    def _start(self) -> tuple[subprocess.Popen, str]:
        self.runs += 1
        log = os.path.join(self.workdir, f"run{self.runs:04d}.log")
        # --standalone: torchrun's store binds port 0 and the workers meet there (no port probed, then released)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(WORLD),
               os.path.join(ROOT, "pretrain_gpt.py"), *trainer_args(self.save, self.train_iters, self.model)]
        env = environment()
        with open(log, "w") as out:
            proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        return proc, log

    def _read(self, log: str) -> Run:
        with open(log, errors="replace") as f:
            text = f.read()
        loaded = LOADED_RE.search(text)
        return Run(log, int(loaded.group(1)) if loaded else None, "could not find a checkpoint" in text,
                   {int(i): loss for i, loss in LOSS_RE.findall(text)})

    def _check_run(self, run: Run, name: str, before: int | None) -> None:
        """The run resumed from exactly `before` (the latest when it started), and printed the same losses as
        every other run for the same iterations."""
        if run.loaded is not None or run.started_fresh:
            if run.loaded != before:
                self.violations.append(f"{name}: resumed from {run.loaded}, latest was {before} ({run.log})")
            else:
                self.stats["resumes verified (right iteration)"] += 1
        for it, loss in sorted(run.losses.items()):
            if before is not None and it <= before:
                self.violations.append(f"{name}: printed iteration {it}, at or before its resume point {before}")
            elif it in self.losses and self.losses[it] != loss:
                self.violations.append(f"{name}: iteration {it} loss {loss}, another run printed {self.losses[it]}")
            elif it in self.losses:
                self.stats["losses re-computed after a resume, identical"] += 1
            self.losses.setdefault(it, loss)
        self.stats["iterations trained"] += len(run.losses)

    def _check_disk(self, name: str) -> None:
        from datastates import tracker
        phases, _ = crash_harness.inspect_disk(self.save, WORLD, KEEP_LAST)
        self.phases.update(phases)
        latest = tracker.read_latest(self.save)
        if self.latest is not None and (latest is None or latest < self.latest):
            self.violations.append(f"{name}: latest went back from {self.latest} to {latest}")
        if latest is not None:
            p = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "inspect_checkpoint.py"), self.save,
                                "--verify"], cwd=ROOT, capture_output=True, text=True,
                               env=dict(os.environ, PYTHONPATH=ROOT))
            if p.returncode != 0:
                self.violations.append(f"{name}: inspect_checkpoint --verify failed ({p.returncode}): "
                                       f"{(p.stdout + p.stderr)[-1500:]}")
            else:
                self.stats["latest checkpoints verified (inspect_checkpoint --verify)"] += 1
        self.latest = latest

    def _cycle_if_done(self) -> None:
        """Start over when too few iterations are left for the next run to be killed (`KILL_MARGIN`)."""
        if self.latest is not None and self.latest + 1 >= self.train_iters - KILL_MARGIN:
            shutil.rmtree(self.save)
            self.latest = None
            self.stats["cycles (too near the end for another kill, started over)"] += 1

    def trial(self, index: int) -> None:
        name = f"kill {index}"
        before = self.latest
        proc, log = self._start()
        early = self.rng.random() < 0.1  # during start-up: clean-up, load, first iterations and saves
        delay = self.rng.uniform(0, 8.0 if early else self.max_delay)
        if not early:  # a kill in a later save: once this run has published a checkpoint of its own
            self._wait(proc, log, before, published=True)
        self._wait(proc, log, before, seconds=delay, published=early)
        killed = kill_tree(proc.pid) if proc.poll() is None else set()
        code = proc.wait()
        survivors = _survivors(killed)
        if survivors:
            self.violations.append(f"{name}: processes {survivors} survived the whole-job kill")
        self.stats["kills (whole job)" if killed else "runs that finished before their kill"] += 1
        self.stats["processes killed"] += len(killed)
        run = self._read(log)
        if not killed and code != 0:
            self.violations.append(f"{name}: the run failed on its own (exit {code}); log {log}")
        self._check_run(run, name, before)
        self._check_disk(name)
        if self.verbose:
            print(f"{name}: {'killed' if killed else 'finished'} {len(killed)} processes; resumed from "
                  f"{run.loaded}, printed {min(run.losses, default=None)}..{max(run.losses, default=None)}, "
                  f"latest now {self.latest}", flush=True)
        self._cycle_if_done()

    def _wait(self, proc: subprocess.Popen, log: str, before: int | None, seconds: float = 240.0,
              published: bool = False) -> None:
        """Wait `seconds` (or, with `published`, until the run publishes a checkpoint after `before`), no longer
        than until the run prints iteration --train-iters - KILL_MARGIN, or ends."""
        from datastates import tracker
        deadline, last = time.monotonic() + seconds, self.train_iters - KILL_MARGIN
        while proc.poll() is None and time.monotonic() < deadline:
            with open(log, errors="replace") as f:
                if max(map(int, ITERATION_RE.findall(f.read())), default=0) >= last:
                    return
            if published and (tracker.read_latest(self.save) or 0) > (before or 0):
                return
            time.sleep(0.05)

    def finish(self) -> None:
        """A last run is not killed: it resumes (checked like the others) and trains to the end."""
        before = self.latest
        proc, log = self._start()
        code = proc.wait()
        run = self._read(log)
        if code != 0:
            self.violations.append(f"final run: exit {code}; log {log}")
        self._check_run(run, "final run", before)
        self._check_disk("final run")
        if self.latest != self.train_iters:
            self.violations.append(f"final run: latest {self.latest}, expected {self.train_iters}")
        _, leftovers = crash_harness.inspect_disk(self.save, WORLD, KEEP_LAST)
        if leftovers:
            self.violations.append(f"final run left {leftovers}")

    def table(self) -> str:
        rows = [*sorted(self.stats.items()), ("invariant violations", len(self.violations))]
        out = ["| what | count |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows]
        out += ["", "| kill landed in (from the disk) | kills |", "|---|---|"]
        out += [f"| {p} | {self.phases[p]} |" for p in crash_harness.PHASES if self.phases[p]]
        return "\n".join(out)


def run_campaign(kills: int, workdir: str, seed: int = 0, verbose: bool = False, **kw) -> Campaign:
    c = Campaign(workdir, seed=seed, verbose=verbose, **kw)
    for i in range(kills):
        c.trial(i)
    c.finish()
    return c


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kills", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--train-iters", type=int, default=30)
    p.add_argument("--max-delay", type=float, default=3.0,
                   help="seconds after the run's first checkpoint before a kill, at most")
    p.add_argument("--dir", default=None, help="work directory (default: a fresh temporary one)")
    p.add_argument("--moe", action="store_true", help="kill a mixture-of-experts run (EP2 x DP2) instead")
    p.add_argument("-v", "--verbose", action="store_true")
    a = p.parse_args()
    workdir = a.dir or tempfile.mkdtemp(prefix="trainer_kills_")
    os.makedirs(workdir, exist_ok=True)
    t0 = time.monotonic()
    c = run_campaign(a.kills, workdir, seed=a.seed, verbose=a.verbose, train_iters=a.train_iters,
                     max_delay=a.max_delay, model=MOE if a.moe else DENSE)
    print(c.table())
    for v in c.violations:
        print("VIOLATION:", v)
    print(f"\n{a.kills} trials, {c.runs} trainer runs in {time.monotonic() - t0:.0f} s; work dir {workdir}")
    sys.exit(1 if c.violations else 0)


if __name__ == "__main__":
    main()
