"""--qk-layernorm, --rotary-base and --decoupled-lr/--decoupled-min-lr reach megatron-core's configs: one CPU
rank through pretrain_gpt.py, checked in what the checkpoints hold and in the losses."""
from __future__ import annotations

import torch

from megatron_helpers import TINY, losses, torchrun
from test_reshard import iter_dir, read_full

ROPE = TINY + ["--position-embedding-type", "rope", "--no-ckpt-fsync", "--untie-embeddings-and-output-weights"]


def test_qk_layernorm_and_decoupled_lr(tmp_path):
    """With --decoupled-lr 0 the embedding and the output layer stay put while the layers train; the query and
    key norms are parameters of the model, saved with it."""
    ck = str(tmp_path / "ck")
    torchrun(1, ROPE + ["--qk-layernorm", "--decoupled-lr", "0", "--decoupled-min-lr", "0", "--train-iters", "2",
                        "--save", ck, "--save-interval", "1"])
    first, second = read_full(iter_dir(ck, 1))[0], read_full(iter_dir(ck, 2))[0]
    norms = [k for k in first if k.startswith("decoder.layers.") and ("q_layernorm" in k or "k_layernorm" in k)]
    assert len(norms) >= 2, sorted(first)
    for name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        assert torch.equal(first[name], second[name]), name
    assert not torch.equal(first["decoder.layers.self_attention.linear_qkv.weight"],
                           second["decoder.layers.self_attention.linear_qkv.weight"])


def test_rotary_base_changes_the_model():
    """The same weights and data with another rotary base give another first loss."""
    one = ["--train-iters", "1"]
    default = losses(torchrun(1, ROPE + one)[1])
    assert sorted(default) == [1]
    assert losses(torchrun(1, ROPE + one + ["--rotary-base", "500"])[1])[1] != default[1]
