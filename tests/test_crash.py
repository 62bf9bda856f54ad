"""Crash consistency: SIGKILL one rank or the whole 2-rank job at random moments of lazy saves (see
tests/crash_harness.py), plus every on-disk state a crash can leave, built deterministically.

CI runs 30 trials (~2-3 minutes); CRASH_TRIALS=500 (and CRASH_SEED) make a long run, or run the harness on its
own: `python tests/crash_harness.py --trials 500 -v`.
"""
import os
import shutil
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import crash_harness  # noqa: E402
from datastates import CheckpointEngine, PosixOptions, CheckpointError  # noqa: E402
from datastates import paths, tracker  # noqa: E402


def test_random_sigkill_campaign(tmp_path):
    trials = int(os.environ.get("CRASH_TRIALS", 30))
    seed = int(os.environ.get("CRASH_SEED", 0))
    c = crash_harness.run_campaign(trials, str(tmp_path), seed=seed, mb=8.0, max_delay=1.2)
    table = c.table()
    print("\n" + table)
    assert not c.violations, "\n".join(c.violations[:20]) + "\n" + table
    assert c.stats["trials"] == trials
    assert c.stats["checkpoints lost"] == 0
    assert c.stats["resumes verified"] >= trials  # killed runs are resumed (by the next trial or the final run)
    landed = {p for p, n in c.phases.items() if n}
    # the kills are spread over the save pipeline, not all in one spot
    assert len(landed - {"between saves (nothing in flight)"}) >= 3, table


# ----- every state a crash can leave, built deterministically -----

def _save(eng, root, it):
    eng.save({"w": torch.full((3000,), float(it)), "it": it}, paths.checkpoint_dir(str(root), it))
    eng.wait()


@pytest.fixture
def three(tmp_path):
    """A save root with iterations 1, 2, 3 published (tracker 3)."""
    with CheckpointEngine(host_buffer_bytes=1 << 20, storage=PosixOptions(writer_threads=2)) as eng:
        for it in (1, 2, 3):
            _save(eng, tmp_path, it)
        yield eng, tmp_path


def _loaded_iteration(eng, root):
    out = eng.load(str(root))
    assert torch.equal(out["w"], torch.full((3000,), float(out["it"])))
    return out["it"]


def test_killed_between_rename_and_tracker(three):
    eng, root = three
    (root / paths.TRACKER).write_text("2")  # iter_3 renamed into place, tracker not yet replaced
    # the tracker names a complete checkpoint: that one is the latest (as in Megatron-LM), not the newest directory
    assert tracker.read_latest(str(root)) == 2
    assert _loaded_iteration(eng, root) == 2
    assert tracker.clean_leftovers(str(root)) == []  # nothing to clean: both are complete


def test_tracker_missing_garbage_or_naming_a_missing_dir(three):
    eng, root = three
    tracker_file = root / paths.TRACKER
    # no tracker, an unreadable one, or one naming a missing directory: the newest published iteration (3), never
    # an older one (lost progress); a readable one naming a complete checkpoint wins (surrounding blanks stripped)
    for text, expected in ((None, 3), ("", 3), ("abc", 3), ("17", 3), ("-1", 3), ("3\n3", 3), ("2 ", 2),
                           ("\n1\n", 1)):
        if text is None:
            tracker_file.unlink(missing_ok=True)
        else:
            tracker_file.write_text(text)
        latest = tracker.read_latest(str(root))
        assert latest == expected, (text, latest)
        assert tracker.is_published(paths.checkpoint_dir(str(root), latest))
        assert _loaded_iteration(eng, root) == latest


def test_killed_after_metadata_before_rename(three):
    eng, root = three
    src, partial = root / "iter_0000003", root / "iter_0000004.partial"
    shutil.copytree(src, partial)  # a complete directory, metadata.json included, still under .partial
    assert tracker.read_latest(str(root)) == 3
    with pytest.raises(CheckpointError, match="not published"):
        eng.load(str(root / "iter_0000004"))
    assert tracker.clean_leftovers(str(root)) == [str(partial)]
    assert _loaded_iteration(eng, root) == 3


def test_killed_during_retention_or_replacement(three):
    eng, root = three
    # retention renamed iter_1 away and died in rmtree; a re-save of iter_3 died after moving the old one aside
    os.rename(root / "iter_0000001", root / "iter_0000001.deleting.123.456")
    (root / "iter_0000001.deleting.123.456" / paths.data_file(0)).unlink()
    os.rename(root / "iter_0000003", root / "iter_0000003.deleting.123.789")
    (root / "iter_0000003.partial").mkdir()
    (root / f"{paths.TRACKER}.tmp.999").write_text("4")
    assert tracker.published_iterations(str(root)) == [2]
    assert tracker.read_latest(str(root)) == 2  # tracker says 3, which is gone: newest complete one instead
    assert _loaded_iteration(eng, root) == 2
    removed = tracker.clean_leftovers(str(root))
    assert sorted(os.path.basename(p) for p in removed) == [
        "iter_0000001.deleting.123.456", "iter_0000003.partial", f"{paths.TRACKER}.tmp.999"]
    # the next start rolls the interrupted re-save back: the tracker's iteration 3 is not lost
    assert sorted(os.listdir(root)) == ["iter_0000002", "iter_0000003", paths.TRACKER]
    assert tracker.read_latest(str(root)) == 3
    assert _loaded_iteration(eng, root) == 3


def test_rank0_missing_partial_never_loaded(tmp_path):
    """Rank 1 finished, rank 0 never did: rank 1 names it within the timeout; nothing loadable; cleaned later."""
    store = torch.distributed.HashStore()
    engines = [CheckpointEngine(host_buffer_bytes=1 << 20, storage=PosixOptions(writer_threads=1), rank=r, world_size=2,
                                publish_timeout_s=0.5, store=store) for r in range(2)]
    try:
        engines[1].save({"w": torch.ones(10)}, str(tmp_path / "iter_0000001"))
        with pytest.raises(CheckpointError, match=r"rank\(s\) \[0\] did not finish"):
            engines[1].wait()
        assert tracker.read_latest(str(tmp_path)) is None
        with pytest.raises(CheckpointError, match="no published checkpoint"):
            engines[0].load(str(tmp_path))
        assert tracker.clean_leftovers(str(tmp_path)) == [str(tmp_path / "iter_0000001.partial")]
    finally:
        for e in engines:
            e.close()
