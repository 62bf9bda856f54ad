"""scripts/compare_losses.py, the verdict of the demo and of the GPU check's part (b), on logs written here in the
trainer's own line format: exact equality, a missing or differing iteration named, and the run-to-run spread of a
device that is not deterministic."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
from compare_losses import compare  # noqa: E402


def _log(path, losses: dict, stall_ms=None):
    lines = [f"12:00:00 [rank 0] INFO x:  [t] iteration {i:8d}/      20 | consumed samples: 8 | lm loss: {v!r} | grad "
             f"norm: 1.0 |" for i, v in losses.items()]
    if stall_ms is not None:
        lines.append(f"checkpoint summary iteration        2 | max stall ms over ranks: {stall_ms} | max time to "
                     f"durable ms: 9.0 | bytes all ranks: 1")
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_exact_missing_and_differing(tmp_path):
    ref = {i: 7.0 - i / 10 for i in range(1, 5)}
    a = _log(tmp_path / "a", {1: ref[1], 2: ref[2]}, stall_ms=12.5)
    b = _log(tmp_path / "b", {3: ref[3], 4: ref[4]})
    r = _log(tmp_path / "r", ref)
    assert compare([a, b], r, 2, 4) == (True, f"losses identical at all 4 iterations (last lm loss {ref[4]!r}); "
                                               f"checkpoint stall max 12.5 ms over 1 checkpoints")
    short = _log(tmp_path / "s", {3: ref[3]})
    ok, line = compare([a, short], r, 2, 4)
    assert not ok and "stop+resume has no loss for iteration(s) [4]" in line
    off = _log(tmp_path / "o", {3: ref[3], 4: ref[4] + 1e-3})
    ok, line = compare([a, off], r, 2, 4)
    assert not ok and f"iteration 4: {ref[4] + 1e-3!r} vs {ref[4]!r}" in line
    ok, line = compare([a, off], r, 2, 4, again=r)  # the second uninterrupted run agrees: the resume is wrong
    assert not ok and line.startswith("the resumed run differs from two identical uninterrupted runs")


def test_within_and_beyond_the_run_to_run_spread(tmp_path):
    ref = {i: 7.0 - i / 10 for i in range(1, 5)}
    a = _log(tmp_path / "a", {1: ref[1], 2: ref[2]})
    r = _log(tmp_path / "r", ref)
    again = _log(tmp_path / "g", {**ref, 3: ref[3] + 2e-3})  # the device's own spread: 2e-3
    near = _log(tmp_path / "n", {3: ref[3], 4: ref[4] + 3e-3})
    ok, line = compare([a, near], r, 2, 4, again=again)
    assert ok and "not deterministic run to run" in line and "within twice that spread" in line
    far = _log(tmp_path / "f", {3: ref[3], 4: ref[4] + 5e-3})
    ok, line = compare([a, far], r, 2, 4, again=again)
    assert not ok and "beyond twice that spread" in line
