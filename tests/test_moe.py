"""Mixture of experts end to end through pretrain_gpt.py, 4 CPU ranks (gloo), real torchrun runs.

A Mixtral-style model (SwiGLU experts, top-2 routing with an auxiliary loss, RMSNorm, rotary positions, bf16)
with expert parallelism EP2 x DP2 and megatron-core's distributed optimizer, which for a MoE model is its
ChainedOptimizer of a dense and an expert optimizer. One uninterrupted run of 2N iterations, saving at N in the
fully_reshardable layout, is the reference loss curve and the source checkpoint of every test here:

- exact resume, both layouts: N iterations, stop (--exit-interval), resume: losses bit-equal to the reference
  (dp_reshardable); the reference's own iteration-N checkpoint resumed in the same layout (fully_reshardable);
- resharding across expert parallelism: the iteration-N checkpoint converted (--save-after-load) onto 1 rank
  (EP1: the experts join the dense optimizer, the chain of two becomes one) and onto EP1 x TP2 (experts split
  by TP), and the 1-rank one back onto EP2 x DP2: every tensor, fp32 main params and both Adam moments of every
  expert included, bit-equal to the source, and the Adam step and the scheduler carried over;
- the tools: inspect shows the experts (count, EP layout) and the chained dense + expert optimizer, in both
  layouts; convert carries the iteration-N checkpoint to torch_dist, which megatron-core's own loader resumes
  with the reference's losses, and back with no byte of any tensor changed;
- fp16's dynamic loss scale carried across a change of the chain's length (EP2 -> EP1).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from megatron_helpers import ROOT, convert, iter_dir, losses, saving_run, torchrun
from test_reshard import assert_same_tensors, read_full

N = 4
# vocab 128 padded to a multiple of 64 x TP = 128 under TP1 and TP2 alike (the reshard compares the embedding)
MIXTRAL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
           "--vocab-size", "128", "--make-vocab-size-divisible-by", "64", "--micro-batch-size", "2",
           "--global-batch-size", "8", "--lr", "1e-3", "--mock-data", "--seed", "1234", "--train-iters", str(2 * N),
           "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear", "--position-embedding-type", "rope",
           "--untie-embeddings-and-output-weights", "--bf16", "--use-distributed-optimizer",
           "--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.01",
           "--moe-ffn-hidden-size", "96", "--no-ckpt-fsync"]
EP2DP2 = MIXTRAL + ["--expert-model-parallel-size", "2"]
FULLY = ["--dist-ckpt-optim-fully-reshardable"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """2N iterations EP2 x DP2, saving at N and 2N (fully_reshardable, lazy async): (checkpoint root, losses)."""
    root = str(tmp_path_factory.mktemp("moe") / "ep2dp2")
    return root, saving_run(4, EP2DP2 + FULLY, root, N, 2 * N)


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    """N iterations EP2 x DP2 that stop (--exit-interval) with a dp_reshardable checkpoint: (its root, losses)."""
    ck = str(tmp_path_factory.mktemp("moe") / "stopped")
    _, log = torchrun(4, EP2DP2 + ["--save", ck, "--async-ckpt", "--exit-interval", str(N)])
    return ck, losses(log)


def test_exact_resume_dp_reshardable(tmp_path, reference, stopped):
    _, ref = reference
    ck, first = stopped
    _, log = torchrun(4, EP2DP2 + ["--load", ck, "--save", str(tmp_path / "ck"), "--async-ckpt"])
    assert f"at iteration {N}" in log, log[-3000:]
    second = losses(log)
    assert sorted(second) == list(range(N + 1, 2 * N + 1)), log[-3000:]
    assert {**first, **second} == ref


def test_exact_resume_fully_reshardable(tmp_path, reference):
    root, ref = reference
    _, log = torchrun(4, EP2DP2 + FULLY + ["--load", iter_dir(root, N), "--save", str(tmp_path / "ck")])
    resumed = losses(log)
    assert sorted(resumed) == list(range(N + 1, 2 * N + 1)), log[-3000:]
    assert resumed == {i: ref[i] for i in resumed}


def assert_same_moe_state(src: str, dst: str) -> None:
    """Every tensor of `dst` bit-equal to `src`'s (experts' fp32 main params and moments included), and the
    same Adam step, iteration, data position and scheduler."""
    st, so = read_full(src)
    dt, do = read_full(dst)
    assert_same_tensors(st, dt, src, dst)
    for kind in ("param", "exp_avg", "exp_avg_sq"):
        experts = [k for k in st if k.startswith(f"optimizer.state.{kind}.") and ".experts." in k]
        assert len(experts) == 2, sorted(st)  # linear_fc1 and linear_fc2 of every expert of every layer
        assert st[experts[0]].shape[:2] == (2, 4)  # (layers, experts): the experts' global offsets
    for name in ("common:iteration", "common:train_state", "common:opt_param_scheduler"):
        assert so[name] == do[name], name
    assert adam_steps(so) == adam_steps(do) == {float(N)}


def adam_steps(objects: dict) -> set:
    return {g["step"] for name, value in objects.items() if name.startswith("common:optimizer/")
            and name.endswith("optimizer") for g in value["param_groups"]}


@pytest.mark.parametrize("nproc,layout", [(1, []), (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"])],
                         ids=["ep2dp2-to-1-rank", "ep2dp2-to-ep1tp2"])
def test_reshard_across_expert_parallelism(tmp_path, reference, nproc, layout):
    root, _ = reference
    src = iter_dir(root, N)
    dst = convert(nproc, MIXTRAL + FULLY + layout, src, str(tmp_path / "dst"), N)
    assert_same_moe_state(src, dst)
    names = set(read_full(dst)[1])
    assert "common:optimizer/optimizer" in names  # EP1: one optimizer, the experts' state in it
    if nproc == 1:  # and back: one optimizer into the chain of two, again bit-equal
        back = convert(4, EP2DP2 + FULLY, dst, str(tmp_path / "back"), N)
        assert_same_moe_state(src, back)
        assert "common:optimizer/1/optimizer" in set(read_full(back)[1])


def test_dp_reshardable_refuses_another_expert_layout(stopped):
    """The dp_reshardable flat buffers belong to one expert layout: a resume into EP1 is refused before any
    read, naming the layouts and the flag that moves them."""
    rc, log = torchrun(2, MIXTRAL + ["--load", stopped[0]], check=False)
    assert rc != 0
    assert "saved with EP2xETP1" in log and "this run is EP1xETP1" in log, log[-3000:]
    assert "--dist-ckpt-optim-fully-reshardable" in log


# DeepSeek-style routing on 2 ranks (EP2): a dense first layer (--moe-layer-freq), a shared expert beside the
# routed ones, sigmoid scores with aux-loss-free balancing (the router's expert bias, a buffer updated each step).
DEEPSEEK = [f for f in MIXTRAL if f not in ("--bf16", "--use-distributed-optimizer")] + [
    "--expert-model-parallel-size", "2", "--moe-layer-freq", "[0,1]", "--moe-shared-expert-intermediate-size", "64",
    "--moe-router-enable-expert-bias", "--moe-router-score-function", "sigmoid",
    "--moe-router-load-balancing-type", "none", "--moe-aux-loss-coeff", "0"]
BIAS = "decoder.layers.1.mlp.router.expert_bias"


def test_expert_bias_and_shared_expert_resume_exactly(tmp_path):
    """Straight 2N vs a resume from its own checkpoint of N (bf16-free, non-distributed chained optimizer):
    bit-equal losses, and the resumed run's final checkpoint equals the straight one's in every tensor, the expert
    bias included."""
    straight, ck = str(tmp_path / "straight"), str(tmp_path / "ck")
    _, log = torchrun(2, DEEPSEEK + ["--save", straight, "--save-interval", str(N), "--async-ckpt"])
    ref = losses(log)
    _, log2 = torchrun(2, DEEPSEEK + ["--load", iter_dir(straight, N), "--save", ck, "--save-interval", str(N)])
    assert sorted(ref) == list(range(1, 2 * N + 1)), log[-3000:]
    assert losses(log2) == {i: ref[i] for i in range(N + 1, 2 * N + 1)}, log2[-3000:]
    at_n = read_full(iter_dir(straight, N))[0]
    assert at_n[BIAS].abs().sum() > 0, at_n[BIAS]  # updated by training, and saved
    assert any(".shared_experts." in name for name in at_n) and not any("layers.0.mlp.router" in n for n in at_n)
    final, resumed = read_full(iter_dir(straight, 2 * N))[0], read_full(iter_dir(ck, 2 * N))[0]
    assert sorted(final) == sorted(resumed)
    assert any(k.startswith("chained_1.optimizer.state.exp_avg_sq.") for k in final)  # the experts' optimizer
    for name in final:
        assert torch.equal(final[name], resumed[name]), name
    assert not torch.equal(final[BIAS], at_n[BIAS])  # it moved on after the resume, as in the straight run


def test_fp16_loss_scale_survives_a_change_of_chain_length(tmp_path):
    """fp16 (megatron-core's dynamic loss scaler) on EP2, fully_reshardable, converted onto 1 rank (EP1: the chain of
    two optimizers becomes one): the loss scale and its trackers after the load are the saved ones."""
    fp16 = ["--fp16" if f == "--bf16" else f for f in MIXTRAL] + FULLY
    fp16[fp16.index("--train-iters") + 1] = str(N)
    root = str(tmp_path / "ep2")
    saving_run(2, fp16 + ["--expert-model-parallel-size", "2"], root, N, N)
    src = iter_dir(root, N)
    saved = read_full(src)[1]["common:optimizer/0/grad_scaler"]
    assert saved["scale"] < 2.0 ** 32, saved  # it moved from megatron-core's initial scale (overflowing steps)
    dst = convert(1, fp16, src, str(tmp_path / "ep1"), N)
    assert read_full(dst)[1]["common:optimizer/grad_scaler"] == saved


def test_alltoall_dispatcher_resumes_exactly(tmp_path):
    """megatron-core's all-to-all token dispatcher on EP2 (2 ranks, two local experts each; its device-to-host
    stream adapted by cpu_shim): 2N iterations straight, and a resume from their checkpoint of N, bit-equal."""
    flags = MIXTRAL + ["--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall"]
    straight = str(tmp_path / "straight")
    _, log = torchrun(2, flags + ["--save", straight, "--save-interval", str(N), "--async-ckpt"])
    ref = losses(log)
    _, second = torchrun(2, flags + ["--load", iter_dir(straight, N), "--save", str(tmp_path / "ck"), "--async-ckpt"])
    assert sorted(ref) == list(range(1, 2 * N + 1)), log[-3000:]
    assert losses(second) == {i: ref[i] for i in range(N + 1, 2 * N + 1)}, second[-3000:]


# ----- the tools on a MoE checkpoint (the reference's iteration N: EP2 x DP2, distributed optimizer) -----

def _tool(*args) -> str:
    """A tool of tools/ run as a user runs it; its stdout."""
    p = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONWARNINGS="ignore"))
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout


def _experts_and_chain(ckpt: str, capsys) -> tuple[dict, dict]:
    """inspect_checkpoint's view of `ckpt` (its CLI, in this process): (its experts, its optimizer)."""
    from tools.inspect_checkpoint import main
    capsys.readouterr()
    assert main([ckpt, "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)["checkpoint"]
    return rep["experts"], rep["optimizer"]


@pytest.mark.parametrize("which", ["reference", "stopped"])
def test_inspect_shows_the_experts_and_the_chained_optimizer(request, capsys, which):
    """4 experts per MoE layer, 2 MoE layers, EP2: two blocks of 2 experts, each held by two ranks (its expert
    data-parallel replicas, which write it); the optimizer a chain of 2 (dense, then the experts'), both holding Adam state,
    model-shaped (fully_reshardable) or in flat buckets under `chained_<i>.` (dp_reshardable)."""
    ckpt = iter_dir(request.getfixturevalue(which)[0], N)
    experts, optimizer = _experts_and_chain(ckpt, capsys)
    assert (experts["experts"], experts["moe_layers"], experts["expert_parallel"]) == (4, 2, 2), experts
    assert [b["experts"] for b in experts["placement"]] == [[0, 2], [2, 4]]
    for block in experts["placement"]:  # each layer's copy written once, by one of the two replicas
        assert len(block["held_by"]) == 2 and set(block["written_by"]) <= set(block["held_by"]), block
    assert set(experts["placement"][0]["held_by"]).isdisjoint(experts["placement"][1]["held_by"])
    assert optimizer["chain"]["parts"] == 2, optimizer
    parts = optimizer["chain"]["bytes_by_part"]
    assert len(parts) == 2 and any(p.startswith("expert") for p in parts) and any(p.startswith("dense") for p in parts)
    for by_kind in parts.values():
        assert by_kind["exp_avg"] > 0 and by_kind["exp_avg_sq"] > 0, parts
    assert ("dp_reshardable" if which == "stopped" else "model-shaped") in optimizer["layout"]


def test_convert_carries_a_moe_checkpoint_through_stock_megatron_core(tmp_path, reference):
    """datastates -> torch_dist; megatron-core's own dist_checkpointing.load, with the model's and the
    DistributedOptimizer's sharded state dicts (the trainer's --ckpt-format torch_dist), resumes it on EP2 x DP2
    with the reference's losses; torch_dist -> datastates changes no byte of any tensor, nor any object."""
    root, ref = reference
    src, td, back = iter_dir(root, N), str(tmp_path / "td"), str(tmp_path / "back")
    _tool("tools/convert_checkpoint.py", "--from", "datastates", "--to", "torch_dist", "--input", src, "--output", td)
    _, log = torchrun(4, EP2DP2 + FULLY + ["--load", td, "--ckpt-format", "torch_dist",
                                           "--save", str(tmp_path / "td_out")])
    assert f"(torch_dist) at iteration {N}" in log, log[-3000:]
    assert losses(log) == {i: ref[i] for i in range(N + 1, 2 * N + 1)}, log[-3000:]
    _tool("tools/convert_checkpoint.py", "--from", "torch_dist", "--to", "datastates", "--input", td, "--output", back)
    (before, before_objects), (after, after_objects) = read_full(src), read_full(iter_dir(back, N))
    assert sorted(before) == sorted(after) and any(".experts.experts." in k for k in before)
    for name, t in before.items():
        assert t.dtype == after[name].dtype and t.shape == after[name].shape, name
        assert torch.equal(t.contiguous().view(torch.uint8), after[name].contiguous().view(torch.uint8)), name
    assert {k: repr(v) for k, v in before_objects.items()} == {k: repr(after_objects[k]) for k in before_objects}
    # and, by design, every level of the common state as its own object too (docs: convert_checkpoint.py)
    extra = set(after_objects) - set(before_objects)
    assert all(any(k.startswith(b + "/") or b.startswith(k + "/") for b in before_objects) for k in extra), extra
