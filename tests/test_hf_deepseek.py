"""DeepSeek-style models through Hugging Face, both ways (datastates.hf, tools/hf), checked by transformers' DeepseekV3ForCausalLM.

A tiny DeepSeek-style model (test_deepseek.py's shape in fp32: multi-latent attention with low-rank queries and
YaRN, a dense first layer then an MoE layer of 4 routed experts beside a shared one, sigmoid routing limited to 1
of 2 groups with the expert bias and a top-k scaling factor, one multi-token prediction layer) trained 2
iterations with EP2 is exported: refused while it has its MTP layer, exported with --drop-mtp, and its logits and
loss on the trainer's first micro-batch equal megatron-core's (tests/hf_reference.py); a torch_dist copy of it
exports the same bytes. A DeepseekV3 built with
transformers goes through this project and back bit for bit, and a fine-tune of it in an EP2 layout starts from
transformers' loss. Configurations with no exact equivalent are refused by name, each way, nothing written.
"""
import os

import pytest
import torch

from megatron_helpers import torchrun
from test_deepseek import MLA, MTP_FLAGS, ROUTED

pytest.importorskip("transformers")

from hf_helpers import (TRAIN, assert_bit_equal, assert_computes_as_megatron_core,  # noqa: E402
                        assert_finetune_starts_from_transformers, assert_import_refused, assert_round_trip, convert,
                        export_refusal, hf_model, hf_tensors, no_leftovers, reference)

DEEPSEEK = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
            "--vocab-size", "128", "--make-vocab-size-divisible-by", "32", "--hidden-dropout", "0",
            "--attention-dropout", "0", "--normalization", "RMSNorm", "--norm-epsilon", "1e-6", "--swiglu",
            "--disable-bias-linear", "--position-embedding-type", "rope", "--untie-embeddings-and-output-weights",
            "--ffn-hidden-size", "96", *MLA, *ROUTED,
            "--moe-router-num-groups", "2", "--moe-router-group-topk", "1", "--moe-router-topk-scaling-factor", "2.5"]
YARN = {"rope_type": "yarn", "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32.0,
        "beta_slow": 1.0, "original_max_position_embeddings": 4096, "rope_theta": 10000.0}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The save root of 2 iterations of the tiny DeepSeek-style model with its MTP layer, EP2 on 2 ranks."""
    save = str(tmp_path_factory.mktemp("deepseek") / "ckpt")
    torchrun(2, DEEPSEEK + MTP_FLAGS + TRAIN + ["--expert-model-parallel-size", "2", "--save", save, "--save-interval", "2"])
    return save


def test_export_drops_mtp_only_when_asked_and_computes_what_megatron_core_computes(trained, tmp_path):
    out = str(tmp_path / "hf")
    rc, log = convert("--from", "datastates", "--to", "hf", "--input", trained, "--output", out, check=False)
    assert rc == 1 and "--mtp-num-layers 1" in log and "--drop-mtp" in log, log[-3000:]
    assert not os.path.exists(out) and no_leftovers(str(tmp_path))
    _, log = convert("--from", "datastates", "--to", "hf", "--input", trained, "--output", out, "--drop-mtp")
    assert "--drop-mtp: leaving out the 19 tensors of the multi-token prediction layers" in log, log[-3000:]
    model = hf_model(out)
    assert type(model).__name__ == "DeepseekV3ForCausalLM"
    cfg = model.config
    assert (cfg.first_k_dense_replace, cfg.n_group, cfg.topk_group, cfg.n_shared_experts) == (1, 2, 1, 1)
    assert (cfg.routed_scaling_factor, cfg.rope_parameters["factor"], cfg.rope_interleave) == (2.5, 40.0, True)
    names = hf_tensors(out)
    assert not [n for n in names if "mtp" in n or ".layers.2." in n]
    assert names["model.layers.1.mlp.gate.e_score_correction_bias"].abs().sum() > 0  # trained, and exported
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in names and "model.layers.0.mlp.gate_proj.weight" in names
    ref = reference(trained, str(tmp_path / "reference.pt"), DEEPSEEK + TRAIN)  # the main model alone
    assert_computes_as_megatron_core(model, ref)


def test_export_from_torch_dist_equals_export_from_datastates(trained, tmp_path):
    convert("--from", "datastates", "--to", "torch_dist", "--input", trained, "--output", str(tmp_path / "td"))
    convert("--from", "torch_dist", "--to", "hf", "--input", str(tmp_path / "td"), "--output", str(tmp_path / "a"),
            "--drop-mtp")
    convert("--from", "datastates", "--to", "hf", "--input", trained, "--output", str(tmp_path / "b"), "--drop-mtp")
    assert_bit_equal(hf_tensors(str(tmp_path / "a")), hf_tensors(str(tmp_path / "b")))


def tiny_deepseek(directory: str, vocab: int, seed: int = 0, rope=None, **overrides) -> None:
    """A DeepseekV3 built by transformers, its router's score correction bias made non-zero."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    torch.manual_seed(seed)
    cfg = dict(vocab_size=vocab, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
               num_attention_heads=4, num_key_value_heads=4, n_shared_experts=2, n_routed_experts=4,
               kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16, n_group=2,
               topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1, max_position_embeddings=32,
               num_mtp_layers=0, rope_parameters=rope or dict(YARN), tie_word_embeddings=False)
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**{**cfg, **overrides}))
    for layer in model.model.layers[1:]:
        layer.mlp.gate.e_score_correction_bias.uniform_(-0.05, 0.05)
    model.save_pretrained(directory)


def test_round_trip_through_this_project_is_bit_exact(tmp_path):
    source = str(tmp_path / "source")
    tiny_deepseek(source, vocab=100)  # padded to 128 on the way
    original = assert_round_trip(source, str(tmp_path), 100)
    assert "model.layers.2.mlp.experts.0.gate_proj.weight" in original  # transformers' own saved names


def test_round_trip_without_q_lora_and_with_default_rope(tmp_path):
    source = str(tmp_path / "source")
    tiny_deepseek(source, vocab=128, q_lora_rank=None, rope={"rope_type": "default", "rope_theta": 10000.0})
    assert "model.layers.0.self_attn.q_proj.weight" in assert_round_trip(source, str(tmp_path), 128)


def test_finetune_from_a_transformers_deepseek_in_an_ep2_layout(tmp_path):
    source = str(tmp_path / "source")
    tiny_deepseek(source, vocab=128, seed=3)
    assert_finetune_starts_from_transformers(source, str(tmp_path / "ckpt"), {"--multi-latent-attention",
                                             "--moe-router-enable-expert-bias", "--moe-router-num-groups"},
                                             ["--expert-model-parallel-size", "2"])  # EP2 x DP2: 2 experts a rank


@pytest.mark.parametrize("changes, named", [
    ({"mtp_num_layers": 2}, "--mtp-num-layers 2: transformers has no multi-token prediction module"),
    ({"qk_layernorm": False}, "--qk-layernorm (DeepseekV3 always norms the q and kv latents) is False"),
    ({"norm_epsilon": 1e-5}, "--norm-epsilon (DeepseekV3's latent norms use 1e-6) is 1e-05"),
    ({"moe_router_score_function": "softmax", "moe_router_enable_expert_bias": False},
     "--moe-router-score-function (DeepseekV3 routes by sigmoid scores) is 'softmax'"),
    ({"moe_shared_expert_intermediate_size": 48}, "--moe-shared-expert-intermediate-size is 48"),
    ({"moe_shared_expert_intermediate_size": None}, "--moe-shared-expert-intermediate-size is None"),
    ({"moe_layer_freq": [1, 0]}, "--moe-layer-freq is [1, 0] (DeepseekV3 has dense layers first"),
    ({"moe_router_group_topk": 2}, "--moe-router-num-groups 2 with --moe-router-group-topk 2"),
    ({"mscale": 0.5, "mscale_all_dim": 0.0}, "--mscale 0.5 with --mscale-all-dim 0"),
    ({"rope_type": "rope"}, "--rope-type rope with --rotary-scaling-factor 40 and --mscale-all-dim 1"),
    ({"num_experts": None}, "multi-latent attention without --num-experts"),
], ids=["mtp", "no-latent-norms", "norm-eps", "softmax", "shared-size", "no-shared", "moe-first", "group-topk",
        "mscale", "rope-scaled", "dense"])
def test_an_export_with_no_exact_deepseek_equivalent_is_refused(changes, named):
    message = export_refusal(DEEPSEEK, **changes)
    assert named in message, message


def test_an_export_whose_tensors_do_not_fit_its_flags_is_refused():
    shapes = {"embedding.word_embeddings.weight": (128, 64),
              "decoder.layers.1.self_attention.linear_q_up_proj.weight": (4 * (16 + 8), 32),
              "decoder.layers.1.self_attention.linear_kv_down_proj.weight": (16 + 8, 64),
              "decoder.layers.1.self_attention.linear_kv_up_proj.weight": (4 * 16 + 4 * 8, 16)}  # a wrong v-head-dim
    message = export_refusal(DEEPSEEK, shapes)
    assert "decoder.layers.1.self_attention.linear_kv_up_proj.weight has shape (96, 16), but the saved flags" \
           in message and "make it (128, 16)" in message, message


@pytest.mark.parametrize("overrides, named", [
    ({"rope_interleave": False}, "rope_interleave is False (needs True)"),
    ({"rms_norm_eps": 1e-5}, "rms_norm_eps is 1e-05 (needs 1e-06)"),
    ({"topk_group": 2, "n_group": 2}, "n_group 2 with topk_group 2 and num_experts_per_tok 2"),
    ({"norm_topk_prob": False}, "norm_topk_prob is False (needs True)"),
    ({"rope": {**YARN, "beta_fast": 16.0}}, "beta_fast is 16.0 (pretrain_gpt.py has no flag for it"),
    ({"rope": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}}, "rope_type 'linear'"),
], ids=["rope-not-interleaved", "norm-eps", "group-topk", "unnormalised", "yarn-beta", "linear-rope"])
def test_an_import_with_no_exact_equivalent_is_refused(tmp_path, overrides, named):
    tiny_deepseek(str(tmp_path / "source"), vocab=100, **overrides)
    assert_import_refused(str(tmp_path / "source"), str(tmp_path), named)
