"""tools/inspect_checkpoint.py and tools/convert_checkpoint.py, run as the CLI (real exit codes).

A two-rank checkpoint is built in this process with the engine and megatron-core ShardedTensors through
datastates/megatron.py: a TP-split embedding, a layer-stacked weight (prepended axis, one layer per rank), a
DP-replicated layer norm (written by rank 0 only), optimizer state, a ShardedObject grid and common objects.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from datastates import CheckpointEngine, PosixOptions, paths, tracker, format as fmt

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INSPECT = os.path.join(REPO, "tools", "inspect_checkpoint.py")
CONVERT = os.path.join(REPO, "tools", "convert_checkpoint.py")

EMB = "embedding.word_embeddings.weight"
QKV = "decoder.layers.self_attention.linear_qkv.weight"
NORM = "decoder.final_layernorm.weight"
OPT = "optimizer.state.exp_avg." + EMB


def full_tensors():
    g = torch.Generator().manual_seed(0)
    return {EMB: torch.randn(8, 6, generator=g), QKV: torch.randn(2, 6, 4, generator=g),
            NORM: torch.randn(6, generator=g), OPT: torch.randn(8, 6, generator=g)}


ARGS = argparse.Namespace(hidden_size=6, num_layers=2, lr=1e-3)


def rank_state(rank, full, world=2, with_common=True):
    """Rank `rank`'s megatron-style sharded state dict of the layout TP=world (rows) / PP=world (layers)."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
    from datastates.megatron import Common
    rows = 8 // world
    state = {
        "model": {
            EMB: ShardedTensor.from_rank_offsets(EMB, full[EMB][rank * rows:(rank + 1) * rows].clone(),
                                                 (0, rank, world), replica_id=0),
            QKV: ShardedTensor.from_rank_offsets(QKV, full[QKV][rank].clone(), (0, rank, world), replica_id=0,
                                                 prepend_axis_num=1),
            NORM: ShardedTensor.from_rank_offsets(NORM, full[NORM].clone(), replica_id=rank),
        },
        "optimizer": {"state": {OPT: ShardedTensor.from_rank_offsets(
            OPT, full[OPT][rank * rows:(rank + 1) * rows].clone(), (0, rank, world), replica_id=0)}},
        "rng_state": ShardedObject("rng_state", [f"rng of rank {rank}"], (world,), (rank,), replica_id=0),
    }
    if with_common:
        state["args"] = Common(ARGS)
        state["iteration"] = Common(7)
    return state


def save_two_ranks(path, full):
    from datastates.megatron import ReplicaOwnership, make_registry, prepare_for_save
    store = torch.distributed.HashStore()
    engines = [CheckpointEngine(host_buffer_bytes=1 << 20, storage=PosixOptions(writer_threads=2), rank=r,
                                world_size=2, store=store,
                                registry=make_registry(ReplicaOwnership()), publish_timeout_s=60) for r in (0, 1)]
    try:
        for r, eng in enumerate(engines):
            # Common objects only in rank 0's state (one process: every engine would think it is global rank 0)
            st = prepare_for_save(rank_state(r, full, with_common=r == 0))
            st["local_step"] = torch.tensor([r])
            eng.save(st, path)
        for eng in engines:
            eng.wait()
    finally:
        for eng in engines:
            eng.close()


def run(tool, *args, cwd=None):
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    p = subprocess.run([sys.executable, tool, *map(str, args)], capture_output=True, text=True, timeout=400,
                       cwd=cwd, env=env)
    return p.returncode, p.stdout, p.stderr


def run_here(main, args, capsys):
    """The CLI's main() in this process (cheaper than a subprocess: no second torch/megatron import)."""
    capsys.readouterr()
    rc = main([str(a) for a in args])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("ds")
    full = full_tensors()
    save_two_ranks(str(paths.checkpoint_dir(str(root), 7)), full)
    return str(root), full


def copy_iter(ckpt, tmp_path, name="iter_0000007"):
    root, _ = ckpt
    dst = tmp_path / "root"
    shutil.copytree(root, dst)
    return str(dst), str(dst / name)


# ----- inspect -----

def test_inspect_root_lists_iterations_latest_and_leftovers(ckpt, tmp_path, capsys):
    root, it = copy_iter(ckpt, tmp_path)
    leftover = os.path.join(root, "iter_0000009.partial")
    shutil.copytree(it, leftover)
    os.unlink(os.path.join(leftover, "metadata.json"))
    os.unlink(os.path.join(leftover, "rank_00001.manifest.json"))
    rc, out, err = run(INSPECT, root, "--json")
    assert rc == 0, err
    doc = json.loads(out)
    entries = {e["name"]: e for e in doc["root"]["entries"]}
    assert doc["root"]["latest"] == 7
    assert entries["iter_0000007"]["latest"] and entries["iter_0000007"]["state"] == "published"
    assert entries["iter_0000009.partial"]["state"].startswith("UNPUBLISHED")
    assert entries["iter_0000009.partial"]["ranks_done"] == 1
    from tools.inspect_checkpoint import main
    rc, out, _ = run_here(main, [root], capsys)
    assert rc == 0 and "<- latest" in out and "UNPUBLISHED" in out


def test_inspect_iteration_shows_layout(ckpt, capsys):
    root, full = ckpt
    rc, out, err = run(INSPECT, root, "--iteration", 7, "--json")
    assert rc == 0, err
    rep = json.loads(out)["checkpoint"]
    assert rep["world_size"] == 2 and rep["published"] and len(rep["ranks"]) == 2
    assert all(r["data_bytes"] > 0 for r in rep["ranks"])
    emb = rep["tensors"][EMB]
    assert emb["global_shape"] == [8, 6] and emb["dtype"] == "float32"
    assert sorted((s["rank"], tuple(s["offset"]), tuple(s["shape"])) for s in emb["shards"]) == \
        [(0, (0, 0), (4, 6)), (1, (4, 0), (4, 6))]
    qkv = rep["tensors"][QKV]
    assert qkv["global_shape"] == [2, 6, 4]
    assert sorted(tuple(s["offset"]) for s in qkv["shards"]) == [(0, 0, 0), (1, 0, 0)]
    norm = {s["rank"]: s["write"] for s in rep["tensors"][NORM]["shards"]}
    assert norm == {0: True, 1: False}  # the DP replica is held by rank 1 but written by rank 0
    assert "common:args" in rep["objects"]["global"] and "rng_state@1" in rep["objects"]["global"]
    assert {t["rank"] for t in rep["local_tensors"]} == {0, 1}
    from tools.inspect_checkpoint import main
    rc, out, _ = run_here(main, [os.path.join(root, "iter_0000007")], capsys)
    assert rc == 0 and "[4:8, 0:6]  rank 1  written" in out and "replica, not written here" in out


def test_verify_passes_on_a_good_checkpoint(ckpt):
    root, _ = ckpt
    rc, out, err = run(INSPECT, root, "--verify")
    assert rc == 0, out + err
    assert "verify: OK" in out


def _first_item(manifest_path):
    doc = json.load(open(manifest_path))
    return next(i for i in doc["items"] if i["kind"] == "tensor" and i.get("write", True) and i["nbytes"] > 0)


def test_verify_works_without_tqdm(ckpt, monkeypatch, capsys):
    from tools.inspect_checkpoint import main
    monkeypatch.setitem(sys.modules, "tqdm", None)  # as if the `tools` extra were not installed
    rc, out, err = run_here(main, [ckpt[0], "--verify"], capsys)
    assert rc == 0 and "verify: OK" in out, out + err


def test_verify_fails_on_a_flipped_byte(ckpt, tmp_path, capsys):
    _, it = copy_iter(ckpt, tmp_path)
    item = _first_item(os.path.join(it, "rank_00001.manifest.json"))
    data = os.path.join(it, "rank_00001.data")
    with open(data, "r+b") as f:
        f.seek(item["offset"] + 5)
        b = f.read(1)
        f.seek(item["offset"] + 5)
        f.write(bytes([b[0] ^ 0x40]))
    from tools.inspect_checkpoint import main
    rc, _, err = run_here(main, [it], capsys)  # structure is intact: only reading the bytes shows it
    assert rc == 0, err
    rc, _, err = run(INSPECT, it, "--verify")
    assert rc == 1
    assert "rank_00001.data" in err and "checksum mismatch" in err and item["id"] in err


def _flip_first_byte(it, rank):
    """Damage the first written tensor of `rank` (its first chunk); (item id, the chunk's file offset)."""
    item = _first_item(os.path.join(it, f"rank_{rank:05d}.manifest.json"))
    with open(os.path.join(it, f"rank_{rank:05d}.data"), "r+b") as f:
        f.seek(item["offset"])
        b = f.read(1)
        f.seek(item["offset"])
        f.write(bytes([b[0] ^ 0x01]))
    return item["id"], item["offset"]


def test_verify_reports_every_problem_in_one_run(ckpt, tmp_path, capsys):
    """Two ranks' bad chunks and a third problem (a short file) in one --verify: each named with rank, item and
    file offset (the engine's collecting read, datastates.audit)."""
    from tools.inspect_checkpoint import main
    _, it = copy_iter(ckpt, tmp_path)
    bad = {r: _flip_first_byte(it, r) for r in (0, 1)}
    data = os.path.join(it, "rank_00001.data")
    os.truncate(data, os.path.getsize(data) - 1)
    rc, out, _ = run_here(main, [it, "--verify", "--json"], capsys)
    assert rc == 1
    problems = json.loads(out)["problems"]
    found = {(p["rank"], p["item"], p["offset"]) for p in problems if "checksum mismatch" in p["problem"]}
    assert found == {(r, item, offset) for r, (item, offset) in bad.items()}
    assert [p["rank"] for p in problems if "truncated" in p["problem"]] == [1]


def test_inspect_reports_every_malformed_item_of_a_manifest(ckpt, tmp_path, capsys):
    """inspect validates manifests as a load does (datastates.schema), and lists every problem, not the first."""
    from tools.inspect_checkpoint import main
    _, it = copy_iter(ckpt, tmp_path)
    path = os.path.join(it, "rank_00001.manifest.json")
    with open(path) as f:
        doc = json.load(f)
    first, second = [i for i in doc["items"] if i["kind"] == "tensor" and i.get("write", True) and i["nbytes"]][:2]
    first["offset"] = doc["data_bytes"]  # outside the data file
    second["nbytes"] += 4  # not what its dtype and shape hold
    body = {k: v for k, v in doc.items() if k != "manifest_crc32c"}
    with open(path, "w") as f:
        json.dump(dict(body, manifest_crc32c=fmt._body_crc(body)), f)  # re-signed: only validation can tell
    rc, _, err = run_here(main, [it], capsys)
    assert rc == 1 and f"item {first['id']!r}" in err and "outside the data file" in err, err
    assert f"item {second['id']!r}" in err and "does not match" in err, err


def test_verify_fails_on_a_truncated_data_file(ckpt, tmp_path, capsys):
    from tools.inspect_checkpoint import main
    _, it = copy_iter(ckpt, tmp_path)
    data = os.path.join(it, "rank_00000.data")
    os.truncate(data, os.path.getsize(data) - 100)
    rc, _, err = run_here(main, [it, "--verify"], capsys)
    assert rc == 1 and "rank_00000.data" in err and "truncated" in err


def test_verify_fails_without_a_rank_manifest(ckpt, tmp_path, capsys):
    from tools.inspect_checkpoint import main
    _, it = copy_iter(ckpt, tmp_path)
    os.unlink(os.path.join(it, "rank_00001.manifest.json"))
    rc, _, err = run_here(main, [it, "--verify"], capsys)
    assert rc == 1 and "rank_00001.manifest.json" in err and "missing" in err


def test_verify_fails_when_metadata_omits_a_rank(ckpt, tmp_path, capsys):
    _, it = copy_iter(ckpt, tmp_path)
    meta_path = os.path.join(it, "metadata.json")
    meta = json.load(open(meta_path))
    del meta["manifests"]["1"], meta["ranks"]["1"]  # a forged index: re-signed, so only coverage can tell
    meta["metadata_crc32c"] = fmt._body_crc({k: v for k, v in meta.items() if k != "metadata_crc32c"})
    json.dump(meta, open(meta_path, "w"))
    from tools.inspect_checkpoint import main
    rc, _, err = run_here(main, [it, "--verify"], capsys)
    assert rc == 1 and "metadata does not list rank 1" in err


def test_inspect_usage_errors(tmp_path, capsys):
    from tools.inspect_checkpoint import main
    rc, _, err = run_here(main, [tmp_path / "nope"], capsys)
    assert rc == 2 and "does not exist" in err


# ----- convert -----

@pytest.fixture(scope="module")
def torch_dist_ckpt(ckpt, tmp_path_factory):
    root, _ = ckpt
    out = tmp_path_factory.mktemp("td")
    rc, _, err = run(CONVERT, "--from", "datastates", "--to", "torch_dist", "--input", root, "--output", out)
    assert rc == 0, err
    return out


def test_datastates_to_torch_dist_loads_with_stock_megatron(ckpt, torch_dist_ckpt, gloo):
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
    root, full = ckpt
    td = torch_dist_ckpt / "iter_0000007"
    assert (torch_dist_ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "7"
    sd = {k: ShardedTensor.from_rank_offsets(k, torch.zeros_like(v)) for k, v in full.items()}
    sd["rng"] = [ShardedObject("rng_state", None, (2,), (r,), replica_id=0) for r in (0, 1)]
    loaded = dist_checkpointing.load(sd, str(td))
    for k, v in full.items():
        assert torch.equal(loaded[k], v), k
    assert loaded["rng"] == [["rng of rank 0"], ["rng of rank 1"]]
    assert loaded["args"] == ARGS and loaded["iteration"] == 7
    assert torch.equal(loaded["local_step"], torch.tensor([0]))  # rank 0's local items join the common state


def test_torch_dist_output_holds_a_chunk_per_layer(torch_dist_ckpt):
    """A reader of one layer (the Hugging Face export) reads that layer's chunk alone: a layer-stacked tensor is
    saved as one chunk per layer, any other tensor as one chunk."""
    from torch.distributed.checkpoint import FileSystemReader
    chunks = FileSystemReader(str(torch_dist_ckpt / "iter_0000007")).read_metadata().state_dict_metadata
    assert sorted((tuple(c.offsets), tuple(c.sizes)) for c in chunks[QKV].chunks) == [((0, 0, 0), (1, 6, 4)),
                                                                                       ((1, 0, 0), (1, 6, 4))]
    assert [tuple(c.sizes) for c in chunks[EMB].chunks] == [(8, 6)]


def test_a_torch_dist_write_that_fails_midway_leaves_nothing(tmp_path):
    """Two layers are in the file when the third fails: the partial directory goes, nothing is published."""
    sys.path.insert(0, REPO)
    from tools.checkpoint.paths import ConvertError
    from tools.checkpoint.torch_dist_writer import Pieces, save_torch_dist
    layers = torch.randn(3, 4, 4)
    pieces = Pieces((3, 4, 4), torch.float32, 1, lambda i: layers[i] if i != (2,) else torch.zeros(5))
    with pytest.raises(ConvertError, match=r"piece \(2,\) of 'w' was built as \(5,\)"):
        save_torch_dist({"w": pieces}, {}, {}, {"iteration": 1}, str(tmp_path / "iter_0000001"))
    assert os.listdir(tmp_path) == []


def test_torch_dist_to_datastates_loads_with_the_engine(ckpt, torch_dist_ckpt, tmp_path):
    root, full = ckpt
    rc, out, err = run(CONVERT, "--from", "torch_dist", "--to", "datastates", "--input", torch_dist_ckpt,
                       "--output", tmp_path / "ds")
    assert rc == 0, err
    ds = tmp_path / "ds"
    assert tracker.read_latest(str(ds)) == 7
    from tools.inspect_checkpoint import main
    assert main([str(ds), "--verify"]) == 0
    from datastates.megatron import load_sharded, make_registry
    for r in (0, 1):  # each rank of a two-rank layout reads its shards from the world-1 checkpoint
        with CheckpointEngine(host_buffer_bytes=1 << 20, storage=PosixOptions(writer_threads=2), rank=r, world_size=2,
                              registry=make_registry()) as eng:
            template = rank_state(r, {k: torch.zeros_like(v) for k, v in full.items()})
            got = load_sharded(eng, template, str(ds))
            assert torch.equal(got["model"][EMB], full[EMB][r * 4:(r + 1) * 4])
            assert torch.equal(got["model"][QKV], full[QKV][r])
            assert torch.equal(got["model"][NORM], full[NORM])
            assert torch.equal(got["optimizer"]["state"][OPT], full[OPT][r * 4:(r + 1) * 4])
            assert got["rng_state"] == [f"rng of rank {r}"]
            assert got["args"] == ARGS and got["iteration"] == 7


def test_datastates_to_datastates_keeps_a_tensor_valued_common_entry(ckpt, tmp_path, capsys):
    """Rank 0's `local_step`, a tensor in the common state, comes out of a datastates -> datastates conversion as a
    tensor the engine reads back (not a pickled tensor, which the restricted unpickler refuses), beside the
    common objects."""
    from datastates import CheckpointReader
    from tools.convert_checkpoint import main
    root, _ = ckpt
    rc, _, err = run_here(main, ["--from", "datastates", "--to", "datastates", "--input", root,
                                 "--output", tmp_path / "ds"], capsys)
    assert rc == 0, err
    with CheckpointReader.open(str(tmp_path / "ds")) as reader:
        common = reader.common()
    assert torch.equal(common["local_step"], torch.tensor([0])), common
    assert common["args"] == ARGS and common["iteration"] == 7, common


def test_datastates_to_safetensors(ckpt, tmp_path, capsys):
    from safetensors import safe_open
    from safetensors.torch import load_file
    root, full = ckpt
    out = tmp_path / "model.safetensors"
    rc, _, err = run(CONVERT, "--from", "datastates", "--to", "safetensors", "--input", root, "--output", out)
    assert rc == 0, err
    tensors = load_file(str(out))
    expected = {EMB: full[EMB], NORM: full[NORM], "decoder.layers.0.self_attention.linear_qkv.weight": full[QKV][0],
                "decoder.layers.1.self_attention.linear_qkv.weight": full[QKV][1]}
    assert set(tensors) == set(expected)  # optimizer state is not a model weight
    for k, v in expected.items():
        assert torch.equal(tensors[k], v), k
    with safe_open(str(out), "pt") as f:
        name_map = json.loads(f.metadata()["name_map"])
    assert name_map["decoder.layers.1.self_attention.linear_qkv.weight"]["key"] == QKV
    assert name_map["decoder.layers.1.self_attention.linear_qkv.weight"]["index"] == [1]
    sidecar = json.load(open(str(out) + ".names.json"))
    assert sidecar["tensors"] == name_map
    from tools.convert_checkpoint import main
    rc, _, err = run_here(main, ["--from", "datastates", "--to", "safetensors", "--input", root, "--output", out],
                          capsys)
    assert rc == 1 and "already exists" in err


# ----- convert: errors -----

def test_convert_unknown_format(ckpt, tmp_path):  # argparse exits before the heavy imports matter
    root, _ = ckpt
    rc, _, err = run(CONVERT, "--from", "deepspeed", "--to", "safetensors", "--input", root, "--output",
                     tmp_path / "x.safetensors")
    assert rc == 2 and "invalid choice" in err


def test_convert_refuses_unpublished(ckpt, tmp_path):
    from tools.convert_checkpoint import main
    root, it = copy_iter(ckpt, tmp_path)
    partial = it + ".partial"
    shutil.copytree(it, partial)
    rc, _, err = run(CONVERT, "--from", "datastates", "--to", "safetensors", "--input", partial,
                     "--output", tmp_path / "a.safetensors")
    assert rc == 1 and partial in err and "not published" in err
    os.unlink(os.path.join(it, "metadata.json"))
    assert main(["--from", "datastates", "--to", "safetensors", "--input", it,
                 "--output", str(tmp_path / "b.safetensors")]) == 1
    assert not (tmp_path / "b.safetensors").exists()


def test_convert_refuses_a_damaged_input_naming_every_bad_chunk(ckpt, tmp_path, capsys):
    from tools.convert_checkpoint import main
    _, it = copy_iter(ckpt, tmp_path)
    bad = [_flip_first_byte(it, r)[0] for r in (0, 1)]
    out = tmp_path / "e.safetensors"
    assert main(["--from", "datastates", "--to", "safetensors", "--input", it, "--output", str(out)]) == 1
    err = capsys.readouterr().err
    assert "2 problem(s)" in err and all(f"item {b!r}" in err for b in bad), err
    assert not out.exists()


def test_convert_refuses_missing_rank_files(ckpt, tmp_path, capsys):
    from tools.convert_checkpoint import main
    _, it = copy_iter(ckpt, tmp_path)
    os.unlink(os.path.join(it, "rank_00001.data"))
    assert main(["--from", "datastates", "--to", "safetensors", "--input", it,
                 "--output", str(tmp_path / "c.safetensors")]) == 1
    err = capsys.readouterr().err
    assert "rank_00001.data" in err and "missing" in err


def test_convert_refuses_a_tensor_not_fully_saved(tmp_path, capsys):
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from datastates.megatron import make_registry, save_sharded
    from tools.convert_checkpoint import main
    path = paths.checkpoint_dir(str(tmp_path / "half"), 1)
    with CheckpointEngine(host_buffer_bytes=1 << 20, storage=PosixOptions(writer_threads=2), rank=0, world_size=1,
                          registry=make_registry()) as eng:  # one rank saves the first half of a (4, 6) tensor
        save_sharded(eng, {"w": ShardedTensor.from_rank_offsets("w", torch.ones(2, 6), (0, 0, 2))}, path)
    from tools.inspect_checkpoint import main as inspect_main
    rc, _, err = run_here(inspect_main, [path], capsys)
    assert rc == 1 and "not fully saved" in err
    assert main(["--from", "datastates", "--to", "safetensors", "--input", path,
                 "--output", str(tmp_path / "d.safetensors")]) == 1
    err = capsys.readouterr().err
    assert path in err and "'w'" in err and "12 of 24 elements" in err
