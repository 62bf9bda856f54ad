"""One conformance suite, run against every backend of the storage contract (datastates/storage/base.py) with
the policy above it (datastates/save_root.py): a POSIX file system, shared memory (the memory tier's), S3
(a real SeaweedFS), msc:// (an MSC profile onto the same store), and a fifth backend written in the tests
(tests/memory_storage.py, one short module: proof that a backend is one module). Each test asserts bytes read
back, names listed, and errors raised: atomic publication (a reader never sees half a checkpoint), retention,
re-saves, leftovers of a killed save, ranged reads and their checksums, a write failing midway, and the engine
saving and loading through the backend, a corrupt byte refused."""
import contextlib
import dataclasses
import resource
import signal
import threading

import pytest
import torch

from datastates import CheckpointCorruptError, CheckpointEngine, _native, paths, tracker
from datastates.save_root import DIRECTORY_TEXT, ITERATION_TEXT, Publisher, SaveRoot
from datastates.storage import PosixOptions, PosixStorage, SharedMemoryStorage, Storage, options_for, storage_for
from memory_storage import MemoryStorage

MiB = 1 << 20
PART = 5 * MiB  # S3's smallest multipart part: a data object of two of them is written in two parts everywhere
BACKENDS = ["posix", "shared_memory", "s3", "msc", "memory"]


@dataclasses.dataclass
class Backend:
    kind: str
    storage: Storage
    root: str
    breaking: object  # a context manager factory: writes to the storage fail inside it
    fresh: object  # another storage object of the same backend (an engine closes the one it is given)

    def checkpoint(self, iteration: int) -> str:
        return paths.checkpoint_dir(self.root, iteration)


@contextlib.contextmanager
def file_size_limit(nbytes: int):
    """This process may not write a file past `nbytes` (a full disk, for real: pwrite fails with EFBIG)."""
    old_limit, old_handler = resource.getrlimit(resource.RLIMIT_FSIZE), signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, old_limit[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        signal.signal(signal.SIGXFSZ, old_handler)


@pytest.fixture(params=BACKENDS)
def backend(request, tmp_path, monkeypatch):
    kind = request.param
    if kind in ("s3", "msc"):
        s3_server = request.getfixturevalue("s3_server")
        for k, v in s3_server.env().items():
            monkeypatch.setenv(k, v)
        monkeypatch.delenv("AWS_PROFILE", raising=False)
        bucket = s3_server.create_bucket()
        if kind == "msc":
            pytest.importorskip("multistorageclient")
            monkeypatch.setenv("MSC_CONFIG", str(s3_server.write_msc_config(tmp_path / "msc.json", profile="ckpt",
                                                                            bucket=bucket, prefix="base")))
        root = f"s3://{bucket}/run" if kind == "s3" else "msc://ckpt/run"
        prefix = "run/" if kind == "s3" else "base/run/"

        @contextlib.contextmanager
        def breaking():  # the store loses the open uploads under the root: the next part or completion fails
            c = s3_server.client()
            for u in c.list_multipart_uploads(Bucket=bucket, Prefix=prefix).get("Uploads", []):
                c.abort_multipart_upload(Bucket=bucket, Key=u["Key"], UploadId=u["UploadId"])
            yield
        def fresh():
            return storage_for(root, writer_threads=2)
    elif kind == "memory":
        memory, root = MemoryStorage(), "mem://run"

        def fresh():
            return memory

        @contextlib.contextmanager
        def breaking():  # the store fills up
            memory.capacity = sum(len(v) for v in memory.objects.values()) + MiB
            try:
                yield
            finally:
                memory.capacity = None
    else:
        root = str(tmp_path / "run")
        def fresh():
            return (PosixStorage(PosixOptions(direct_io="off")) if kind == "posix"
                    else SharedMemoryStorage(pinned=False))

        def breaking():
            return file_size_limit(PART + MiB)
    storage = fresh()
    yield Backend(kind, storage, root, breaking, fresh)
    storage.close()


def content(iteration: int, rank: int, nbytes: int) -> torch.Tensor:
    """The bytes rank `rank` writes for `iteration`: different for each, known to the reader."""
    return torch.arange(nbytes, dtype=torch.int64).add_(iteration * 31 + rank * 7).to(torch.uint8)


def write_part(pub: Publisher, partial: str, rank: int, iteration: int, nbytes: int) -> None:
    """What a rank writes of a checkpoint: its data object in parts of `PART` (at most), then its manifest."""
    data = content(iteration, rank, nbytes)
    sink = pub.open_data(partial, rank, nbytes)
    for offset in range(0, nbytes, PART):
        piece = data[offset:offset + PART]
        sink.submit(piece, offset, [(0, piece.numel())])()
    sink.close(nbytes)
    pub.write_manifest(partial, rank, f"manifest {iteration} {rank}".encode())


def save(b: Backend, pub: Publisher, iteration: int, keep_last=None, ranks=1, nbytes=64 << 10) -> list[str]:
    """A whole save through the policy, as the pipeline makes it; returns what publication retired."""
    partial = pub.prepare(b.checkpoint(iteration))
    for rank in range(ranks):
        write_part(pub, partial, rank, iteration, nbytes)
    return pub.publish(partial, b.checkpoint(iteration), f"index {iteration} {ranks}".encode(), keep_last)


def read_data(storage: Storage, path: str, offset: int, nbytes: int, segments) -> tuple[bytes, list[int]]:
    buffer = torch.empty(nbytes, dtype=torch.uint8)
    source = storage.open_source(path)
    try:
        crcs = source.submit(buffer, nbytes, offset, segments)()
    finally:
        source.close()
    return bytes(buffer.numpy()), crcs


def check_complete(b: Backend, iteration: int, ranks=1, nbytes=64 << 10) -> None:
    """The checkpoint `iteration` is there whole: its index, and every rank's data and manifest as written."""
    path = b.checkpoint(iteration)
    index = b.storage.read_bytes(paths.join(path, paths.METADATA)).decode()
    iteration_, ranks_ = map(int, index.split()[1:])
    assert iteration_ == iteration
    for rank in range(ranks_):
        data = paths.join(path, paths.data_file(rank))
        assert b.storage.size(data) >= nbytes  # the memory tier's reused pages may be longer
        got, _ = read_data(b.storage, data, 0, nbytes, [(0, nbytes)])
        assert got == bytes(content(iteration, rank, nbytes).numpy()), f"{data} differs"
        manifest = b.storage.read_bytes(paths.join(path, paths.manifest_file(rank)))
        assert manifest == f"manifest {iteration} {rank}".encode()


def visible(b: Backend) -> list[str]:
    """The names under the save root that a reader may look at: the memory tier keeps a retired checkpoint's pages
    for the next one, out of sight (`.deleting`), and SeaweedFS may list an emptied prefix."""
    return sorted(n for n in b.storage.list(b.root) if paths.DELETING not in n
                  and b.storage.exists(paths.join(b.root, n)))


def test_ranged_reads_give_the_bytes_and_the_checksum_of_each_segment(backend):
    nbytes = 2 * PART + 12345  # three parts, the last short
    path = paths.join(backend.storage.stage(backend.checkpoint(1), paths.METADATA), paths.data_file(0))
    data = content(1, 0, nbytes)
    sink = backend.storage.open_data(path, nbytes)
    crcs = []
    for offset in range(0, nbytes, PART):
        piece = data[offset:offset + PART]
        crcs += sink.submit(piece, offset, [(0, 100), (100, piece.numel() - 100)])()
    sink.close(nbytes)
    whole = bytes(data.numpy())
    assert crcs == [_native.crc32c(whole[o:o + n]) for p in range(0, nbytes, PART)
                    for o, n in ((p, 100), (p + 100, min(PART, nbytes - p) - 100))]
    size = backend.storage.size(path)
    assert size >= nbytes
    offset, n = PART - 4096, PART + 8192  # across the part boundary
    got, crcs = read_data(backend.storage, path, offset, n, [(0, 4096), (4096, n - 4096)])
    assert got == whole[offset:offset + n]
    assert crcs == [_native.crc32c(whole[offset:offset + 4096]), _native.crc32c(whole[offset + 4096:offset + n])]
    corrupt = bytearray(whole)
    corrupt[offset + 5000] ^= 1
    backend.storage.write_bytes(path, bytes(corrupt))  # a flipped bit: the checksum of its segment tells
    assert read_data(backend.storage, path, offset, n, [(0, 4096), (4096, n - 4096)])[1][1] != crcs[1]
    with pytest.raises(OSError, match=r"short read.*rank_00000\.data"):
        read_data(backend.storage, path, size - 10, 100, [(0, 100)])  # past the end: an error, not garbage


def test_small_objects_listing_and_removal(backend):
    s, root = backend.storage, backend.root
    with pytest.raises(FileNotFoundError, match=r"(No such file or directory|no such object): '.*/missing'"):
        s.read_bytes(paths.join(root, "missing"))
    assert s.stat(paths.join(root, "missing")) is None and s.list(root) == [] and not s.exists(root)
    place = s.stage(backend.checkpoint(1), paths.METADATA)
    s.write_bytes(paths.join(place, "a"), b"first")
    before = s.stat(paths.join(place, "a"))
    s.write_bytes(paths.join(place, "a"), b"second!", replace=True)
    assert s.read_bytes(paths.join(place, "a")) == b"second!"
    after = s.stat(paths.join(place, "a"))
    assert after.size == 7 and after != before  # a replaced object is another version
    s.write_bytes(paths.join(place, "b"), b"x")
    assert sorted(s.list(place)) == ["a", "b"] and paths.name(place) in s.list(root)
    s.remove(paths.join(place, "a"))
    assert s.list(place) == ["b"]
    s.remove(place)
    assert s.list(place) == [] and not s.exists(place)
    s.remove(place)  # nothing there is no error


def test_a_reader_never_sees_half_a_checkpoint(backend):
    """Two ranks' saves published one after the other while a reader resolves the save root over and over:
    whatever it finds is complete. In lockstep: after each step of the writer, a whole resolve that began after
    it, so the reader sees every state the root goes through, each published checkpoint included."""
    pub, seen, errors, done = Publisher(backend.storage), [], [], threading.Event()
    resolved = threading.Condition()
    nbytes = 32 << 10

    def reader():
        while not done.is_set():
            try:
                latest = tracker.find_latest(backend.root, backend.storage)
                if latest.path is not None:
                    assert not latest.path.endswith(paths.PARTIAL)
                    check_complete(backend, latest.iteration, nbytes=nbytes)
                with resolved:
                    seen.append(latest.iteration)
                    resolved.notify_all()
            except BaseException as e:  # noqa: BLE001 - reported below
                with resolved:
                    errors.append(e)
                    resolved.notify_all()
                return

    def resolved_after_this_step() -> int | None:
        """What a resolve that began after this point found (the one under way when it is called may not)."""
        with resolved:
            target = len(seen) + 2
            assert resolved.wait_for(lambda: len(seen) >= target or errors, timeout=120), "the reader is stuck"
            assert not errors, errors[0]
            return seen[target - 1]
    thread = threading.Thread(target=reader)
    thread.start()
    try:
        for iteration in range(1, 6):
            partial = pub.prepare(backend.checkpoint(iteration))
            for rank in range(2):
                write_part(pub, partial, rank, iteration, nbytes)
                assert resolved_after_this_step() == (iteration - 1 or None)
            pub.publish(partial, backend.checkpoint(iteration), f"index {iteration} 2".encode(), None)
            assert resolved_after_this_step() == iteration
            assert tracker.read_latest(backend.root, backend.storage) == iteration
    finally:
        done.set()
        thread.join()
    assert not errors, errors[0]
    assert sorted(set(seen) - {None}) == [1, 2, 3, 4, 5]
    assert SaveRoot(backend.storage, backend.root).published() == [1, 2, 3, 4, 5]


def test_retention_keeps_the_newest_and_a_resave_replaces_whole(backend):
    pub = Publisher(backend.storage)
    for iteration in range(1, 5):
        retired = save(backend, pub, iteration, keep_last=2, ranks=2)
        for rank in (1, 0):  # every rank its share, rank 0 last (as the deleter threads may run)
            pub.delete(retired, rank, 2)
    pub.sweep()
    assert SaveRoot(backend.storage, backend.root).published() == [3, 4]
    assert visible(backend) == ["iter_0000003", "iter_0000004", paths.TRACKER]
    assert tracker.read_latest(backend.root, backend.storage) == 4
    partial = pub.prepare(backend.checkpoint(4))  # the same iteration saved again: the new one wins
    write_part(pub, partial, 0, 40, 64 << 10)
    pub.delete(pub.publish(partial, backend.checkpoint(4), b"index 4 1", keep_last=2), 0, 1)
    pub.sweep()
    got, _ = read_data(backend.storage, paths.join(backend.checkpoint(4), paths.data_file(0)), 0, 64 << 10,
                       [(0, 64 << 10)])
    assert got == bytes(content(40, 0, 64 << 10).numpy())
    check_complete(backend, 3, ranks=2)
    assert visible(backend) == ["iter_0000003", "iter_0000004", paths.TRACKER]


def test_leftovers_of_a_killed_save_are_cleaned_and_the_last_good_one_stays(backend):
    pub = Publisher(backend.storage)
    save(backend, pub, 1)
    partial = pub.prepare(backend.checkpoint(2))  # killed midway: one part written, the object left open
    sink = pub.open_data(partial, 0, 2 * PART)
    sink.submit(content(2, 0, PART), 0, [(0, PART)])()
    pub.write_manifest(partial, 0, b"manifest 2 0")
    assert tracker.read_latest(backend.root, backend.storage) == 1
    removed = SaveRoot(backend.storage, backend.root).clean_leftovers()
    assert removed and all(r.startswith(backend.root) for r in removed)
    assert visible(backend) == ["iter_0000001", paths.TRACKER]
    assert backend.storage.abort_uploads(backend.root) == []  # nothing left open
    assert SaveRoot(backend.storage, backend.root).clean_leftovers() == []
    check_complete(backend, 1)
    sink.discard()


def test_a_write_failing_midway_fails_the_save_and_leaves_the_last_good_one(backend):
    pub = Publisher(backend.storage)
    save(backend, pub, 1)
    partial = pub.prepare(backend.checkpoint(2))
    sink = pub.open_data(partial, 0, 2 * PART)
    sink.submit(content(2, 0, PART), 0, [(0, PART)])()
    with pytest.raises(OSError, match="File too large|no such object|no space left"):  # what each breaking() does
        with backend.breaking():
            sink.submit(content(2, 0, PART), PART, [(0, PART)])()
            sink.close(2 * PART)
    sink.discard()
    pub.abandon(partial)  # what the pipeline does with a failed save
    assert visible(backend) == ["iter_0000001", paths.TRACKER]
    assert SaveRoot(backend.storage, backend.root).clean_leftovers() == []
    assert tracker.read_latest(backend.root, backend.storage) == 1
    check_complete(backend, 1)


def test_the_engine_saves_and_loads_through_it_and_refuses_a_corrupt_byte(backend):
    state = {"w": torch.randn(300_000, generator=torch.Generator().manual_seed(3)), "step": 7}
    with CheckpointEngine(host_buffer_bytes=MiB, storage=backend.fresh(), rank=0, world_size=1, keep_last=1) as eng:
        for iteration in (1, 2):
            eng.save(dict(state, step=iteration), backend.checkpoint(iteration)).wait()
        got = eng.load(backend.root)
        assert torch.equal(got["w"], state["w"]) and got["step"] == 2
        assert SaveRoot(backend.storage, backend.root).published() == [2]
    data = paths.join(backend.checkpoint(2), paths.data_file(0))
    damaged = bytearray(backend.storage.read_bytes(data))
    damaged[1000] ^= 0x40
    backend.storage.write_bytes(data, bytes(damaged))
    with CheckpointEngine(host_buffer_bytes=MiB, storage=backend.fresh(), rank=0, world_size=1) as eng:
        with pytest.raises(CheckpointCorruptError, match="rank_00000.data"):
            eng.load(backend.root)


def test_a_backend_missing_an_operation_is_refused_and_options_are_typed_per_backend():
    class Incomplete(Storage):
        def read_bytes(self, path):
            return b""
    with pytest.raises(TypeError, match="abstract method.*commit"):
        Incomplete()
    from datastates.storage.s3 import S3Options
    for flag in ("fsync", "direct_io", "read_mode"):  # they mean nothing to an object store
        with pytest.raises(TypeError, match=flag):
            S3Options(**{flag: False})
    assert options_for("s3://b/run", fsync=False, read_mode="stream", writer_threads=3) == S3Options(writer_threads=3)
    assert options_for("/ckpt", fsync=False, direct_io=False) == PosixOptions(fsync=False, direct_io="off")
    with pytest.raises(ValueError, match="read_mode must be one of"):
        PosixOptions(read_mode="mmap")
    with pytest.raises(ValueError, match="writer_threads and read_threads must be >= 1"):
        S3Options(read_threads=0)


HF_INDEX = "model.safetensors.index.json"


def export(root: SaveRoot, iteration: int, keep_last=None, weights=b"weights") -> list[str]:
    """A model published as the Hugging Face export does: its files written into the staged place, its index
    (the root's marker) last, then committed, retained and pointed at; returns what was retired."""
    final = root.path(iteration)
    place = root.stage(final)
    root.storage.write_bytes(paths.join(place, "model-00001-of-00001.safetensors"), weights)
    root.storage.write_bytes(paths.join(place, root.marker), f"index {iteration}".encode())
    return root.publish(place, final, keep_last=keep_last)


def test_a_models_root_publishes_retains_points_and_cleans_by_its_own_names(backend):
    s = backend.storage
    models = SaveRoot(s, backend.root, marker=HF_INDEX, pointer="latest", pointer_text=DIRECTORY_TEXT)
    for iteration in (1, 2, 3):
        for retired in export(models, iteration, keep_last=2):
            s.remove(retired)
    assert models.published() == [2, 3] and models.pointed() == 3 and not s.exists(models.path(1))
    assert s.read_bytes(paths.join(backend.root, "latest")) == b"iter_0000003\n"
    assert models.read_pointer() == "iter_0000003"
    checkpoints = SaveRoot(s, backend.root)  # the same directories are no checkpoints: their marker is another
    assert checkpoints.published() == [] and checkpoints.read_pointer() is None
    for retired in export(models, 3, weights=b"again"):  # a re-export of an iteration replaces it
        s.remove(retired)
    assert s.read_bytes(paths.join(models.path(3), "model-00001-of-00001.safetensors")) == b"again"
    place = models.stage(models.path(4))  # a killed export: its weights written, not its index
    s.write_bytes(paths.join(place, "model-00001-of-00001.safetensors"), b"half")
    s.write_bytes(paths.join(backend.root, "latest.tmp.4242"), b"iter_0000004\n")  # a killed pointer replacement
    temporaries = backend.kind in ("posix", "shared_memory")  # only a file system replaces through a temporary
    assert (s.temporary_of("latest.tmp.4242") == "latest") == temporaries
    assert s.temporary_of("latest") is None and s.temporary_of("latest.tmp.x") is None
    removed = models.clean_leftovers()
    assert place in [paths.normalize(r) for r in removed] and models.published() == [2, 3]
    assert s.exists(paths.join(backend.root, "latest.tmp.4242")) != temporaries
    assert models.pointed() == 3 and models.clean_leftovers() == []


class Watched(SaveRoot):
    """A save root that notes, as each retirement begins, what its pointer names and whether that is published:
    what a process killed at that moment would leave."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.at_retire = []

    def retire(self, path):
        self.at_retire.append((self.pointed(), self.is_published(self.path(self.pointed()))))
        return super().retire(path)


@pytest.mark.parametrize("kind", ["checkpoints", "models"])
def test_every_root_points_at_the_new_checkpoint_before_retention_retires_any(backend, kind):
    """The one publication order (commit, pointer, retention) on every kind of root: keeping one, each
    retirement finds the pointer already naming the newest, published, so a kill there leaves it loadable."""
    s = backend.storage
    names = {} if kind == "checkpoints" else dict(marker=HF_INDEX, pointer="latest", pointer_text=DIRECTORY_TEXT)
    root = Watched(s, backend.root, **names)
    for iteration in (1, 2, 3):
        for retired in export(root, iteration, keep_last=1):
            s.remove(retired)
    assert root.at_retire == [(2, True), (3, True)] and root.published() == [3] and root.pointed() == 3


def test_pointer_texts_name_an_iteration_their_own_way():
    assert ITERATION_TEXT.write(100) == "100" and ITERATION_TEXT.read("100") == 100
    assert DIRECTORY_TEXT.write(100) == "iter_0000100\n" and DIRECTORY_TEXT.read("iter_0000100") == 100
    assert ITERATION_TEXT.read("iter_0000100") is None and DIRECTORY_TEXT.read("100") is None
    assert DIRECTORY_TEXT.read("../iter_0000100") is None and ITERATION_TEXT.read("release") is None


def test_two_writers_of_one_output_stage_apart_and_the_second_never_displaces_the_first(backend):
    """A conversion's output (one process writes it alone) is staged under a name of its own: two conversions
    of one output, interleaved, never share a file, and the later commit is refused where the storage stages
    aside (in place, the output is the place: nothing to refuse)."""
    s = backend.storage
    out = paths.join(backend.root, "hf_model")
    root = SaveRoot(s, backend.root, marker=HF_INDEX, pointer=None)
    first, second = root.stage(out, private=True), root.stage(out, private=True)
    assert (first == second) == s.in_place
    for place, text in ((first, b"first"), (second, b"second")):
        s.write_bytes(paths.join(place, "model.safetensors"), text)
    if s.in_place:
        return
    assert s.read_bytes(paths.join(first, "model.safetensors")) == b"first"
    root.commit(first, out, marker=b"index", replace=False)
    with pytest.raises(FileExistsError):
        root.commit(second, out, marker=b"index", replace=False)
    assert s.read_bytes(paths.join(out, "model.safetensors")) == b"first" and root.is_published(out)
    assert paths.name(second).endswith(paths.PARTIAL) and second in [paths.normalize(r) for r in root.clean_leftovers()]
