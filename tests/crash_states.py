"""Crash-state explorer (in the manner of ALICE, OSDI'14, and CrashMonkey, OSDI'18): power loss and kernel
crashes during real multi-rank saves, not only SIGKILL (which keeps the page cache).

1. Record. A real job runs under strace (`fs_trace`): 2 ranks (gloo, TCPStore), `CheckpointEngine` with
   `keep_last=2`, lazy saves of a state that is a pure function of (rank, iteration) (`crash_harness`), in three
   runs: a fresh run saving iterations 1-4, a restart (clean-up, resume from latest) saving 5-7, and a restart
   that resumes from 6 and re-saves 7 (the re-save path of `storage.posix.publish`), then 8. Every system call that
   changes the checkpoint root is recorded with its data, from the native writer threads and from Python. Rank 0
   writes the iteration to a marks file outside the root each time its `wait()` returns: from then on that
   iteration is *durable* by the engine's contract.
2. Construct. For each crash point k (a prefix of the operation log) the states a crash can leave are built from
   the operations alone (`crash_fs`: fsync and directory-fsync guarantees, nothing more): the systematic ones
   (keep all; drop all unsynced; unsynced directory operations only; unsynced data only; drop each single
   unsynced directory operation; the newest unsynced write torn) and seeded random subsets with torn writes.
   Identical trees are checked once.
3. Check. Each distinct state is materialised into a fresh directory, then:
   - before any clean-up (what a tool sees), `tracker.read_latest` never raises and names a checkpoint that
     verifies;
   - at the next start (`tracker.clean_leftovers`, then `read_latest`, as the trainer does) latest names an iteration
     no older than the newest durable one, no newer than any saved, and every rank of it loads (crc32c verified
     by `CheckpointEngine.load`) bit-exact with what that iteration saved;
   - `clean_leftovers` leaves only published checkpoints and the tracker, and every published checkpoint left
     loads bit-exact (a published checkpoint is complete).

    python tests/crash_states.py --summary            # ~2,500 distinct states, under a minute on 2 cores
    python tests/crash_states.py --samples 0 --stride 4  # a short run (tests/test_crash_states.py)

The last line of output is `crash states: N checked, V violations`; the exit status is 1 if V > 0.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import hashlib
import os
import re
import shutil
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [HERE, ROOT]  # the datastates next to these tests, also in a copy of the tree

import crash_fs  # noqa: E402
import crash_harness  # noqa: E402
import fs_trace  # noqa: E402
from datastates import CheckpointEngine, PosixOptions, paths, tracker  # noqa: E402

WORLD = 2
MB = 0.0625  # state per rank: 4 tensors of 16 KiB, plus an index and objects
BUDGET = 96 << 10  # 16 KiB staging slots: several writes per data file
KEEP_LAST = 2
# (resume from: "latest" or an iteration; last iteration saved; iterations after whose save rank 0 waits)
RUNS = (("none", 4, (2,)), ("latest", 7, (5,)), ("6", 8, (7,)))


# ------------------------------------------------------------------------------------------- the traced job

def rank_main(root: str, marks: str, rank: int, port_pipe: tuple[int, int], resume: str, last: int,
              wait_at: tuple[int, ...], compress: str = "off") -> None:
    """One rank of one run: clean up, resume, save lazily (the fence before every mutation). Rank 0 serves the
    run's TCPStore on a port the kernel picks (no race for a free port) and hands it to the others by a pipe."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=120)
    read_end, write_end = port_pipe
    if rank == 0:
        os.close(read_end)
        store = dist.TCPStore("127.0.0.1", 0, WORLD, is_master=True, timeout=timeout, wait_for_workers=False)
        os.write(write_end, b"%d\n" % store.port * (WORLD - 1))
    else:
        os.close(write_end)
        with os.fdopen(read_end) as f:
            port = int(f.readline())
        store = dist.TCPStore("127.0.0.1", port, WORLD, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD, timeout=timeout)
    eng = CheckpointEngine(host_buffer_bytes=BUDGET, storage=PosixOptions(writer_threads=2), keep_last=KEEP_LAST,
                           compress=compress)
    if rank == 0:
        tracker.clean_leftovers(root)
    dist.barrier()
    start = {"none": 0, "latest": tracker.read_latest(root) or 0}.get(resume, None)
    start = int(resume) if start is None else start
    state = crash_harness.expected_state(rank, 0, MB)
    if start:
        state = eng.load(paths.checkpoint_dir(root, start), template=state)
        assert crash_harness.same(state, crash_harness.expected_state(rank, start, MB)), "resume not bit-exact"

    def durable(it):
        eng.wait()
        if rank == 0:
            with open(marks, "a") as f:
                f.write(f"{it}\n")

    for it in range(start + 1, last + 1):
        eng.wait_for_snapshot()
        crash_harness.mutate(state, rank, it, MB)
        eng.save(state, paths.checkpoint_dir(root, it))
        if it in wait_at:
            durable(it)
    durable(last)
    eng.close()
    dist.barrier()  # rank 0's store outlives every client
    dist.destroy_process_group()


def job_main(root: str, marks: str, compress: str) -> None:
    """The traced process tree: the runs one after another, each a fresh set of rank processes forked from this
    one, which imported torch and datastates once (and never starts a thread): an import under strace costs
    seconds."""
    import torch.distributed  # noqa: F401

    os.environ["OMP_NUM_THREADS"] = "1"
    for resume, last, wait_at in RUNS:
        pipe = os.pipe()
        pids = []
        for r in range(WORLD):
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    rank_main(root, marks, r, pipe, resume, last, wait_at, compress)
                    code = 0
                finally:
                    sys.stdout.flush()
                    sys.stderr.flush()
                    os._exit(code)
            pids.append(pid)
        os.close(pipe[0])
        os.close(pipe[1])
        codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]
        if any(codes):
            sys.exit(f"traced run (resume {resume}, last {last}) failed: exit codes {codes}")


def record(work: str, compress: str = "off") -> tuple[list[crash_fs.Op], float]:
    """Run the job under strace (its saves compressed as `compress` says); (operations under the checkpoint root,
    seconds it took)."""
    root, marks, log = (os.path.join(work, n) for n in ("ckpt", "marks", "trace.log"))
    os.makedirs(root)
    t0 = time.monotonic()
    fs_trace.record([sys.executable, __file__, "_job", root, marks, compress], log, cwd=ROOT,
                    env=dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")))
    return fs_trace.parse(log, root, marks, ROOT), time.monotonic() - t0


# ------------------------------------------------------------------------------------------------- checking

class Checker:
    """Checks materialised states; loads are cached by the content of the checkpoint directory."""

    def __init__(self, work: str):
        self.work = work
        self.engine = CheckpointEngine(host_buffer_bytes=1 << 20, storage=PosixOptions(writer_threads=1), rank=0,
                                       world_size=WORLD)
        self.loads: dict[tuple[int, str], list[str]] = {}
        self.count = 0

    def close(self) -> None:
        self.engine.close()

    def _verify(self, root: str, it: int) -> list[str]:
        """Problems of checkpoint `it` under `root`: every rank must load bit-exact with what `it` saved."""
        path = paths.checkpoint_dir(root, it)
        h = hashlib.sha256()
        for name in sorted(os.listdir(path)):  # a checkpoint directory is flat
            with open(os.path.join(path, name), "rb") as f:
                h.update(name.encode() + b"\0" + f.read() + b"\0")
        key = (it, h.hexdigest())
        if key not in self.loads:
            problems = []
            for r in range(WORLD):
                try:
                    got = self.engine.load(path, rank=r)
                except Exception as e:  # noqa: BLE001 - any error is the finding
                    problems.append(f"iteration {it} rank {r} does not load: {type(e).__name__}: "
                                    f"{str(e).replace(root, '<root>')}")
                    continue
                if not crash_harness.same(got, crash_harness.expected_state(r, it, MB)):
                    problems.append(f"iteration {it} rank {r} loads but is not bit-exact with what it saved")
            self.loads[key] = problems
        return self.loads[key]

    def check(self, tree: crash_fs.Tree, durable: int | None, newest: int) -> list[str]:
        """Materialise `tree` and check it; `durable`: the newest iteration whose save's wait() had returned;
        `newest`: the newest iteration saved so far."""
        self.count += 1
        root = os.path.join(self.work, f"state_{self.count:06d}")
        tree.materialise(root)
        try:
            return self._check(root, durable, newest)
        finally:
            shutil.rmtree(root)

    def _check(self, root: str, durable: int | None, newest: int) -> list[str]:
        bad = []
        try:  # a reader before any clean-up (a tool): never an error, a checkpoint that verifies
            seen = tracker.read_latest(root)
        except Exception as e:  # noqa: BLE001
            return [f"read_latest raised {type(e).__name__}: {e}"]
        if seen is not None:
            bad += [f"latest before clean-up: {p}" for p in self._verify(root, seen)]
        try:  # the next start: clean_stale on one rank, then read_latest
            tracker.clean_leftovers(root)
            latest = tracker.read_latest(root)
            left = sorted(n for n in os.listdir(root) if n != paths.TRACKER and not (
                paths.iteration_of(n) is not None and tracker.is_published(os.path.join(root, n))))
        except Exception as e:  # noqa: BLE001
            return bad + [f"the next start's clean-up raised {type(e).__name__}: {e}"]
        if left:
            bad.append(f"clean_stale left {left}")
        if latest is None:
            if durable is not None:
                bad.append(f"no checkpoint found, but iteration {durable} was durable")
        elif durable is not None and latest < durable:
            bad.append(f"latest is iteration {latest}, older than iteration {durable}, which was durable")
        elif latest > newest:
            bad.append(f"latest is iteration {latest}, which was never saved")
        for it in tracker.published_iterations(root):  # latest, and every other published one: complete
            bad += [f"{'latest' if it == latest else 'published checkpoint'}: {p}" for p in self._verify(root, it)]
        return bad


# ---------------------------------------------------------------------------------------------- exploration

@dataclasses.dataclass
class Result:
    ops: int = 0
    crash_points: int = 0
    generated: int = 0
    checked: int = 0
    violations: list[str] = dataclasses.field(default_factory=list)
    kinds: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    record_s: float = 0.0
    explore_s: float = 0.0


_ITER = re.compile(r"iter_(\d+)")


def explore(work: str, samples: int = 6, stride: int = 1, seed: int = 0, log=print, compress: str = "off") -> Result:
    """Record the job, then build and check the crash states of every `stride`-th crash point."""
    res = Result()
    ops, res.record_s = record(work, compress)
    durable = crash_fs.durable_at(ops)
    res.ops = len(ops)
    res.kinds = collections.Counter(o.kind for o in ops)
    checker = Checker(work)
    seen: set[tuple] = set()
    t0 = time.monotonic()
    try:
        mark, newest = None, 0
        for k in range(len(ops) + 1):
            if k:
                prev = ops[k - 1]
                mark = prev.value if prev.kind == "mark" else mark
                newest = max([newest] + [int(n) for n in _ITER.findall(prev.path)])
            if k % stride and k != len(ops):
                continue
            res.crash_points += 1
            where = f"crash point {k}/{len(ops)} (after {ops[k - 1].describe() if k else 'nothing'})"
            fresh = 0
            for state in crash_fs.crash_states(ops, durable, k, samples, seed):
                res.generated += 1
                tree = state.build(ops, durable)
                key = (tree.fingerprint(), mark, newest)
                if key in seen:
                    continue
                seen.add(key)
                fresh += 1
                res.checked += 1
                for problem in checker.check(tree, mark, newest):
                    res.violations.append(f"VIOLATION {where}, state '{state.label}': {problem}")
                    if log:
                        log(res.violations[-1])
            if log and fresh:
                log(f"{where}: {fresh} new states, {res.checked} checked, {len(res.violations)} violations")
    finally:
        checker.close()
    res.explore_s = time.monotonic() - t0
    return res


def main() -> None:
    if len(sys.argv) == 5 and sys.argv[1] == "_job":
        job_main(sys.argv[2], sys.argv[3], sys.argv[4])
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--summary", action="store_true", help="print the totals and violations only")
    p.add_argument("--samples", type=int, default=6, help="random states per crash point (plus the systematic ones)")
    p.add_argument("--stride", type=int, default=1, help="check every n-th crash point")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compress", default="off", help="the saves' --ckpt-compress (docs/compression.md)")
    p.add_argument("--dir", default=None, help="work directory (default: a fresh temporary one, removed)")
    a = p.parse_args()
    if shutil.which("strace") is None:
        sys.exit("crash_states.py needs strace (apt-get install strace)")
    work = a.dir or tempfile.mkdtemp(prefix="crash_states_")
    try:
        res = explore(work, a.samples, a.stride, a.seed, log=None if a.summary else print, compress=a.compress)
    finally:
        if a.dir is None:
            shutil.rmtree(work, ignore_errors=True)
    if a.summary:
        for v in res.violations:
            print(v)
    kinds = ", ".join(f"{n} {k}" for k, n in sorted(res.kinds.items()))
    print(f"recorded {res.ops} operations under the checkpoint root ({kinds}) in {res.record_s:.0f} s")
    print(f"{res.crash_points} crash points, {res.generated} states built, {res.checked} distinct, checked in "
          f"{res.explore_s:.0f} s")
    print(f"crash states: {res.checked} checked, {len(res.violations)} violations")
    sys.exit(1 if res.violations else 0)


if __name__ == "__main__":
    main()
