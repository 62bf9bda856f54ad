"""Power loss during real multi-rank saves (tests/crash_states.py): the short run checks the systematic crash
states of every other crash point of a recorded 2-rank job with retention and a re-save; the long run is
`python tests/crash_states.py --summary`. Plus the persistence model itself on hand-written logs."""
import os
import shutil
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import crash_fs  # noqa: E402
import crash_states  # noqa: E402
from crash_fs import ROOT_INO, Op  # noqa: E402


@pytest.mark.skipif(shutil.which("strace") is None, reason="the crash-state explorer records saves with strace")
def test_crash_states_of_real_saves(tmp_path):
    res = crash_states.explore(str(tmp_path), samples=0, stride=2, log=None)
    # the whole job was recorded: native pwrites and Python writes, file and directory fsyncs, every durable point
    assert res.kinds["write"] > 0 and res.kinds["fsync"] > 0 and res.kinds["rename"] > 0
    assert res.kinds["mark"] == sum(len(w) + 1 for _, _, w in crash_states.RUNS)
    assert res.checked > 0
    assert not res.violations, "\n".join(res.violations[:20])


def _log():
    """create a; write 5000 bytes; fsync a; rename a -> b; fsync the directory."""
    return [Op("create", 0, 0, dir=ROOT_INO, name="a", ino=1, path="a"),
            Op("write", 1, 1, ino=1, offset=0, data=b"x" * 5000, path="a"),
            Op("fsync", 2, 2, ino=1, path="a"),
            Op("rename", 3, 3, dir=ROOT_INO, name="a", dst_dir=ROOT_INO, dst_name="b", ino=1, path="a -> b"),
            Op("fsync", 4, 4, ino=ROOT_INO, path=".")]


def _trees(ops, k):
    durable = crash_fs.durable_at(ops)
    return {s.label: dict((p, bytes(t.files.get(i, b""))) for p, i, _ in t.walk())
            for s in crash_fs.crash_states(ops, durable, k, samples=20, seed=1) for t in [s.build(ops, durable)]}


def test_model_file_fsync_persists_data_not_its_name():
    ops = _log()
    assert crash_fs.durable_at(ops)[:4] == [4, 2, -1, 4]
    trees = _trees(ops, 4)  # the data synced; neither the create nor the rename
    assert trees["drop all unsynced"] == {}  # the file is an orphan
    assert trees["keep all (what SIGKILL leaves)"] == {"b": b"x" * 5000}
    assert {"a": b"x" * 5000} in trees.values()  # the rename lost, the create kept
    assert all(v in ({}, {"a": b"x" * 5000}, {"b": b"x" * 5000}) for v in trees.values())
    assert all(v == {"b": b"x" * 5000} for v in _trees(ops, 5).values())  # the directory fsync: all durable


def test_model_unsynced_write_lost_or_torn_by_block():
    ops = _log()[:2]  # create and write, nothing synced
    contents = {v.get("a") for v in _trees(ops, 2).values()}
    assert None in contents and b"" in contents and b"x" * 5000 in contents  # no entry, empty, complete
    torn = {c for c in contents if c and c != b"x" * 5000}
    assert torn and all(c in (b"x" * 4096, bytes(4096) + b"x" * 904) for c in torn)  # one 4096-byte block of two
