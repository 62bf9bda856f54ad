"""Shared helpers of the tests/test_megatron_*.py tests: run pretrain_gpt.py on ranks, parse its log."""
from __future__ import annotations

import os
import re
import sys

from rank_launcher import ROOT, Launcher, environment

TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--vocab-size", "128", "--micro-batch-size", "2", "--lr", "1e-3", "--mock-data", "--seed", "1234"]
LOSS_RE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.* lm loss: ([^ ]+) \|")


def _script(faults: bool) -> str:
    """pretrain_gpt.py, or tests/fault_launcher.py around it (it reads FAULT_* from the environment)."""
    return os.path.join(ROOT, "tests", "fault_launcher.py") if faults else os.path.join(ROOT, "pretrain_gpt.py")


def torchrun_command(nproc: int, args: list[str], env: dict | None = None, faults: bool = False,
                     python: str = sys.executable) -> tuple[list[str], dict]:
    """(command, environment) of a real torchrun of pretrain_gpt.py (or `faults`: tests/fault_launcher.py) with
    `python` (another environment's interpreter for cross-version tests), on a port torchrun picks itself: for
    the tests whose subject is torchrun (signals to it, whole-job kills)."""
    cmd = [python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), _script(faults),
           *args]
    return cmd, environment(env)


def torchrun(nproc: int, args: list[str], env: dict | None = None, timeout: int = 240, check: bool = True,
             faults: bool = False, python: str = sys.executable):
    """Run pretrain_gpt.py (or `faults`: tests/fault_launcher.py) on `nproc` ranks as torchrun would, forked by
    tests/rank_launcher.py from a process that imported torch and megatron-core once; (exit code, output)."""
    rc, out = Launcher.for_python(python).run(nproc, _script(faults), args, environment(env), ROOT, timeout)
    if check and rc != 0:
        raise AssertionError(f"the {nproc}-rank job exited with {rc}:\n{out[-6000:]}")
    return rc, out


def losses(log: str) -> dict[int, str]:
    """iteration -> the printed loss string (repr of the float: compared exactly)."""
    return {int(m.group(1)): m.group(2) for m in LOSS_RE.finditer(log)}


def iter_dir(root: str, it: int) -> str:
    return os.path.join(root, f"iter_{it:07d}")


def saving_run(nproc: int, flags: list[str], root: str, every: int, iterations: int) -> dict[int, str]:
    """A run of `flags` (with `iterations` as its --train-iters) saving lazily every `every` iterations to
    `root`; its losses, checked to cover every iteration."""
    _, log = torchrun(nproc, flags + ["--save", root, "--save-interval", str(every), "--async-ckpt"])
    out = losses(log)
    assert sorted(out) == list(range(1, iterations + 1)), log[-3000:]
    return out


def convert(nproc: int, flags: list[str], load: str, save: str, iteration: int) -> str:
    """--save-after-load with --train-iters `iteration`: load that iteration, write it in the layout of `flags`,
    train nothing; the new checkpoint's directory."""
    flags = list(flags)
    flags[flags.index("--train-iters") + 1] = str(iteration)
    _, log = torchrun(nproc, flags + ["--load", load, "--save", save, "--save-after-load"])
    assert os.path.isfile(os.path.join(iter_dir(save, iteration), "metadata.json")), log[-3000:]
    return iter_dir(save, iteration)
