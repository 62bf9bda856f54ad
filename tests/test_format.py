"""The typed format and the one reader of the tracker.

- A schema-1 checkpoint (datastates 0.1: metadata.json lists each rank's manifest checksum, a load reads the
  manifests) still loads, resharded, and inspects clean; one whose manifest is not the published one is refused.
- Every caller that resolves a save root (the engine's load, --load validation, inspect, convert) names the same
  checkpoint, through `tracker.find_latest`: the tracker's when it holds a checkpoint, else the newest published
  one (a tracker naming a retired checkpoint), Megatron's legacy torch directories and "release" included.
"""
import json
import os
import shutil

import pytest
import torch

from datastates import CheckpointEngine, PosixOptions, CheckpointError, paths, tracker, format as fmt
from datastates.storage.posix import retire
from datastates.providers import ContainerProvider, ObjectProvider, ProviderRegistry, TensorProvider
from test_load_reads import Box, BoxProvider


def _registry():
    return ProviderRegistry([BoxProvider(), ContainerProvider(), TensorProvider(), ObjectProvider()])


def _state(step):
    whole = torch.arange(40 * 6, dtype=torch.float32).reshape(40, 6) + step
    return whole, {"w0": Box("w", whole[:25], whole.shape, (0, 0)), "w1": Box("w", whole[25:], whole.shape, (25, 0)),
                   "local": torch.full((3, 5), float(step)).bfloat16(), "step": step}


def _as_schema_1(ckpt: str) -> None:
    """Rewrite a published checkpoint as datastates 0.1 wrote it: schema-1 manifests, each with its own
    checksum, and a metadata.json without the items, its checksum or one of its own."""
    meta_path = os.path.join(ckpt, paths.METADATA)
    with open(meta_path) as f:
        meta = json.load(f)
    crcs = {}
    for rank in range(meta["world_size"]):
        path = os.path.join(ckpt, paths.manifest_file(rank))
        with open(path) as f:
            doc = json.load(f)
        body = {k: v for k, v in doc.items() if k != "manifest_crc32c"}
        body["schema_version"] = 1
        crcs[str(rank)] = fmt._body_crc(body)
        with open(path, "w") as f:
            json.dump(dict(body, manifest_crc32c=crcs[str(rank)]), f)
    old = {k: meta[k] for k in ("format", "iteration", "world_size", "bytes", "created_unix")}
    with open(meta_path, "w") as f:
        json.dump(dict(old, schema_version=1, manifests=crcs), f)


@pytest.fixture
def engine():
    with CheckpointEngine(host_buffer_bytes=64 << 10, storage=PosixOptions(writer_threads=2),
                          registry=_registry()) as eng:
        yield eng


def _schema_1_checkpoint(engine, root, step):
    """(checkpoint directory, the logical tensor, the state) of a save of `step`, rewritten as schema 1."""
    whole, state = _state(step)
    ckpt = paths.checkpoint_dir(str(root), step)
    engine.save(state, ckpt)
    engine.wait()
    _as_schema_1(ckpt)
    return ckpt, whole, state


def test_schema_1_checkpoint_loads_and_reshards(tmp_path, engine):
    ckpt, whole, state = _schema_1_checkpoint(engine, tmp_path, 3)
    assert engine.checkpoint(str(tmp_path)).index.schema_version == 1
    plain = engine.load(str(tmp_path))
    assert torch.equal(plain["w0"], whole[:25]) and torch.equal(plain["local"], state["local"])
    assert plain["step"] == 3
    # another layout: three row blocks from the two saved
    template = {"w0": Box("w", torch.zeros(10, 6), whole.shape, (0, 0)),
                "w1": Box("w", torch.zeros(20, 6), whole.shape, (10, 0)),
                "w2": Box("w", torch.zeros(10, 6), whole.shape, (30, 0))}
    out = engine.load(str(tmp_path), template=template)
    assert torch.equal(torch.cat([out["w0"], out["w1"], out["w2"]]), whole)

    from tools.inspect_checkpoint import main
    assert main([ckpt, "--verify", "--json"]) == 0


def test_schema_1_manifest_not_the_published_one_is_refused(tmp_path, engine):
    ckpt, _, _ = _schema_1_checkpoint(engine, tmp_path, 1)
    path = os.path.join(ckpt, paths.manifest_file(0))
    with open(path) as f:
        doc = json.load(f)
    body = dict({k: v for k, v in doc.items() if k != "manifest_crc32c"}, direct_io=not doc["direct_io"])
    with open(path, "w") as f:
        json.dump(dict(body, manifest_crc32c=fmt._body_crc(body)), f)  # intact in itself, not the published one
    with pytest.raises(CheckpointError, match="manifest .*rank_00000.manifest.json.* is not the one this "
                                              "checkpoint published"):
        engine.load(ckpt)


def _every_caller(root: str):
    """The checkpoint each caller resolves `root` to."""
    from megatron.training.argument_checks import _loadable
    from tools.convert_checkpoint import resolve_input
    from tools.inspect_checkpoint import Problems, scan_root
    loadable, why = _loadable(root)
    return {"find_latest": tracker.find_latest(root).path, "read_latest": tracker.read_latest(root),
            "--load": loadable, "inspect": scan_root(root, Problems())["latest"],
            "convert": resolve_input(root, None, "datastates")}, why


def test_a_tracker_naming_a_retired_checkpoint_is_skipped_by_every_caller(tmp_path, engine):
    root = str(tmp_path)
    for step in (1, 2):
        engine.save(_state(step)[1], paths.checkpoint_dir(root, step))
        engine.wait()
    assert engine.load(root)["step"] == 2
    retire(paths.checkpoint_dir(root, 2))  # retention ran; the tracker still says 2
    with open(os.path.join(root, paths.TRACKER)) as f:
        assert f.read() == "2"
    seen, _ = _every_caller(root)
    assert seen == {"find_latest": paths.checkpoint_dir(root, 1), "read_latest": 1, "--load": True, "inspect": 1,
                    "convert": paths.checkpoint_dir(root, 1)}
    assert engine.load(root)["step"] == 1


def test_nothing_loadable_is_named_with_the_tracker(tmp_path):
    root = tmp_path / "ck"
    root.mkdir()
    latest = tracker.find_latest(str(root))
    assert latest.path is None and "holds no checkpoint" in latest.why_none()
    (root / paths.TRACKER).write_text("garbage")
    assert "holds 'garbage', not an iteration" in tracker.find_latest(str(root)).why_none()
    (root / paths.TRACKER).write_text("7")
    (root / "iter_0000007.partial").mkdir()
    latest = tracker.find_latest(str(root))
    assert latest.tracker == "7" and latest.iteration is None
    assert "names 7 but" in latest.why_none() and "iter_0000007 is missing" in latest.why_none()
    with pytest.raises(CheckpointError, match="no published checkpoint under"):
        with CheckpointEngine() as eng:
            eng.load(str(root))


def test_megatron_legacy_and_release_directories_are_checkpoints_too(tmp_path):
    root = tmp_path / "ck"
    (root / "iter_0000004" / "mp_rank_00").mkdir(parents=True)  # torch.save format: no index
    (root / paths.TRACKER).write_text("4")
    latest = tracker.find_latest(str(root))
    assert (latest.iteration, latest.path) == (4, str(root / "iter_0000004"))
    (root / "release" / "mp_rank_00").mkdir(parents=True)
    (root / paths.TRACKER).write_text("release")
    assert tracker.find_latest(str(root)).path == str(root / "release")
    shutil.rmtree(root / "release")  # a tracker naming a missing release: the newest iteration instead
    assert tracker.find_latest(str(root)).iteration == 4
    assert tracker.find_latest(str(root / "iter_0000004")).iteration == 4
