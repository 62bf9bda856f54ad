"""Mixtral-style mixture of experts through Hugging Face, both ways (datastates.hf, tools/hf), checked by transformers itself.

A tiny Mixtral (hidden 64, 2 layers, 4 SwiGLU experts, top-2 softmax router, GQA, RoPE, RMSNorm) trained 2
iterations in fp32 with EP2 x TP2 (sequence parallel; the experts split by TP as well) and the distributed
optimizer is exported and loaded by MixtralForCausalLM: its logits on the trainer's first micro-batch equal
megatron-core's (tests/hf_reference.py), which needs both to route every token to the same experts; a torch_dist
copy of it exports the same bytes. A Mixtral built with transformers goes through this project and back bit for
bit, and a fine-tune of it in an EP2 layout starts from transformers' loss. MoE configurations with no exact
Mixtral equivalent are refused by name, nothing written.
"""

import pytest
import torch

from megatron_helpers import torchrun

pytest.importorskip("transformers")

from hf_helpers import (TRAIN, assert_bit_equal, assert_computes_as_megatron_core,  # noqa: E402
                        assert_finetune_starts_from_transformers, assert_import_refused, assert_round_trip, convert,
                        export_refusal, hf_model, hf_tensors, no_leftovers, reference)

MIXTRAL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
           "--vocab-size", "128", "--make-vocab-size-divisible-by", "32", "--hidden-dropout", "0",
           "--attention-dropout", "0", "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
           "--position-embedding-type", "rope", "--untie-embeddings-and-output-weights", "--group-query-attention",
           "--num-query-groups", "2", "--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.01",
           "--moe-ffn-hidden-size", "96"]
EP2TP2 = ["--expert-model-parallel-size", "2", "--tensor-model-parallel-size", "2", "--sequence-parallel",
          "--use-distributed-optimizer"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The save root of 2 iterations of the tiny Mixtral, EP2 x TP2 on 4 ranks."""
    save = str(tmp_path_factory.mktemp("mixtral") / "ckpt")
    torchrun(4, MIXTRAL + TRAIN + EP2TP2 + ["--save", save, "--save-interval", "2"])
    return save


def test_export_computes_what_megatron_core_computes(trained, tmp_path):
    out = str(tmp_path / "hf")
    convert("--from", "datastates", "--to", "hf", "--input", trained, "--output", out)
    assert no_leftovers(str(tmp_path))
    ref = reference(trained, str(tmp_path / "reference.pt"), MIXTRAL + TRAIN)
    model = hf_model(out)
    assert type(model).__name__ == "MixtralForCausalLM"
    assert (model.config.num_local_experts, model.config.num_experts_per_tok) == (4, 2)
    names = set(hf_tensors(out))
    assert "model.layers.1.block_sparse_moe.experts.3.w3.weight" in names
    assert "model.layers.0.block_sparse_moe.gate.weight" in names
    assert_computes_as_megatron_core(model, ref)


def test_export_from_torch_dist_equals_export_from_datastates(trained, tmp_path):
    convert("--from", "datastates", "--to", "torch_dist", "--input", trained, "--output", str(tmp_path / "td"))
    convert("--from", "torch_dist", "--to", "hf", "--input", str(tmp_path / "td"), "--output", str(tmp_path / "a"))
    convert("--from", "datastates", "--to", "hf", "--input", trained, "--output", str(tmp_path / "b"))
    assert_bit_equal(hf_tensors(str(tmp_path / "a")), hf_tensors(str(tmp_path / "b")))


def tiny_mixtral(directory: str, vocab: int, seed: int = 0, **overrides) -> None:
    from transformers import MixtralConfig, MixtralForCausalLM
    torch.manual_seed(seed)
    cfg = dict(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=32, rope_theta=10000.0, num_local_experts=4,
               num_experts_per_tok=2, sliding_window=None, tie_word_embeddings=False)
    MixtralForCausalLM(MixtralConfig(**{**cfg, **overrides})).save_pretrained(directory)


def test_round_trip_through_this_project_is_bit_exact(tmp_path):
    source = str(tmp_path / "source")
    tiny_mixtral(source, vocab=100)  # padded to 128 on the way
    original = assert_round_trip(source, str(tmp_path), 100)
    assert "model.layers.0.block_sparse_moe.experts.0.w1.weight" in original  # transformers' own saved names


def test_finetune_from_a_transformers_mixtral_in_an_ep2_layout(tmp_path):
    source = str(tmp_path / "source")
    tiny_mixtral(source, vocab=128, seed=3)
    assert_finetune_starts_from_transformers(source, str(tmp_path / "ckpt"), {"--num-experts", "--moe-router-topk",
                                             "--moe-ffn-hidden-size"}, ["--expert-model-parallel-size", "2"])


@pytest.mark.parametrize("changes, named", [
    ({"moe_shared_expert_intermediate_size": 64}, "--moe-shared-expert-intermediate-size is 64 (needs None)"),
    ({"moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True},
     "--moe-router-score-function is 'sigmoid' (needs 'softmax'); --moe-router-enable-expert-bias "
     "(aux-loss-free balancing) is True (needs False)"),
    ({"moe_router_pre_softmax": True}, "--moe-router-pre-softmax is True (needs False)"),
    ({"moe_layer_freq": [0, 1]}, "--moe-layer-freq is [0, 1] (Mixtral has experts in every layer"),
    ({"moe_router_load_balancing_type": "sinkhorn"}, "--moe-router-load-balancing-type is 'sinkhorn'"),
    ({"moe_router_topk_scaling_factor": 2.0}, "--moe-router-topk-scaling-factor is 2.0"),
    ({"disable_bias_linear": False}, "--disable-bias-linear (Mixtral has no biases) is False"),
], ids=["shared-expert", "sigmoid-expert-bias", "pre-softmax", "dense-layers", "sinkhorn", "topk-scaling", "bias"])
def test_an_export_with_no_exact_mixtral_equivalent_is_refused(changes, named):
    message = export_refusal(MIXTRAL, **changes)
    assert "Mixtral (MixtralForCausalLM) differs: " in message and named in message, message


@pytest.mark.parametrize("overrides, named", [
    ({"num_experts_per_tok": 1}, "num_experts_per_tok 1"),
    ({"sliding_window": 16}, "sliding_window is 16 (needs None)"),
    ({"router_jitter_noise": 0.1}, "router_jitter_noise is 0.1 (needs 0.0)"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}}, "rope_type 'linear'"),
], ids=["top-1", "sliding-window", "jitter", "rope-scaling"])
def test_an_import_with_no_exact_equivalent_is_refused(tmp_path, overrides, named):
    tiny_mixtral(str(tmp_path / "source"), vocab=100, **overrides)
    assert_import_refused(str(tmp_path / "source"), str(tmp_path), named)
