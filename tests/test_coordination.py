"""Agreement on each save through the store: a rank's wait() returns only once `latest` names the checkpoint,
a failure on rank 0 reaches the others at once, and nothing of a failed save is left behind. Two engines in one
process share a HashStore, as the ranks of a job share torchrun's TCPStore."""
import threading

import pytest
import torch

from datastates import CheckpointEngine, PosixOptions, CheckpointError, paths, tracker
from datastates.storage import posix


def _engines(n=2, **kw):
    store = torch.distributed.HashStore()
    return [CheckpointEngine(host_buffer_bytes=1 << 20, storage=PosixOptions(writer_threads=1), rank=r, world_size=n,
                             store=store, **kw)
            for r in range(n)]


def test_every_rank_returns_only_once_latest_names_the_checkpoint(tmp_path):
    """Rank 1 finishes its part first every time; its wait() must still see the tracker updated."""
    engines = _engines(keep_last=2)
    try:
        for it in range(1, 13):
            path = paths.checkpoint_dir(str(tmp_path), it)
            engines[1].save({"w": torch.full((100,), float(it))}, path)
            engines[1].wait_for_snapshot()
            done = threading.Event()

            def rank0():  # rank 0 starts late: its publication is what rank 1's wait() has to wait for
                engines[0].save({"w": torch.full((200_000,), float(it))}, path)
                engines[0].wait()
                done.set()
            t = threading.Thread(target=rank0)
            t.start()
            engines[1].wait()
            with open(tmp_path / paths.TRACKER) as f:
                assert f.read().strip() == str(it), f"rank 1 returned before latest named iteration {it}"
            t.join(60)
            assert done.is_set()
    finally:
        for eng in engines:
            eng.close()


def test_rank0_publication_failure_reaches_every_rank_at_once(tmp_path, monkeypatch):
    engines = _engines(publish_timeout_s=300)

    def refuse(*args, **kwargs):
        raise OSError(28, "No space left on device", "metadata.json")
    monkeypatch.setattr(posix.PosixStorage, "commit", refuse)  # the publication of rank 0 fails
    path = paths.checkpoint_dir(str(tmp_path), 1)
    handles = [eng.save({"w": torch.full((1000,), float(r))}, path) for r, eng in enumerate(engines)]
    assert handles[1].join(30), "rank 1 waited for its timeout instead of hearing rank 0's failure"
    for eng in engines:
        with pytest.raises(CheckpointError, match="No space left on device"):
            eng.wait()
    assert not (tmp_path / "iter_0000001.partial").exists() and not (tmp_path / "iter_0000001").exists()
    monkeypatch.undo()
    for r, eng in enumerate(engines):  # the engines carry on: the next save publishes
        eng.save({"w": torch.full((1000,), float(r))}, paths.checkpoint_dir(str(tmp_path), 2))
    for eng in engines:
        eng.wait()
        eng.close()
    assert tracker.read_latest(str(tmp_path)) == 2


def test_more_ranks_than_a_store_needs_is_a_clear_error(tmp_path):
    with CheckpointEngine(host_buffer_bytes=1 << 20, storage=PosixOptions(writer_threads=1), rank=0,
                          world_size=2) as eng:
        with pytest.raises(CheckpointError, match="world_size=2 needs a torch.distributed store"):
            eng.save({"w": torch.ones(4)}, str(tmp_path / "iter_0000001"))


def _save_all(engines, root, it, numel=1000):
    for r, eng in enumerate(engines):
        eng.save({"w": torch.full((numel,), float(it + r))}, paths.checkpoint_dir(str(root), it))
    for eng in engines:
        eng.wait()


def test_each_rank_deletes_its_share_of_retired_checkpoints(tmp_path):
    """Rank 0 only renames a retired checkpoint out of sight and removes the emptied directory; the files go
    with the ranks' own deletions, and nothing is left once the engines close."""
    engines = _engines(n=3, keep_last=1)
    try:
        for it in range(1, 5):
            _save_all(engines, tmp_path, it)
            for eng in engines:
                eng.pipeline._deleter.submit(lambda: None).result()  # the deletions of this publication are done
            retired = [n for n in sorted(tmp_path.iterdir()) if paths.DELETING in n.name]
            assert all(not any(d.iterdir()) for d in retired), "a retired checkpoint still has files"
            assert len(retired) <= 1, retired  # rank 0 removed the directories emptied before this save
        for r, eng in enumerate(engines):
            assert torch.equal(eng.load(str(tmp_path))["w"], torch.full((1000,), float(4 + r)))
    finally:
        for eng in engines:
            eng.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000004", paths.TRACKER]


def test_retired_checkpoint_of_a_larger_world_is_removed_whole(tmp_path):
    """A checkpoint written by 3 ranks, retired by a 2-rank job: rank 0 removes the files nobody owns."""
    three = _engines(n=3)
    _save_all(three, tmp_path, 1)
    for eng in three:
        eng.close()
    engines = _engines(n=2, keep_last=1)
    try:
        for it in (2, 3, 4, 5):
            _save_all(engines, tmp_path, it)
    finally:
        for eng in engines:
            eng.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000005", paths.TRACKER]



def test_a_rank_killed_between_its_report_and_its_count_is_not_waited_for():
    """Rank 1's report of its durable part is written, then its process dies before it is counted (its store
    `add` never happens): rank 0 finds every report there at its timeout and publishes, instead of failing the
    save for "rank(s) [] did not finish" (seen in CI, a SIGKILL landing between the two)."""
    from datastates.coordination import Coordinator

    class DiesBeforeCounting:
        def __init__(self, store):
            self.store = store

        def add(self, key, n):
            raise SystemExit("killed")

        def __getattr__(self, name):
            return getattr(self.store, name)

    store = torch.distributed.HashStore()
    rank0, rank1 = Coordinator(store, 0, 2), Coordinator(store, 1, 2)
    rank1.store = DiesBeforeCounting(rank1.store)
    rank0.report(1, {"rank": 0}, None)
    with pytest.raises(SystemExit, match="killed"):
        rank1.report(1, {"rank": 1}, None)
    rank0.await_reports(1, "checkpoint 1", timeout_s=0.2)
    assert rank0.manifests(1) == {0: {"rank": 0}, 1: {"rank": 1}}
    rank0.report(2, {"rank": 0}, None)
    with pytest.raises(CheckpointError, match=r"rank\(s\) \[1\] did not finish within 0.2 s"):
        rank0.await_reports(2, "checkpoint 2", timeout_s=0.2)  # a rank that never reported is still named


def test_an_agreement_without_a_verdict_leaves_no_key_behind():
    """The trainer's Hugging Face export: every rank reports, rank 0 waits for all, reads the reports and
    `forget`s the agreement (no rank waits for a verdict): nothing of it is left in the store; a failure on one
    rank is raised on rank 0 naming it."""
    from datastates.coordination import Coordinator
    store = torch.distributed.HashStore()
    rank0, rank1 = Coordinator(store, 0, 2), Coordinator(store, 1, 2)
    rank1.report(7, {"received": 5}, None)
    rank0.report(7, {"received": 3}, None)
    rank0.await_reports(7, "the model of iteration 7", timeout_s=5)
    assert rank0.manifests(7) == {0: {"received": 3}, 1: {"received": 5}}
    rank0.forget(7)
    keys = [f"7/{k}" for k in ("r/0", "r/1", "n", "all", "fail", "gate")]
    assert [k for k in keys if rank0.store.check([k])] == []
    rank1.report(8, None, "OSError: disk full")
    rank0.report(8, {"received": 0}, None)
    with pytest.raises(CheckpointError, match=r"the model of iteration 8 not published: rank 1: OSError: disk full"):
        rank0.await_reports(8, "the model of iteration 8", timeout_s=5)
    rank0.forget(8)
    assert [k for k in [f"8/{k}" for k in ("r/0", "r/1", "n", "all", "fail", "gate")] if rank0.store.check([k])] == []
