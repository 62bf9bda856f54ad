"""The engine on one rank: round trips, the fence, the staging budget, publication and the error paths."""
import argparse
import json
import os
import random
import subprocess
import sys
from collections import OrderedDict, namedtuple

import numpy as np
import pytest
import torch

from datastates import CheckpointCorruptError, CheckpointEngine, PosixOptions, CheckpointError
from datastates import paths, read_json, tracker, format as fmt
from datastates.storage import READ_MODES

Pair = namedtuple("Pair", "left right")
fmt.allow_unpickle(Pair.__module__, "Pair")  # a user type in a checkpoint must be trusted explicitly

ALL_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2,
              torch.float8_e4m3fnuz, torch.float8_e5m2fnuz, torch.bool, torch.uint8, torch.int8, torch.int16,
              torch.int32, torch.int64, torch.uint16, torch.uint32, torch.uint64, torch.complex64, torch.complex128]


def random_tensor(dtype, shape, gen):
    raw = torch.randint(0, 256, (int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size(),),
                        dtype=torch.uint8, generator=gen)
    if dtype == torch.bool:
        raw %= 2  # a bool byte other than 0/1 is not a valid torch bool
    return raw.view(dtype).reshape(shape)


def assert_same(a, b, where="state"):
    """Bit-exact structural equality (NaN payloads included)."""
    assert type(a) is type(b), f"{where}: {type(a)} != {type(b)}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a.contiguous().view(-1).view(torch.uint8) if a.numel() else a.new_empty(0, dtype=torch.uint8),
                           b.contiguous().view(-1).view(torch.uint8) if b.numel() else b.new_empty(0, dtype=torch.uint8)), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            assert_same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}/{i}")
    elif isinstance(a, argparse.Namespace):
        assert vars(a) == vars(b), where
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and np.array_equal(a, b), where
    else:
        assert a == b, where


def every_kind_of_state():
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(8, 6, generator=gen)
    state = OrderedDict()
    state["dtypes"] = {str(dt): random_tensor(dt, (3, 5), gen) for dt in ALL_DTYPES}
    state["views"] = {"transposed": base.t(), "strided": base[::2, 1::2], "expanded": torch.randn(1, 4).expand(3, 4),
                      "narrowed": base.narrow(1, 2, 3), "scalar": torch.tensor(2.5), "empty": torch.empty(0, 7),
                      "empty_int": torch.empty(5, 0, dtype=torch.int32)}
    state["shared"] = [base, base[2:4], base.view(48), base]  # one storage, several views, one tensor twice
    state["objects"] = {"args": argparse.Namespace(lr=1e-3, layers=2, name="gpt", dtype=torch.bfloat16),
                        "iteration": 10, "python_rng": random.Random(1).getstate(),
                        "numpy_rng": np.random.RandomState(2).get_state(), "torch_rng": torch.get_rng_state(),
                        "nested": Pair(left=(1, 2.0, None), right={"k": [b"bytes", {3, 4}]})}
    return state


@pytest.fixture
def engine():
    with CheckpointEngine(host_buffer_bytes=1 << 20, storage=PosixOptions(writer_threads=2)) as eng:
        yield eng


def test_round_trip_every_kind_bit_exact(tmp_path, engine):
    state = every_kind_of_state()
    engine.save(state, str(tmp_path / "iter_0000001"))
    engine.wait()
    loaded = engine.load(str(tmp_path))
    assert_same(state, loaded)
    # the same tensor reached twice comes back as one tensor
    assert loaded["shared"][0] is loaded["shared"][3]


def test_load_into_template_in_place(tmp_path, engine):
    state = every_kind_of_state()
    engine.save(state, str(tmp_path / "iter_0000003"))
    engine.wait()
    template = every_kind_of_state()
    for t in template["dtypes"].values():
        t.zero_()
    target = template["dtypes"]["torch.float32"]
    out = engine.load(str(tmp_path / "iter_0000003"), template=template)
    assert out["dtypes"]["torch.float32"] is target  # filled in place
    assert_same(state, out)


def test_both_read_modes_load_every_kind_and_bad_ones_are_refused(tmp_path, engine):
    state = every_kind_of_state()
    path = str(tmp_path / "iter_0000004")
    engine.save(state, path)
    engine.wait()
    for mode in READ_MODES:
        with CheckpointEngine(host_buffer_bytes=1 << 20,
                              storage=PosixOptions(read_mode=mode, read_threads=3)) as loader:
            template = every_kind_of_state()
            for t in template["dtypes"].values():
                t.zero_()
            assert_same(state, loader.load(path, template=template))
            assert_same(state, loader.load(path))
    with pytest.raises(ValueError, match="read_mode must be one of"):
        CheckpointEngine(storage=PosixOptions(read_mode="mmap"))
    with pytest.raises(ValueError, match="read_threads must be >= 1"):
        CheckpointEngine(storage=PosixOptions(read_threads=0))


def test_fence_protects_snapshot_from_later_mutation(tmp_path):
    gen = torch.Generator().manual_seed(1)
    state = {f"w{i}": torch.randn(256, 1024, generator=gen) for i in range(24)}  # 24 MiB, 8x the budget
    expected = {k: v.clone() for k, v in state.items()}
    with CheckpointEngine(host_buffer_bytes=3 << 20, storage=PosixOptions(writer_threads=2)) as eng:
        handle = eng.save(state, str(tmp_path / "iter_0000001"))
        snapshot_pending_at_return = not handle.snapshot_done
        eng.wait_for_snapshot()
        for t in state.values():  # the optimizer step
            t.add_(1.0)
        eng.wait()
        loaded = eng.load(str(tmp_path))
    assert snapshot_pending_at_return, "save() should return before the copy is done (lazy)"
    assert_same(expected, loaded)


def test_budget_holds_with_tensor_three_times_larger(tmp_path):
    budget = 1 << 20
    big = torch.randn(3 * budget // 4)  # 3 MiB of float32
    with CheckpointEngine(host_buffer_bytes=budget, storage=PosixOptions(writer_threads=2)) as eng:
        eng.save({"big": big, "small": torch.arange(5)}, str(tmp_path / "iter_0000001"))
        stats = eng.wait()[0]
        assert stats.peak_staging_bytes <= budget
        assert eng.pool.allocated_bytes <= budget
        loaded = eng.load(str(tmp_path))
    assert torch.equal(loaded["big"], big)
    manifest = fmt.read_manifest(eng.storage, str(tmp_path / "iter_0000001" / paths.manifest_file(0)))
    assert len(manifest.items["big"].crcs) > 3  # chunked, one checksum per chunk


def test_native_module_does_the_writing(tmp_path, engine):
    state = {"x": torch.randn(300, 300)}
    before = engine.storage._pool("write").bytes_written
    engine.save(state, str(tmp_path / "iter_0000001"))
    stats = engine.wait()[0]
    written = engine.storage._pool("write").bytes_written - before
    data = tmp_path / "iter_0000001" / paths.data_file(0)
    assert written == stats.bytes == data.stat().st_size
    assert data.read_bytes()[:360000] == state["x"].numpy().tobytes()


def test_layout_aligned_and_manifest_complete(tmp_path, engine):
    engine.save({"a": torch.randn(3), "b": torch.randn(1000), "obj": {"k": 1}}, str(tmp_path / "iter_0000002"))
    engine.wait()
    doc = read_json(str(tmp_path / "iter_0000002" / paths.manifest_file(0)), "manifest")
    assert doc["schema_version"] == fmt.SCHEMA_VERSION
    tensors = [it for it in doc["items"] if it["kind"] == "tensor"]
    assert all(it["offset"] % 4096 == 0 for it in tensors)
    assert {it["id"] for it in doc["items"]} >= {"a", "b", "obj/k", "__skeleton__"}
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "2"
    meta = json.loads((tmp_path / "iter_0000002" / paths.METADATA).read_text())
    assert meta["world_size"] == 1 and meta["iteration"] == 2


def test_unpublished_checkpoint_is_not_loadable(tmp_path, engine):
    engine.save({"a": torch.ones(4)}, str(tmp_path / "iter_0000001"))
    engine.wait()
    partial = tmp_path / "iter_0000002.partial"
    partial.mkdir()
    (partial / paths.data_file(0)).write_bytes(b"junk")
    with pytest.raises(CheckpointError, match="not published"):
        engine.load(str(tmp_path / "iter_0000002"))
    assert torch.equal(engine.load(str(tmp_path))["a"], torch.ones(4))  # latest still the good one
    assert tracker.clean_leftovers(str(tmp_path)) == [str(partial)]


def _save_ok(engine, root, it, value):
    engine.save({"w": torch.full((1000,), float(value))}, str(root / f"iter_{it:07d}"))
    engine.wait()


def test_flipped_byte_is_detected(tmp_path, engine):
    _save_ok(engine, tmp_path, 1, 1.0)
    data = tmp_path / "iter_0000001" / paths.data_file(0)
    raw = bytearray(data.read_bytes())
    raw[1234] ^= 0x10
    data.write_bytes(bytes(raw))
    with pytest.raises(CheckpointCorruptError, match=r"checksum mismatch in .*rank_00000\.data.*'w'"):
        engine.load(str(tmp_path))


def test_truncated_and_missing_files(tmp_path, engine):
    _save_ok(engine, tmp_path, 1, 1.0)
    (tmp_path / "iter_0000001" / paths.manifest_file(0)).unlink()  # a load needs the index, not the manifests
    assert torch.equal(engine.load(str(tmp_path))["w"], torch.full((1000,), 1.0))
    data = tmp_path / "iter_0000001" / paths.data_file(0)
    os.truncate(data, 2000)
    with pytest.raises(CheckpointCorruptError, match=r"truncated"):
        engine.load(str(tmp_path))
    data.unlink()
    with pytest.raises(CheckpointError, match=r"rank_00000\.data"):
        engine.load(str(tmp_path))
    (tmp_path / "iter_0000001" / paths.METADATA).unlink()
    with pytest.raises(CheckpointError, match=r"no published checkpoint"):
        engine.load(str(tmp_path))


def test_edited_manifest_and_newer_schema_are_refused(tmp_path, engine):
    _save_ok(engine, tmp_path, 1, 1.0)
    meta = tmp_path / "iter_0000001" / paths.METADATA
    pristine = meta.read_text()
    doc = json.loads(pristine)
    doc["ranks"]["0"]["items"][0]["offset"] += 4096
    meta.write_text(json.dumps(doc))
    with pytest.raises(CheckpointCorruptError, match="fails its checksum"):
        engine.load(str(tmp_path))
    meta.write_text(pristine)
    doc = json.loads(meta.read_text())
    doc["schema_version"] = fmt.SCHEMA_VERSION + 1
    meta.write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match="schema version"):
        engine.load(str(tmp_path))


def test_unpicklable_object_fails_save_and_keeps_previous(tmp_path, engine):
    _save_ok(engine, tmp_path, 1, 1.0)
    engine.save({"w": torch.zeros(1000), "fn": lambda x: x}, str(tmp_path / "iter_0000002"))
    with pytest.raises(CheckpointError, match=r"iter_0000002.*not picklable"):
        engine.wait()
    assert not (tmp_path / "iter_0000002").exists()
    assert tracker.read_latest(str(tmp_path)) == 1
    assert torch.equal(engine.load(str(tmp_path))["w"], torch.full((1000,), 1.0))


def test_close_does_not_raise_an_error_the_caller_already_got(tmp_path):
    """A save fails, the caller catches it from its handle, later saves succeed: leaving the engine is quiet.
    A failure nobody waited for is still raised, once, by close()."""
    with CheckpointEngine(host_buffer_bytes=1 << 20, storage=PosixOptions(writer_threads=2)) as eng:
        handle = eng.save({"fn": lambda x: x}, str(tmp_path / "iter_0000001"))
        with pytest.raises(CheckpointError, match=r"iter_0000001.*not picklable"):
            handle.wait()
        for it in (2, 3):
            eng.save({"w": torch.full((10,), float(it))}, str(tmp_path / f"iter_{it:07d}")).wait()
    assert tracker.read_latest(str(tmp_path)) == 3
    eng = CheckpointEngine(host_buffer_bytes=1 << 20, storage=PosixOptions(writer_threads=2))
    eng.save({"fn": lambda x: x}, str(tmp_path / "iter_0000004"))
    with pytest.raises(CheckpointError, match=r"iter_0000004.*not picklable"):
        eng.close()
    eng.close()  # closed: nothing left to report


def test_restricted_unpickler_refuses_code(tmp_path, engine):
    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))
    engine.save({"x": Evil()}, str(tmp_path / "iter_0000001"))
    engine.wait()
    with pytest.raises(CheckpointError, match="refusing to unpickle posix.system"):
        engine.load(str(tmp_path))


def test_retention_keeps_newest(tmp_path):
    with CheckpointEngine(host_buffer_bytes=1 << 20, storage=PosixOptions(writer_threads=2), keep_last=2) as eng:
        for it in range(1, 5):
            _save_ok(eng, tmp_path, it, it)
    assert tracker.published_iterations(str(tmp_path)) == [3, 4]
    assert tracker.read_latest(str(tmp_path)) == 4


def test_reshard_global_tensor_between_layouts(tmp_path):
    """Two ranks save row shards; loads into column shards, quarter shards and the whole tensor."""
    full = torch.randn(64, 48)
    path = str(tmp_path / "iter_0000005")
    store = torch.distributed.HashStore()  # the ranks' shared store, as torchrun's would be
    engines = [CheckpointEngine(host_buffer_bytes=64 << 10, storage=PosixOptions(writer_threads=1), rank=r,
                                world_size=2, store=store)
               for r in range(2)]
    from test_kept import REGISTRY, Piece as Shard  # a shard of a global tensor, named name@offset

    for eng in engines:
        eng.registry = REGISTRY
    for r, eng in enumerate(engines):
        eng.save({"w": Shard("w", full[r * 32:(r + 1) * 32].clone(), (r * 32, 0), (64, 48))}, path)
    for eng in engines:
        eng.wait()
    eng = engines[0]
    for rows, cols in [((0, 64), (0, 24)), ((0, 64), (24, 48)), ((16, 48), (12, 36)), ((0, 64), (0, 48))]:
        dst = torch.zeros(rows[1] - rows[0], cols[1] - cols[0])
        out = eng.load(path, template={"w": Shard("w", dst, (rows[0], cols[0]), (64, 48))})
        assert out["w"] is dst
        assert torch.equal(dst, full[rows[0]:rows[1], cols[0]:cols[1]])
    with pytest.raises(CheckpointError, match="global shape"):
        eng.load(path, template={"w": Shard("w", torch.zeros(64, 48), (0, 0), (64, 96))})
    for e in engines:
        e.close()


def _fill_disk_script(root, data_dir, limit):
    return f"""
import resource, signal, sys, torch
from datastates import CheckpointEngine, PosixOptions, CheckpointError
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
with CheckpointEngine(host_buffer_bytes=1 << 20, storage=PosixOptions(writer_threads=2)) as eng:
    eng.save({{"w": torch.full((1000,), 1.0)}}, "{root}/iter_0000001")
    eng.wait()
    hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
    resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, hard))
    eng.save({{"w": torch.full((4 << 20,), 2.0)}}, "{root}/iter_0000002")
    try:
        eng.wait()
    except CheckpointError as e:
        print("ERROR:", e)
    resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))
    print("LOADED:", eng.load("{root}")["w"][0].item())
"""


def test_file_size_limit_gives_clear_error_and_previous_loads(tmp_path):
    out = subprocess.run([sys.executable, "-c", _fill_disk_script(tmp_path, tmp_path, 1 << 20)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "ERROR: saving" in out.stdout and "iter_0000002" in out.stdout and "too large" in out.stdout, out.stdout
    assert "LOADED: 1.0" in out.stdout
    assert tracker.read_latest(str(tmp_path)) == 1


@pytest.fixture
def small_tmpfs(tmpfs):
    return tmpfs("2m")  # where mounting is not allowed, the RLIMIT_FSIZE test covers the full disk


def test_full_disk_gives_clear_error_and_previous_loads(small_tmpfs, engine):
    _save_ok(engine, small_tmpfs, 1, 1.0)
    engine.save({"w": torch.full((1 << 20,), 2.0)}, str(small_tmpfs / "iter_0000002"))  # 4 MiB > 2 MiB disk
    with pytest.raises(CheckpointError, match=r"iter_0000002.*No space left on device"):
        engine.wait()
    assert tracker.read_latest(str(small_tmpfs)) == 1
    assert torch.equal(engine.load(str(small_tmpfs))["w"], torch.full((1000,), 1.0))
    assert not any(n.endswith(".partial") for n in os.listdir(small_tmpfs))


def test_permission_denied_names_the_path(small_tmpfs, engine):
    _save_ok(engine, small_tmpfs, 1, 1.0)
    subprocess.run(["mount", "-o", "remount,ro", str(small_tmpfs)], check=True)
    try:
        with pytest.raises(CheckpointError, match=r"iter_0000002\.partial.*Read-only file system"):
            engine.save({"w": torch.zeros(10)}, str(small_tmpfs / "iter_0000002"))
        assert torch.equal(engine.load(str(small_tmpfs))["w"], torch.full((1000,), 1.0))
    finally:
        subprocess.run(["mount", "-o", "remount,rw", str(small_tmpfs)], check=True)
