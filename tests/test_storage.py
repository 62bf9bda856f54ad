"""The storage seam: the shared-memory backend (the memory tier's), and a storage save written from the memory
tier's pages (one copy per iteration, whatever levels it goes to). The POSIX backend is the one every other
engine test drives (test_engine, test_crash, test_crash_states, test_faults)."""
import os

import pytest
import torch

from datastates import CheckpointCorruptError, CheckpointEngine, PosixOptions, CheckpointError, paths, read_index, tracker
from datastates.copies import HostCopyBackend
from datastates.memory_tier.replication import Replica
from datastates.storage import SPARES, SharedMemoryStorage
from datastates.verifier import CheckpointVerifier
from late_copies import LateCopyBackend
from test_engine import assert_same, every_kind_of_state

MiB = 1 << 20


class CountingCopies(HostCopyBackend):
    """The host backend, counting the bytes it is asked to copy."""

    def __init__(self):
        super().__init__(1)
        self.bytes = 0

    def copy(self, dst, src, ordering):
        self.bytes += src.numel() * src.element_size()
        super().copy(dst, src, ordering)


def _memory(tmp_path, **kw):
    kw.setdefault("host_buffer_bytes", MiB)
    return CheckpointEngine(rank=0, world_size=1, keep_last=2, tracker=False,  # as the memory tier keeps none
                            storage=SharedMemoryStorage(pinned=False, writer_threads=1), **kw)


def _disk(**kw):
    return CheckpointEngine(host_buffer_bytes=MiB, storage=PosixOptions(writer_threads=2), rank=0, world_size=1, **kw)


def test_memory_save_lands_in_mapped_pages_and_loads_back(tmp_path):
    state = every_kind_of_state()
    with _memory(tmp_path) as eng:
        path = paths.checkpoint_dir(str(tmp_path), 1)
        eng.save(state, path).wait()
        data = eng.storage.data_of(path)
        part = eng.checkpoint(path).part(0)
        item = next(it for it in part.items.values() if it.kind == "tensor" and it.nbytes > 4096)
        on_disk = open(os.path.join(path, paths.data_file(0)), "rb").read()
        assert len(on_disk) == part.data_bytes
        assert on_disk[item.offset:item.offset + item.nbytes] == \
            data.pages[item.offset:item.offset + item.nbytes].numpy().tobytes()  # the file is the pages
        CheckpointVerifier(eng.checkpoint(path)).verify(0)  # every checksum computed over the pages
        assert_same(eng.load(path), state)


def test_storage_writes_from_the_memory_pages_without_a_copy_of_its_own(tmp_path):
    """The memory save copies the live state once (late, out of order); the storage save copies no tensor byte
    and still holds the state of the save call, not what the state became after the fence."""
    live = {"w": torch.arange(3 * MiB // 4, dtype=torch.float32), "b": torch.ones(6, 4)[:, 1], "step": 7}
    expected = {"w": live["w"].clone(), "b": live["b"].clone(), "step": 7}
    counting = CountingCopies()
    with _memory(tmp_path, copy_backend=LateCopyBackend(seed=3)) as mem, _disk(copy_backend=counting) as disk:
        memory_save = mem.save(live, paths.checkpoint_dir(str(tmp_path / "mem"), 4))
        disk.save(live, paths.checkpoint_dir(str(tmp_path / "ck"), 4), from_save=memory_save)
        mem.wait_for_snapshot()
        disk.wait_for_snapshot()
        live["w"].add_(1000)  # the optimizer step after the fence
        live["b"].zero_()
        disk.wait()
        mem.wait()
        assert counting.bytes == 0
        assert_same(disk.load(str(tmp_path / "ck")), expected)
        assert_same(mem.load(str(tmp_path / "mem")), expected)


def test_a_save_from_one_that_lends_no_pages_copies_the_state_itself(tmp_path):
    """`from_save` names a save to a file system (no pages to lend): the save falls back to its own copy."""
    counting = CountingCopies()
    with _disk(copy_backend=counting) as disk:
        first = disk.save({"w": torch.ones(4)}, paths.checkpoint_dir(str(tmp_path), 1))
        first.wait()
        counting.bytes = 0
        disk.save({"w": torch.full((4,), 2.0)}, paths.checkpoint_dir(str(tmp_path), 2), from_save=first).wait()
        assert counting.bytes == 16
        assert_same(disk.load(paths.checkpoint_dir(str(tmp_path), 2)), {"w": torch.full((4,), 2.0)})


def test_a_failed_memory_snapshot_fails_the_storage_save_and_spares_the_last_good_one(tmp_path):
    ck = str(tmp_path / "ck")
    with _memory(tmp_path) as mem, _disk() as disk:
        good = mem.save({"w": torch.ones(1000)}, paths.checkpoint_dir(str(tmp_path / "mem"), 1))
        disk.save({"w": torch.ones(1000)}, paths.checkpoint_dir(ck, 1), from_save=good).wait()
        bad = mem.save({"w": torch.ones(1000), "f": lambda: None}, paths.checkpoint_dir(str(tmp_path / "mem"), 2))
        handle = disk.save({"w": torch.ones(1000)}, paths.checkpoint_dir(ck, 2), from_save=bad)
        with pytest.raises(CheckpointError, match="the memory checkpoint it is written from failed"):
            handle.wait()
        with pytest.raises(CheckpointError, match="not picklable"):
            bad.wait()
        assert tracker.read_latest(ck) == 1 and tracker.published_iterations(ck) == [1]
        assert not os.path.exists(paths.partial_dir(paths.checkpoint_dir(ck, 2)))
        assert_same(disk.load(ck), {"w": torch.ones(1000)})


def test_retired_pages_are_reused_but_never_under_a_save_writing_from_them(tmp_path):
    mem_root = str(tmp_path / "mem")
    with _memory(tmp_path) as mem:
        inodes = []
        for it in range(1, 6):
            mem.save({"w": torch.full((100_000,), float(it))}, paths.checkpoint_dir(mem_root, it)).wait()
            mem.pipeline._deleter.submit(lambda: None).result()  # retention's deletions done
            inodes.append(os.stat(os.path.join(paths.checkpoint_dir(mem_root, it), paths.data_file(0))).st_ino)
        assert tracker.published_iterations(mem_root) == [4, 5]
        assert len(set(inodes)) == 3  # 2 kept, and the retired one taken over by each next save
        storage = mem.storage
        held = paths.checkpoint_dir(mem_root, 4)
        storage.hold(held)  # a storage save writes from iteration 4's pages
        pages = storage.data_of(held)
        for it in (6, 7):
            mem.save({"w": torch.full((100_000,), float(it))}, paths.checkpoint_dir(mem_root, it)).wait()
            mem.pipeline._deleter.submit(lambda: None).result()
        assert tracker.published_iterations(mem_root) == [6, 7]
        assert torch.equal(pages.pages[:400_000].view(torch.float32), torch.full((100_000,), 4.0))
        assert pages not in storage._spares
        storage.release(held)  # the last reader let go: the retired pages go
        assert not os.path.exists(pages.path)
        assert sorted(os.listdir(mem_root)) == ["iter_0000006", "iter_0000007", SPARES]
    assert tracker.clean_leftovers(mem_root) == [os.path.join(mem_root, SPARES)]  # what a killed tier left


def test_pages_made_ahead_are_the_next_saves_pages_and_nothing_more_is_kept(tmp_path):
    """ahead=2 (the memory tier's): once the first save made its pages, two more of its size are made in the
    background; the second and third saves take them instead of making theirs, later ones take retired pages,
    and the files stay those three (two kept, one retired between saves)."""
    mem_root = str(tmp_path / "mem")
    storage = SharedMemoryStorage(pinned=False, writer_threads=1, ahead=2)
    with CheckpointEngine(host_buffer_bytes=MiB, rank=0, world_size=1, keep_last=2, storage=storage) as mem:
        def save(it):
            mem.save({"w": torch.full((100_000,), float(it))}, paths.checkpoint_dir(mem_root, it)).wait()
            mem.pipeline._deleter.submit(lambda: None).result()  # retention's deletions done
            return os.stat(os.path.join(paths.checkpoint_dir(mem_root, it), paths.data_file(0))).st_ino

        first = save(1)
        with storage._made:  # the background maker is done: both spares are there
            storage._made.wait_for(lambda: not storage._making)
        spares = os.path.join(mem_root, SPARES)
        ahead = {os.stat(os.path.join(spares, name)).st_ino for name in os.listdir(spares)}
        assert len(ahead) == 2 and first not in ahead
        assert {save(2), save(3)} == ahead
        assert {save(it) for it in (4, 5, 6)} <= ahead | {first}
        assert_same(mem.load(mem_root), {"w": torch.full((100_000,), 6.0)})


def test_a_replica_whose_index_does_not_verify_is_refused(tmp_path):
    """A replica is refused before anything is written unless its index verifies and describes the bytes that
    come; one whose pieces stop coming is discarded whole; one received whole loads."""
    with _memory(tmp_path) as mem:
        path = paths.checkpoint_dir(str(tmp_path / "mine"), 1)
        mem.save({"w": torch.arange(5000.0)}, path).wait()
        index = open(os.path.join(path, paths.METADATA), "rb").read()
        n = read_index(path).part(0).data_bytes
        data = torch.from_file(os.path.join(path, paths.data_file(0)), size=n, dtype=torch.uint8)
        peer = paths.checkpoint_dir(str(tmp_path / "peer"), 1)
        with pytest.raises(CheckpointCorruptError, match="fails its checksum"):
            Replica(mem.storage, peer, index.replace(b'"iteration":1', b'"iteration":2'), n)
        assert not os.path.exists(os.path.dirname(peer))  # nothing half-written is left
        with pytest.raises(CheckpointCorruptError, match=f"the index says {n} data bytes, {n - 1} come"):
            Replica(mem.storage, peer, index, n - 1)
        assert not os.path.exists(os.path.dirname(peer))
        half = Replica(mem.storage, peer, index, n)
        half.pages[:n // 2].copy_(data[:n // 2])
        half.discard()  # the sender went away midway
        assert os.listdir(os.path.dirname(peer)) == []
        whole = Replica(mem.storage, peer, index, n)
        for off in range(0, n, 4096):  # in pieces, as an exchange delivers them
            whole.pages[off:off + 4096].copy_(data[off:off + 4096])
        whole.publish(keep=2)
        assert torch.equal(mem.load(peer)["w"], torch.arange(5000.0))


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full, a device whose every write fails")
def test_a_failed_write_names_its_file():
    """A write's own error (ENOSPC here, EFBIG past a memory file system's limit) carries no file name: the
    storage adds it, so a failed save says which file."""
    from datastates.storage.posix import write_file
    with pytest.raises(OSError, match="No space left on device") as failed:
        write_file("/dev/full", b"x" * 4096, fsync=False, offset=0)
    assert failed.value.filename == "/dev/full"
