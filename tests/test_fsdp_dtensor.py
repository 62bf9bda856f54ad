"""Upstream Megatron-LM's fsdp_dtensor (Megatron-FSDP's checkpoint format), read and written by
tools/convert_checkpoint.py, in this process. What is read was written by upstream's own code: tests/fixtures/
upstream_fsdp_dtensor/ holds a torch_dist checkpoint stock megatron-core 0.19.2 saved on 2 CPU ranks, what
upstream's converter (`checkpoint_inspector.py convert-torch-dist-to-fsdp-dtensor --swiglu`) made of it, and its
weights cut unevenly as a Megatron-FSDP save cuts them (megatron-fsdp's own chunk metadata);
tests/fixtures/make_upstream_fsdp_dtensor.py records the command. What is written is read back with PyTorch
DCP's own reader and compared with the converter's output of the same source.
"""
from __future__ import annotations

import os
import pickle
import shutil

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from megatron_helpers import ROOT, iter_dir
from test_reshard import read_full
from test_tools import run_here
from tools import convert_checkpoint as tool
from tools.checkpoint.fsdp_dtensor import read_fsdp_dtensor
from tools.checkpoint.torch_dcp import read_items
from tools.checkpoint.torch_dist import close_megatron, read_torch_dist

FIXTURE = os.path.join(ROOT, "tests", "fixtures", "upstream_fsdp_dtensor")
UPSTREAM, SOURCE = os.path.join(FIXTURE, "fsdp_dtensor"), os.path.join(FIXTURE, "torch_dist")
IT = 3
FC1 = "model.module.decoder.layers.{}.mlp.linear_fc1.weight"
# the converter's copy of megatron-core 0.19's internal common-state object: not what a training save holds
COPIED = "common_state/shard_0_1"


@pytest.fixture(scope="module")
def source():
    """The torch_dist checkpoint the reference was made from, read by megatron-core's own loader."""
    try:
        return read_torch_dist(SOURCE, None)
    finally:
        close_megatron()


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("fd") / "ds")
    assert tool.main(["--from", "fsdp_dtensor", "--to", "datastates", "--input", UPSTREAM, "--output", out]) == 0
    return out


def test_upstreams_fsdp_dtensor_reads_bit_equal_to_its_torch_dist_source(converted, source):
    """Every model tensor, fp32 main parameter and Adam moment of the datastates output equals megatron-core's
    torch_dist source bit for bit: layers stacked back, fc1's `_w`/`_v` halves joined in megatron-core's order."""
    tensors, objects = read_full(iter_dir(converted, IT))
    assert sorted(tensors) == sorted(source.tensors)
    assert {k.split(".")[2] for k in tensors if k.startswith("optimizer.")} == {"exp_avg", "exp_avg_sq", "param"}
    for k, t in source.tensors.items():
        assert tensors[k].dtype == t.dtype and torch.equal(tensors[k], t), k
    up, _, _ = read_items(iter_dir(UPSTREAM, IT))
    fc1 = tensors["decoder.layers.mlp.linear_fc1.weight"]
    assert torch.equal(fc1[1, :18], up[FC1.format(1) + "_w"]) and torch.equal(fc1[1, 18:], up[FC1.format(1) + "_v"])
    assert objects["common:iteration"] == IT
    assert objects["common:opt_param_scheduler"] == source.common["opt_param_scheduler"]
    assert objects["common:optimizer/optimizer/param_groups"] == source.common["optimizer"]["optimizer"][
        "param_groups"]
    assert objects["common:train_state"] == {"consumed_train_samples": 12, "iteration": IT}


def test_uneven_shards_as_a_training_save_cuts_them_read_the_same(converted):
    """A tensor's rows cut unevenly over the ranks (megatron-fsdp's own chunk metadata, as Megatron-FSDP saves):
    read into the same full tensors as the even layout of the same weights."""
    uneven = os.path.join(FIXTURE, "fsdp_dtensor_uneven")
    meta = FileSystemReader(iter_dir(uneven, IT)).read_metadata().state_dict_metadata
    assert [tuple(c.sizes) for c in meta[FC1.format(0) + "_w"].chunks] == [(12, 16), (6, 16)]
    bundle = read_fsdp_dtensor(uneven, None)
    tensors, _ = read_full(iter_dir(converted, IT))
    assert sorted(bundle.tensors) == sorted(k for k in tensors if not k.startswith("optimizer."))
    for k, t in bundle.tensors.items():
        assert torch.equal(t, tensors[k]), k


def test_fsdp_dtensor_converts_to_torch_dist_safetensors_and_hugging_face(tmp_path, source, capsys):
    """To megatron-core's torch_dist (read back by its loader: the source's tensors), and to a Llama model whose
    gate and up projections are fc1's `_w` and `_v` halves."""
    td = str(tmp_path / "td")
    rc, _, err = run_here(tool.main, ["--from", "fsdp_dtensor", "--to", "torch_dist", "--input", UPSTREAM,
                                      "--output", td], capsys)
    assert rc == 0, err
    try:
        back = read_torch_dist(td, None)
    finally:
        close_megatron()
    for k, t in source.tensors.items():
        assert torch.equal(back.tensors[k], t), k
    hf = str(tmp_path / "hf")
    rc, _, err = run_here(tool.main, ["--from", "fsdp_dtensor", "--to", "hf", "--input", UPSTREAM, "--output", hf],
                          capsys)
    assert rc == 0, err
    weights = load_file(os.path.join(hf, "model-00001-of-00001.safetensors"))
    up, _, _ = read_items(iter_dir(UPSTREAM, IT))
    assert torch.equal(weights["model.layers.0.mlp.gate_proj.weight"], up[FC1.format(0) + "_w"])
    assert torch.equal(weights["model.layers.0.mlp.up_proj.weight"], up[FC1.format(0) + "_v"])
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".")]  # the staged datastates input is gone
    st = str(tmp_path / "m.safetensors")
    rc, _, err = run_here(tool.main, ["--from", "fsdp_dtensor", "--to", "safetensors", "--input", UPSTREAM,
                                      "--output", st], capsys)
    assert rc == 0, err
    assert torch.equal(load_file(st)["decoder.layers.1.mlp.linear_fc1.weight"],
                       source.tensors["decoder.layers.mlp.linear_fc1.weight"][1])


@pytest.mark.parametrize("src", ["datastates", "torch_dist"])
def test_written_fsdp_dtensor_equals_upstreams_converter_output(src, converted, source, tmp_path, capsys):
    """--to fsdp_dtensor from datastates (the fixture, converted) and from the torch_dist source: DCP's reader
    finds every key upstream's converter wrote with the same global shape, dtype and bytes, and the same objects
    (a torch_dist source's RNG, which the converter drops, is kept as a training save keeps it)."""
    out = str(tmp_path / "fd")
    rc, _, err = run_here(tool.main, ["--from", src, "--to", "fsdp_dtensor", "--input",
                                      converted if src == "datastates" else SOURCE, "--output", out], capsys)
    assert rc == 0, err
    assert open(os.path.join(out, "latest_checkpointed_iteration.txt")).read().strip() == str(IT)
    ours, theirs = (FileSystemReader(iter_dir(d, IT)).read_metadata().state_dict_metadata for d in (out, UPSTREAM))
    extra = {k for k in ours if k.startswith("rng_state.(0, 0).0.")} if src == "torch_dist" else set()
    assert set(ours) - extra == set(theirs) - {COPIED}
    our_t, our_o, _ = read_items(iter_dir(out, IT))
    up_t, up_o, _ = read_items(iter_dir(UPSTREAM, IT))
    for k, t in up_t.items():
        assert tuple(ours[k].size) == tuple(theirs[k].size) and our_t[k].dtype == t.dtype, k
        assert torch.equal(our_t[k], t), k
    for k, v in up_o.items():
        if k not in ("args", COPIED):
            assert repr(our_o[k]) == repr(v), k
    for field in ("hidden_size", "ffn_hidden_size", "swiglu", "consumed_train_samples", "normalization"):
        assert getattr(our_o["args"], field) == getattr(up_o["args"], field), field
    if src == "torch_dist":  # RNG as a training save keeps it, read back as the source's
        saved = source.objects[("rng_state", (0, 0))][0]
        state = read_fsdp_dtensor(out, None).objects[("rng_state", (0, 0, 0))][0]
        assert state["random_rng_state"] == saved["random_rng_state"]
        assert state["torch_rng_state"] == saved["torch_rng_state"].numpy().tobytes()
        assert state["rng_tracker_states"].keys() == saved["rng_tracker_states"].keys()
    whole = str(tmp_path / "whole.pt")
    dcp_to_torch_save(iter_dir(out, IT), whole)
    assert torch.equal(torch.load(whole, weights_only=False)[FC1.format(0) + "_v"], up_t[FC1.format(0) + "_v"])


# ----- bad input: refused before any work, nothing written -----

def _drop_a_chunk(ckpt: str, key: str) -> None:
    """DCP's metadata of `ckpt` with the last chunk of `key` left out (its bytes stay in the data files)."""
    path = os.path.join(ckpt, ".metadata")
    meta = FileSystemReader(ckpt).read_metadata()
    meta.state_dict_metadata[key].chunks.pop()
    with open(path, "wb") as f:
        pickle.dump(meta, f)


def test_shards_that_do_not_cover_a_tensor_are_refused_naming_it(tmp_path, capsys):
    broken = str(tmp_path / "broken")
    shutil.copytree(UPSTREAM, broken)
    _drop_a_chunk(iter_dir(broken, IT), FC1.format(1) + "_v")
    rc, _, err = run_here(tool.main, ["--from", "fsdp_dtensor", "--to", "datastates", "--input", broken,
                                      "--output", str(tmp_path / "out")], capsys)
    assert rc == 1
    assert f"the shards of '{FC1.format(1)}_v' (global shape (18, 16)) do not cover it: 144 of 288" in err
    assert not os.path.exists(tmp_path / "out")


def test_load_tells_fsdp_dtensor_from_torch_dcp_and_refuses_it_naming_the_conversion():
    """--load finds upstream's fsdp_dtensor by its keys (not as torch_dcp) and says how to read it."""
    from datastates import CheckpointError
    from megatron.training.checkpointing.formats import FsdpDtensorFormat, detect
    assert detect(iter_dir(UPSTREAM, IT)) is FsdpDtensorFormat
    with pytest.raises(CheckpointError, match="--load does not read: convert it first with "
                                              "tools/convert_checkpoint.py --from fsdp_dtensor --to datastates"):
        FsdpDtensorFormat.alone().load(None, iter_dir(UPSTREAM, IT), "load")
    assert FsdpDtensorFormat.alone().saved_common(iter_dir(UPSTREAM, IT))["args"].hidden_size == 16


def test_ckpt_format_fsdp_dtensor_is_refused_naming_the_converter():
    from megatron.training.argument_checks import validate_args
    from megatron.training.arguments import ArgumentError, parse_args
    argv = ["--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "8",
            "--max-position-embeddings", "8", "--vocab-size", "32", "--micro-batch-size", "1", "--lr", "1e-3",
            "--mock-data", "--train-iters", "1", "--save", "ck", "--ckpt-format", "fsdp_dtensor"]
    with pytest.raises(ArgumentError, match="upstream's fsdp_dtensor format is not saved here.*"
                                            "tools/convert_checkpoint.py --from/--to fsdp_dtensor reads and writes"):
        validate_args(parse_args(argv=argv), 2, cuda=False)
