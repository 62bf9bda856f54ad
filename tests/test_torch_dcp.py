"""Upstream Megatron-LM's torch_dcp (an `--use-torch-fsdp2 --ckpt-format torch_dcp` run's checkpoint), read and
written. What is read was written by upstream's own code: tests/fixtures/upstream_torch_dcp/, made by megatron-core
0.19.2's `save_checkpoint` on 2 CPU ranks (tests/fixtures/make_upstream_torch_dcp.py records the command), its
fully sharded tensors uneven (9 position rows: 5 and 4). What is written is checked with PyTorch DCP's own
readers. Upstream's own load of torch_dcp cannot run (0.19.2 calls `optimizer.state_dict(is_loading=True)`, which
its ChainedOptimizer refuses), so DCP's stock reader stands for it.
"""
from __future__ import annotations

import os
import shutil

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from megatron_helpers import ROOT, iter_dir, torchrun
from test_reshard import assert_same_tensors, read_full
from test_tools import run_here
from tools import convert_checkpoint as tool
from tools.checkpoint.torch_dcp import read_items

UPSTREAM = os.path.join(ROOT, "tests", "fixtures", "upstream_torch_dcp")
UPSTREAM_MOE = UPSTREAM + "_moe"  # the same model with 2 SequentialMLP experts per layer (no linear biases)
IT = 3
# the fixture's model (make_upstream_torch_dcp.py's FLAGS)
MODEL = ["--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "8",
         "--max-position-embeddings", "9", "--ffn-hidden-size", "18", "--swiglu", "--vocab-size", "32",
         "--make-vocab-size-divisible-by", "32", "--untie-embeddings-and-output-weights", "--bf16",
         "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-3", "--mock-data", "--seed", "1234",
         "--hidden-dropout", "0", "--attention-dropout", "0", "--train-iters", str(IT), "--use-torch-fsdp2",
         "--no-ckpt-fsync"]
MOE = MODEL + ["--disable-bias-linear", "--num-experts", "2", "--moe-router-topk", "2"]


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """The fixture converted to datastates by the tool (in this process): its save root."""
    out = str(tmp_path_factory.mktemp("dcp") / "ds")
    assert tool.main(["--from", "torch_dcp", "--to", "datastates", "--input", UPSTREAM, "--output", out]) == 0
    return out


def test_upstream_checkpoint_converts_to_datastates_and_back_to_the_same_keys_and_bytes(converted, tmp_path,
                                                                                        capsys):
    """torch_dcp -> datastates -> torch_dcp gives back every key upstream wrote (model, Adam's states and step by
    id, fp32 main params, param groups, scheduler, RNG) with the same bytes; what is written is a DCP checkpoint
    that DCP's `dcp_to_torch_save` turns into upstream's nested state dict."""
    back = str(tmp_path / "back")
    rc, out, err = run_here(tool.main, ["--from", "datastates", "--to", "torch_dcp", "--input", converted,
                                        "--output", back], capsys)
    assert rc == 0, err
    assert open(os.path.join(back, "latest_checkpointed_iteration.txt")).read().strip() == str(IT)
    up_t, up_o, _ = read_items(iter_dir(UPSTREAM, IT))
    our_t, our_o, _ = read_items(iter_dir(back, IT))
    assert sorted(our_t) == sorted(up_t) and sorted(our_o) == sorted(up_o)
    assert any(k.startswith("optimizer.optimizer.state.") for k in up_t)
    assert any(k.startswith("optimizer.fp32_from_fp16_params.") for k in up_t)
    for k in up_t:
        assert our_t[k].dtype == up_t[k].dtype and torch.equal(our_t[k], up_t[k]), k
    for k in up_o:
        if k != "args":  # kept as its plain values
            assert repr(our_o[k]) == repr(up_o[k]), k
    assert vars(our_o["args"])["consumed_train_samples"] == up_o["args"].consumed_train_samples
    ours, theirs = (FileSystemReader(iter_dir(d, IT)).read_metadata() for d in (back, UPSTREAM))
    assert ours.planner_data == theirs.planner_data  # each key's place in upstream's nested state dict
    whole = str(tmp_path / "whole.pt")
    dcp_to_torch_save(iter_dir(back, IT), whole)
    nested = torch.load(whole, weights_only=False)
    assert torch.equal(nested["model"]["decoder.layers.1.mlp.linear_fc1.weight"],
                       up_t["model.decoder.layers.1.mlp.linear_fc1.weight"])
    assert nested["optimizer"]["optimizer"]["param_groups"][1]["params"] == \
        up_o["optimizer.optimizer.param_groups.1.params"]
    assert torch.equal(nested["optimizer"]["optimizer"]["state"]["4"]["exp_avg_sq"],
                       up_t["optimizer.optimizer.state.4.exp_avg_sq"])


def test_the_converted_checkpoint_names_megatron_cores_keys(converted):
    tensors, objects = read_full(iter_dir(converted, IT))
    up_t, _, _ = read_items(iter_dir(UPSTREAM, IT))
    # the local layer spec's own rename: input_layernorm -> self_attention.linear_qkv.layer_norm_
    assert torch.equal(tensors["decoder.layers.self_attention.linear_qkv.layer_norm_weight"][1],
                       up_t["model.decoder.layers.1.input_layernorm.weight"])
    assert torch.equal(tensors["optimizer.state.fp32_param.embedding.position_embeddings.weight"],
                       up_t["optimizer.fp32_from_fp16_params.0.1"])
    assert objects["common:optimizer/optimizer/state/common_step"] == 3.0
    assert objects["common:train_state"] == {"consumed_train_samples": 12, "iteration": IT}


def test_upstream_moe_checkpoint_converts_to_megatron_cores_expert_keys_and_back_to_the_same_bytes(tmp_path):
    """Upstream's FSDP2 MoE run keeps its experts in the one optimizer, numbered in module order (each layer's
    router, then expert by expert): to datastates they are megatron-core's SequentialMLP keys, stacked over layers
    and experts, and back to torch_dcp every key and byte is upstream's."""
    ds, back = str(tmp_path / "ds"), str(tmp_path / "back")
    assert tool.main(["--from", "torch_dcp", "--to", "datastates", "--input", UPSTREAM_MOE, "--output", ds]) == 0
    assert tool.main(["--from", "datastates", "--to", "torch_dcp", "--input", ds, "--output", back]) == 0
    up_t, up_o, _ = read_items(iter_dir(UPSTREAM_MOE, IT))
    our_t, our_o, _ = read_items(iter_dir(back, IT))
    assert sorted(our_t) == sorted(up_t) and sorted(our_o) == sorted(up_o)
    for k in up_t:
        assert our_t[k].dtype == up_t[k].dtype and torch.equal(our_t[k], up_t[k]), k
    tensors, _ = read_full(iter_dir(ds, IT))
    expert = "model.decoder.layers.1.mlp.experts.local_experts.1.linear_fc2.weight"
    assert tensors["decoder.layers.mlp.experts.experts.linear_fc2.weight"].shape[:2] == (2, 2)
    assert torch.equal(tensors["decoder.layers.mlp.experts.experts.linear_fc2.weight"][1, 1], up_t[expert])
    # ids 4..8 of layer 0: its router, then expert 0's fc1 and fc2, then expert 1's
    assert torch.equal(tensors["optimizer.state.exp_avg.decoder.layers.mlp.experts.experts.linear_fc1.weight"][0, 1],
                       up_t["optimizer.optimizer.state.7.exp_avg"])


@pytest.mark.parametrize("fixture,model", [(UPSTREAM, MODEL), (UPSTREAM_MOE, MOE)], ids=["dense", "moe"])
def test_an_fsdp2_run_loads_upstreams_checkpoint_model_and_optimizer_bit_equal(fixture, model, tmp_path):
    """--load of the upstream fixture (found by its files) in a 2-rank FSDP2 run, saved again at once: every
    parameter, fp32 main parameter and Adam moment equals the converter's reading, bit for bit."""
    converted = str(tmp_path / "converted")
    assert tool.main(["--from", "torch_dcp", "--to", "datastates", "--input", fixture, "--output", converted]) == 0
    _, log = torchrun(2, model + ["--load", fixture, "--save", str(tmp_path / "again"), "--save-after-load"])
    assert f"successfully loaded upstream's torch_dcp checkpoint {iter_dir(fixture, IT)} at iteration {IT}" in log
    st, so = read_full(iter_dir(converted, IT))
    dt, do = read_full(iter_dir(str(tmp_path / "again"), IT))
    assert assert_same_tensors(st, dt, converted, str(tmp_path / "again")) == len(st)
    for name in ("common:optimizer/optimizer/state/common_step", "common:train_state", "common:opt_param_scheduler"):
        assert so[name] == do[name], name


# ----- bad input: refused before any work, nothing written -----

def test_a_checkpoint_of_another_model_is_refused_naming_the_tensor():
    from datastates import CheckpointError
    from megatron.training.checkpointing.torch_dcp_load import _check
    meta = FileSystemReader(iter_dir(UPSTREAM, IT)).read_metadata().state_dict_metadata
    with pytest.raises(CheckpointError, match=r"'model.embedding.word_embeddings.weight' has shape \(32, 16\), "
                                              r"this run's \(64, 16\)"):
        _check(UPSTREAM, {"model": {"embedding.word_embeddings.weight": torch.empty(64, 16)}}, meta)
    with pytest.raises(CheckpointError, match="has no 'model.decoder.layers.2.input_layernorm.weight'"):
        _check(UPSTREAM, {"model": {"decoder.layers.2.input_layernorm.weight": torch.empty(16)}}, meta)


def test_torch_dcp_into_tensor_parallel_run_is_refused_naming_the_flag():
    import argparse
    from datastates import CheckpointError
    from megatron.training.checkpointing.torch_dcp_load import load
    args = argparse.Namespace(tensor_model_parallel_size=2, pipeline_model_parallel_size=1,
                              use_distributed_optimizer=False)
    with pytest.raises(CheckpointError, match="--tensor-model-parallel-size > 1: convert it with "
                                              "tools/convert_checkpoint.py --from torch_dcp --to datastates"):
        load(args, None, None, None, iter_dir(UPSTREAM, IT))


def test_a_torch_dcp_checkpoint_missing_a_ranks_file_is_refused_and_nothing_is_written(tmp_path, capsys):
    broken = str(tmp_path / "broken")
    shutil.copytree(UPSTREAM, broken)
    os.unlink(os.path.join(iter_dir(broken, IT), "__1_0.distcp"))
    rc, _, err = run_here(tool.main, ["--from", "torch_dcp", "--to", "datastates", "--input", broken,
                                      "--output", str(tmp_path / "out")], capsys)
    assert rc == 1 and f"reading torch_dcp checkpoint '{iter_dir(broken, IT)}' failed" in err
    assert "__1_0.distcp" in err
    assert not os.path.exists(tmp_path / "out")


def test_torch_dist_goes_to_torch_dcp_without_its_optimizer_only(tmp_path, capsys):
    """torch_dist does not record the model's parameter order, which torch_dcp's optimizer ids follow: a
    torch_dist checkpoint with optimizer state is refused naming --exclude-prefix, nothing written; with it, the
    model alone, every tensor as upstream wrote it."""
    td = str(tmp_path / "td")
    assert tool.main(["--from", "torch_dcp", "--to", "torch_dist", "--input", UPSTREAM, "--output", td]) == 0
    refused = str(tmp_path / "refused")
    rc, _, err = run_here(tool.main, ["--from", "torch_dist", "--to", "torch_dcp", "--input", td,
                                      "--output", refused], capsys)
    assert rc == 1 and "holds optimizer state" in err and "pass --exclude-prefix optimizer." in err, err
    assert not os.path.exists(refused)
    out = str(tmp_path / "model")
    assert tool.main(["--from", "torch_dist", "--to", "torch_dcp", "--input", td, "--output", out,
                      "--exclude-prefix", "optimizer."]) == 0
    written, objects, _ = read_items(iter_dir(out, IT))
    upstream, _, _ = read_items(iter_dir(UPSTREAM, IT))
    assert not [k for k in (*written, *objects) if k.startswith("optimizer.")], sorted(written)
    model = sorted(k for k in upstream if k.startswith("model."))
    assert model == sorted(k for k in written if k.startswith("model.")) and len(model) > 10
    for k in model:
        assert written[k].dtype == upstream[k].dtype and torch.equal(written[k], upstream[k]), k


def test_an_upstream_launch_with_ckpt_format_torch_dcp_is_told_to_drop_the_flag():
    """Saving stays this engine's (lazy); the message says the load needs no flag and where torch_dcp is written."""
    from megatron.training.argument_checks import validate_args
    from megatron.training.arguments import ArgumentError, parse_args
    argv = [a for a in MODEL if a != "--no-ckpt-fsync"] + ["--save", "ck", "--ckpt-format", "torch_dcp"]
    with pytest.raises(ArgumentError, match="a torch_dcp checkpoint under --load is found and read without the "
                                            "flag: drop it"):
        validate_args(parse_args(argv=argv), 2, cuda=False)


def test_param_groups_the_default_grouping_does_not_describe_are_refused_and_nothing_is_written(tmp_path):
    """Adam's ids follow megatron-core's default groups (weight decay off for biases and 1-D parameters): a
    checkpoint whose groups say otherwise (here both with weight decay) is refused naming the parameters."""
    from tools.checkpoint.paths import ConvertError
    from tools.checkpoint.torch_dcp import read_torch_dcp, write_torch_dcp
    bundle = read_torch_dcp(UPSTREAM, None)
    for group in bundle.common["optimizer"]["optimizer"]["param_groups"]:
        group["wd_mult"] = 1.0
    with pytest.raises(ConvertError, match=r"no optimizer group holds \['decoder.layers.0.input_layernorm.weight'"):
        write_torch_dcp(bundle, str(tmp_path / "out"))
    assert not os.path.exists(tmp_path / "out")


def test_use_checkpoint_args_reads_upstreams_args():
    from megatron.training.checkpointing.formats import TorchDcpFormat, detect
    fmt = detect(iter_dir(UPSTREAM, IT))
    assert fmt is TorchDcpFormat
    saved = fmt.alone().saved_common(iter_dir(UPSTREAM, IT))
    assert saved["iteration"] == IT
    assert (saved["args"].hidden_size, saved["args"].ffn_hidden_size, saved["args"].use_torch_fsdp2) == (16, 18, True)
