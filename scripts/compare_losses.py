"""Did a stopped-and-resumed run reproduce an uninterrupted one? Compares pretrain_gpt.py logs, loss by loss.

    python scripts/compare_losses.py --half H --iters N PART1.log PART2.log REFERENCE.log
    python scripts/compare_losses.py --iters N RUN.log REFERENCE.log        (two whole runs: is the GPU deterministic?)
    python scripts/compare_losses.py --half H --iters N PART1.log PART2.log REFERENCE.log --again REFERENCE2.log

PART1 ran iterations 1..H and stopped (--exit-interval H), PART2 resumed at H+1 and ran to N. Exit 0 and one line
when every iteration's lm loss is present and identical as printed; exit 1 and one line naming every missing or
differing iteration otherwise. The lazy checkpoints' largest stall (their summary lines) goes on the OK line.

--again: a second uninterrupted run of the same flags. Where the two differ, the device is not deterministic run to
run and exact equality cannot decide; the resumed run then passes when no iteration's loss is further from
REFERENCE's than twice the largest difference between REFERENCE and REFERENCE2 (the run-to-run spread), and the
line says so. Where they agree, equality decides as without it.
"""
from __future__ import annotations

import argparse
import re
import sys

LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.* lm loss: ([^ ]+) \|")
STALL = re.compile(r"checkpoint summary iteration\s+\d+ .*max stall ms over ranks: ([\d.]+)")


def losses(path: str) -> dict[int, str]:
    with open(path) as f:
        return {int(k): v for k, v in LOSS.findall(f.read())}


def spread(reference: str, again: str, iters: int) -> float:
    """The largest difference between two runs' losses, iteration by iteration."""
    a, b = losses(reference), losses(again)
    return max((abs(float(a[i]) - float(b[i])) for i in range(1, iters + 1) if i in a and i in b), default=0.0)


def compare(runs: list[str], reference: str, half: int | None, iters: int,
            again: str | None = None) -> tuple[bool, str]:
    problems = []
    if half is not None:
        part1, part2 = losses(runs[0]), losses(runs[1])
        if late := sorted(i for i in part1 if i > half):
            problems.append(f"{runs[0]} did not stop at iteration {half}: it logged {late}")
        if early := sorted(i for i in part2 if i <= half):
            problems.append(f"{runs[1]} did not resume at iteration {half + 1}: it logged {early}")
        got = {**{i: v for i, v in part1.items() if i <= half}, **{i: v for i, v in part2.items() if i > half}}
        name = "stop+resume"
    else:
        got, name = losses(runs[0]), runs[0]
    ref = losses(reference)
    for who, d in ((name, got), (reference, ref)):
        if gone := [i for i in range(1, iters + 1) if i not in d]:
            problems.append(f"{who} has no loss for iteration(s) {gone}")
    differ = [i for i in range(1, iters + 1) if i in got and i in ref and got[i] != ref[i]]
    run_to_run = spread(reference, again, iters) if again else 0.0
    if problems or (differ and not run_to_run):
        lead = ["the resumed run differs from two identical uninterrupted runs"] if differ and again else []
        return False, "; ".join(problems + lead + [f"iteration {i}: {got[i]} vs {ref[i]}" for i in differ])
    if differ:
        worst = max(abs(float(got[i]) - float(ref[i])) for i in differ)
        verdict = f"this device is not deterministic run to run: two uninterrupted runs differ by up to " \
                  f"{run_to_run:.3g}; the resumed run differs from the first by up to {worst:.3g} at " \
                  f"{len(differ)} of {iters} iterations"
        if worst > 2 * run_to_run:
            return False, verdict + ", beyond twice that spread"
        return True, verdict + ", within twice that spread"
    stalls = []
    for path in runs:
        with open(path) as f:
            stalls += [float(s) for s in STALL.findall(f.read())]
    line = f"losses identical at all {iters} iterations (last lm loss {ref[iters]})"
    if stalls:
        line += f"; checkpoint stall max {max(stalls):.1f} ms over {len(stalls)} checkpoints"
    return True, line


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--half", type=int, help="the iteration the first part stopped at (two parts given)")
    ap.add_argument("--iters", type=int, required=True)
    ap.add_argument("--again", help="a second uninterrupted run: compare within the run-to-run spread if they differ")
    ap.add_argument("logs", nargs="+", help="PART1 PART2 REFERENCE with --half, else RUN REFERENCE")
    a = ap.parse_args()
    if len(a.logs) != (3 if a.half is not None else 2):
        ap.error("give PART1 PART2 REFERENCE with --half, RUN REFERENCE without")
    ok, line = compare(a.logs[:-1], a.logs[-1], a.half, a.iters, a.again)
    print(line)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
