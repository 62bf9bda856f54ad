"""Virtual pipeline stages end to end through pretrain_gpt.py: PP2 with two model chunks per rank (megatron-core's
interleaved schedule), 2 CPU ranks (gloo), real torchrun runs.

One uninterrupted run of 2N iterations (distributed optimizer, fully_reshardable, saving at N) is the reference
loss curve and the source checkpoint:

- the checkpoint places each chunk's layers at their global offsets: pipeline rank 0 holds layers 0 and 2 (its
  chunks are virtual stages 0 and 2), rank 1 layers 1 and 3;
- exact resume: N iterations, stop, resume (dp_reshardable): losses bit-equal to the reference;
- resharding: the iteration-N checkpoint converted (--save-after-load) to PP2 without virtual stages, and that
  one back to two virtual stages: every tensor (model, fp32 main params, both Adam moments) bit-equal;
- the legacy torch format keys the chunks as upstream does: `model0`, `model1`.
"""
from __future__ import annotations

import json
import os

import pytest
import torch

from megatron_helpers import convert, iter_dir, losses, saving_run, torchrun
from test_reshard import assert_same_tensors, read_full

N = 3
PP2 = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
       "--vocab-size", "128", "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "1e-3", "--mock-data",
       "--seed", "1234", "--train-iters", str(2 * N), "--pipeline-model-parallel-size", "2", "--bf16",
       "--no-ckpt-fsync"]
VPP2 = PP2 + ["--num-virtual-stages-per-pipeline-rank", "2"]
DIST = ["--use-distributed-optimizer"]
FULLY = DIST + ["--dist-ckpt-optim-fully-reshardable"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("vpp") / "vpp2")
    return root, saving_run(2, VPP2 + FULLY, root, N, 2 * N)


def _layers_of(ckpt: str, rank: int) -> set[int]:
    """The global layer numbers of the model tensors in `rank`'s part of a datastates checkpoint."""
    doc = json.load(open(os.path.join(ckpt, f"rank_{rank:05d}.manifest.json")))
    return {int(it["id"].split("@")[1].split(",")[0]) for it in doc["items"]
            if it.get("name", "").startswith("decoder.layers.") and it["kind"] == "tensor"}


def test_chunks_hold_their_global_layers(reference):
    root, _ = reference
    assert _layers_of(iter_dir(root, N), 0) == {0, 2}
    assert _layers_of(iter_dir(root, N), 1) == {1, 3}


def test_exact_resume(tmp_path, reference):
    _, ref = reference
    ck = str(tmp_path / "ck")
    flags = VPP2 + DIST + ["--save", ck, "--load", ck, "--async-ckpt"]
    _, log1 = torchrun(2, flags + ["--exit-interval", str(N)])
    _, log2 = torchrun(2, flags)
    assert f"at iteration {N}" in log2, log2[-3000:]
    second = losses(log2)
    assert sorted(second) == list(range(N + 1, 2 * N + 1)), log2[-3000:]
    assert {**losses(log1), **second} == ref


def test_reshard_to_no_virtual_stages_and_back(tmp_path, reference):
    root, _ = reference
    src = iter_dir(root, N)
    flat = convert(2, PP2 + FULLY, src, str(tmp_path / "pp2"), N)
    assert _layers_of(flat, 0) == {0, 1}
    st = read_full(src)[0]
    assert assert_same_tensors(st, read_full(flat)[0], src, flat) > 20
    back = convert(2, VPP2 + FULLY, flat, str(tmp_path / "vpp2"), N)
    assert _layers_of(back, 0) == {0, 2}
    assert_same_tensors(st, read_full(back)[0], src, back)


def test_legacy_format_keys_chunks_as_upstream(tmp_path):
    ck = str(tmp_path / "ck")
    flags = list(VPP2)
    flags[flags.index("--train-iters") + 1] = "1"
    torchrun(2, flags + ["--ckpt-format", "torch", "--save", ck, "--save-interval", "1"])
    for pp in range(2):
        state = torch.load(os.path.join(ck, "iter_0000001", f"mp_rank_00_{pp:03d}", "model_optim_rng.pt"),
                           weights_only=False)
        assert "model" not in state and {"model0", "model1"} <= set(state), sorted(state)
        assert any(k.startswith("decoder.layers.0.") for k in state["model1"]), sorted(state["model1"])
