"""A DeepSeek-style model end to end through pretrain_gpt.py on 2 CPU ranks (gloo), real torchrun runs.

megatron-core's own classes: multi-latent attention (low-rank queries and keys/values with their norms, a YaRN
rotary part per head), a dense first layer then an MoE layer with a shared expert and sigmoid routing balanced by
the router's expert bias, one multi-token prediction layer (its loss added by megatron-core), expert parallelism
EP2, bf16 and the distributed optimizer (a chain of a dense and an expert optimizer). One uninterrupted run of 2N
iterations, saving at N in the fully_reshardable layout, is the reference and the source checkpoint:

- exact resume: N iterations stopped by --exit-interval, then resumed with the same --train-iters: the main and
  the MTP losses of every iteration bit-equal to the reference;
- resharding EP2 -> EP1 (1 rank: the chain of two optimizers becomes one): every tensor bit-equal, the router's
  expert bias and the MTP layer's weights, fp32 main params and both moments named and checked.
"""
from __future__ import annotations

import re

import pytest
import torch

from megatron_helpers import convert, iter_dir, losses, torchrun
from test_moe import adam_steps
from test_reshard import assert_same_tensors, read_full

N = 4
# multi-latent attention
MLA = ["--multi-latent-attention", "--q-lora-rank", "32", "--kv-lora-rank", "16", "--qk-head-dim", "16",
       "--qk-pos-emb-head-dim", "8", "--v-head-dim", "16", "--qk-layernorm", "--rotary-scaling-factor", "40",
       "--mscale-all-dim", "1.0"]
# a dense layer, then routed experts beside a shared one, balanced by the expert bias
ROUTED = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32", "--moe-layer-freq", "[0,1]",
          "--moe-shared-expert-intermediate-size", "32", "--moe-router-enable-expert-bias",
          "--moe-router-score-function", "sigmoid", "--moe-router-load-balancing-type", "none"]
# one multi-token prediction layer
MTP_FLAGS = ["--mtp-num-layers", "1", "--mtp-loss-scaling-factor", "0.1"]
DEEPSEEK = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
            "--vocab-size", "128", "--make-vocab-size-divisible-by", "64", "--micro-batch-size", "2",
            "--global-batch-size", "8", "--lr", "1e-3", "--mock-data", "--seed", "1234", "--train-iters", str(2 * N),
            "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear", "--position-embedding-type", "rope",
            "--untie-embeddings-and-output-weights", "--bf16", "--use-distributed-optimizer", "--no-ckpt-fsync",
            "--dist-ckpt-optim-fully-reshardable", *MLA, *ROUTED, *MTP_FLAGS]
EP2 = DEEPSEEK + ["--expert-model-parallel-size", "2"]
MTP_LOSS_RE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.* mtp_1 loss: ([^ ]+) \|")
BIAS = "decoder.layers.1.mlp.router.expert_bias"
MTP = "mtp.layers.0."


def mtp_losses(log: str) -> dict[int, str]:
    return {int(m.group(1)): m.group(2) for m in MTP_LOSS_RE.finditer(log)}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """2N iterations on EP2, saving lazily at N and 2N: (checkpoint root, main losses, MTP losses)."""
    root = str(tmp_path_factory.mktemp("deepseek") / "ep2")
    _, log = torchrun(2, EP2 + ["--save", root, "--save-interval", str(N), "--async-ckpt"])
    main, mtp = losses(log), mtp_losses(log)
    assert sorted(main) == sorted(mtp) == list(range(1, 2 * N + 1)), log[-3000:]
    return root, main, mtp


def test_exact_resume_with_mla_and_mtp(tmp_path, reference):
    """Resumed from the reference's own checkpoint of iteration N: the main and MTP losses after it are the
    reference's, bit for bit."""
    root, ref, ref_mtp = reference
    _, second = torchrun(2, EP2 + ["--load", iter_dir(root, N), "--save", str(tmp_path / "ck"), "--save-interval",
                                   str(N), "--async-ckpt"])
    assert f"at iteration {N}" in second, second[-3000:]
    assert sorted(losses(second)) == list(range(N + 1, 2 * N + 1)), second[-3000:]
    assert losses(second) == {i: ref[i] for i in range(N + 1, 2 * N + 1)}
    assert mtp_losses(second) == {i: ref_mtp[i] for i in range(N + 1, 2 * N + 1)}


def test_expert_bias_and_mtp_layer_survive_ep2_to_ep1(tmp_path, reference):
    root, _, _ = reference
    src = iter_dir(root, N)
    dst = convert(1, DEEPSEEK, src, str(tmp_path / "ep1"), N)
    st, so = read_full(src)
    dt, do = read_full(dst)
    assert_same_tensors(st, dt, src, dst)
    assert st[BIAS].abs().sum() > 0 and torch.equal(st[BIAS], dt[BIAS])  # updated from the load, carried
    for kind in ("", "optimizer.state.param.", "optimizer.state.exp_avg.", "optimizer.state.exp_avg_sq."):
        names = [k for k in st if k.startswith(kind + MTP)]
        assert any(".eh_proj." in k for k in names) and any(".self_attention." in k for k in names), (kind, names)
    assert st[f"optimizer.state.exp_avg.{MTP}eh_proj.weight"].abs().sum() > 0  # the MTP loss trained it
    assert "common:optimizer/1/optimizer" in so and "common:optimizer/optimizer" in do  # the chain of 2 became 1
    for name in ("common:iteration", "common:train_state", "common:opt_param_scheduler"):
        assert so[name] == do[name], name
    assert adam_steps(so) == adam_steps(do) == {float(N)}
