#!/usr/bin/env python
"""The share of bf16 weights that change per optimizer step at an RL learning rate (issue 68's case for deltas):
the real trainer, --bf16, Adam at --lr (default 1e-6), a version published every step (--publish-weights-interval 1,
all kept), then each version compared bit for bit with the one before it.

    python benchmarks/rl_change_rate.py [--quick] [--lr 1e-6] [--iters N] [--init-iters M]

`--init-iters M` first trains M steps at 1e-3 (a model that has moved off its initialisation), then the measured
steps from its weights (--finetune: a fresh Adam, as an RL run starting from a trained model) at --lr. Reports per step the share of elements changed, and the bytes of a delta that
names them (int32 index + bf16 value, 6 bytes an element) against the full version's.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
sys.path.insert(0, ROOT)

from hf_export import FULL, LLAMA, QUICK, _command  # noqa: E402


def train(flags: list[str]) -> None:
    cmd, env = _command(1, flags)
    run = subprocess.run(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if run.returncode != 0:
        raise SystemExit(run.stdout[-4000:])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--iters", type=int, default=6)
    ap.add_argument("--init-iters", type=int, default=20)
    a = ap.parse_args(argv)
    import torch
    from datastates.weights import WeightsReader
    work = tempfile.mkdtemp(prefix="rl_change_")
    shm = tempfile.mkdtemp(prefix="rl_change_", dir="/dev/shm")
    model = (QUICK if a.quick else FULL) + [f for f in LLAMA if f not in ("--lr", "1e-4")] + [
        "--micro-batch-size", "2", "--global-batch-size", "2", "--bf16"]
    ckpt = os.path.join(work, "ckpt")
    try:
        rl = model + ["--save", os.path.join(work, "rl"), "--lr", str(a.lr), "--train-iters", str(a.iters),
                      "--non-persistent-save-interval", "1",
                      "--non-persistent-local-ckpt-dir", os.path.join(shm, "tier"), "--save-interval", str(a.iters),
                      "--publish-weights-dir", os.path.join(shm, "v"), "--publish-weights-interval", "1",
                      "--publish-weights-keep-last", str(a.iters)]
        if a.init_iters:  # off the initialisation first; then its weights alone, a fresh Adam at --lr
            train(model + ["--save", ckpt, "--lr", "1e-3", "--train-iters", str(a.init_iters), "--save-interval",
                           str(a.init_iters)])
            rl += ["--finetune", "--load", ckpt]
        train(rl)
        reader = WeightsReader(os.path.join(shm, "v"))
        its = reader.published()
        rows, previous = [], None
        for it in its:
            with reader.open(it) as version:
                tensors = dict(version.tensors())
            if previous is not None:
                n = sum(t.numel() for t in tensors.values())
                changed = sum(int((t.view(torch.int16) != previous[k].view(torch.int16)).sum())
                              for k, t in tensors.items())
                rows.append((it, changed / n, 6 * changed, 2 * n))
            previous = tensors
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    print(f"CPU, {'quick' if a.quick else 'full'} model in bf16, Adam at lr {a.lr} after {a.init_iters} steps at 1e-3")
    print("| step | share of bf16 elements changed | delta bytes | full bytes | full / delta |")
    print("|---|---|---|---|---|")
    for it, share, delta, full in rows:
        print(f"| {it} | {share:.4%} | {delta} | {full} | {full / max(delta, 1):.1f}x |")
    print(f"median share {statistics.median(r[1] for r in rows):.4%}")


if __name__ == "__main__":
    main()
