"""Qwen2, Qwen3 and Qwen3-MoE through Hugging Face, both ways (datastates.hf, tools/hf), checked by transformers' own
Qwen2ForCausalLM, Qwen3ForCausalLM and Qwen3MoeForCausalLM.

For each family a tiny model built by transformers (biases on q/k/v for Qwen2, q/k norms and a head size other
than hidden / heads for the Qwen3s, a rotary base of 1e6, tied embeddings for the dense ones as the small Qwen
models have them, norm_topk_prob false for the MoE) is imported and exported back bit for bit, then fine-tuned
from on 2 ranks (TP2, or EP2): the trainer's first loss is transformers' loss on that batch. The fine-tuned
checkpoint is exported, and transformers' logits on the trainer's first micro-batch equal megatron-core's
(tests/hf_reference.py). What has no exact equivalent is refused by name, each way.
"""
import os

import pytest
import torch

pytest.importorskip("transformers")

from hf_helpers import (assert_bit_equal, assert_computes_as_megatron_core,  # noqa: E402
                        assert_finetune_starts_from_transformers, assert_import_refused, convert, export_refusal,
                        hf_model, hf_tensors, no_leftovers, reference)
from safetensors.torch import load_file  # noqa: E402

SIZES = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=32,
             rope_parameters={"rope_type": "default", "rope_theta": 1e6})
# family -> (transformers' config, its class name, what it adds to SIZES, flags --from hf must print, fine-tune layout)
FAMILIES = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True),
              {"--add-qkv-bias", "--disable-bias-linear", "--rotary-base"}, ["--tensor-model-parallel-size", "2"]),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32, tie_word_embeddings=True),
              {"--qk-layernorm", "--kv-channels", "--rotary-base"}, ["--tensor-model-parallel-size", "2"]),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                       norm_topk_prob=False, tie_word_embeddings=False),
                  {"--qk-layernorm", "--num-experts", "--moe-router-pre-softmax", "--untie-embeddings-and-output-weights"},
                  ["--expert-model-parallel-size", "2"]),
}


def qwen_config(family: str, **overrides):
    import transformers
    config, _, own, _, _ = FAMILIES[family]
    return getattr(transformers, config)(**{**SIZES, **own, **overrides})


def tiny_qwen(family: str, directory: str, seed: int = 0, **overrides) -> None:
    """A Qwen model built by transformers, its norms and biases (ones and zeros when built) made random, so that
    each lands where it belongs."""
    import transformers
    torch.manual_seed(seed)
    model = getattr(transformers, FAMILIES[family][1])(qwen_config(family, **overrides))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.uniform_(0.5, 1.5)
    model.save_pretrained(directory)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_import_round_trip_finetune_and_export(tmp_path, family):
    _, hf_class, _, printed, layout = FAMILIES[family]
    source, ckpt, save = str(tmp_path / "source"), str(tmp_path / "ckpt"), str(tmp_path / "finetuned")
    tiny_qwen(family, source)
    flags = assert_finetune_starts_from_transformers(source, ckpt, printed, layout, save=save)

    convert("--from", "datastates", "--to", "hf", "--input", ckpt, "--output", str(tmp_path / "back"))
    assert_bit_equal(load_file(os.path.join(source, "model.safetensors")), hf_tensors(str(tmp_path / "back")))

    out = str(tmp_path / "hf")
    convert("--from", "datastates", "--to", "hf", "--input", save, "--output", out)
    assert no_leftovers(str(tmp_path))
    model = hf_model(out)
    assert type(model).__name__ == hf_class
    assert model.config.rope_parameters["rope_theta"] == 1e6
    assert model.config.tie_word_embeddings == FAMILIES[family][2]["tie_word_embeddings"]
    assert_computes_as_megatron_core(model, reference(save, str(tmp_path / "reference.pt"), flags))


QWEN = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--vocab-size", "128", "--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope",
        "--disable-bias-linear", "--group-query-attention", "--num-query-groups", "2"]
QWEN3_MOE = QWEN + ["--qk-layernorm", "--num-experts", "4", "--moe-router-topk", "2"]


@pytest.mark.parametrize("flags, changes, named", [
    (QWEN + ["--qk-layernorm", "--add-qkv-bias"], {},
     "Qwen3 (Qwen3ForCausalLM) differs: --add-qkv-bias is True (needs False)"),
    (QWEN + ["--qk-layernorm"], {"disable_bias_linear": False}, "Qwen3 (Qwen3ForCausalLM) differs: "
     "--disable-bias-linear is False (needs True)"),
    (QWEN3_MOE, {"moe_shared_expert_intermediate_size": 64},
     "Qwen3-MoE (Qwen3MoeForCausalLM) differs: --moe-shared-expert-intermediate-size is 64 (needs None)"),
    (QWEN3_MOE, {"moe_layer_freq": [0, 1]}, "--moe-layer-freq is [0, 1] (Qwen3-MoE has experts in every layer"),
], ids=["qkv-bias-and-qk-norm", "qk-norm-with-biases", "shared-expert", "dense-layer"])
def test_an_export_with_no_exact_qwen_equivalent_is_refused(flags, changes, named):
    message = export_refusal(flags, **changes)
    assert named in message, message


@pytest.mark.parametrize("family, overrides, named", [
    ("qwen2", dict(use_sliding_window=True, sliding_window=16, max_window_layers=1),
     "use_sliding_window is True (needs False)"),
    ("qwen3", dict(layer_types=["full_attention", "sliding_attention"]),
     "layer_types makes layers [1] sliding-window attention"),
    ("qwen3", dict(attention_bias=True), "attention_bias is True (needs False)"),
    ("qwen3_moe", dict(decoder_sparse_step=2), "decoder_sparse_step is 2 (needs 1)"),
    ("qwen3_moe", dict(mlp_only_layers=[0]), "mlp_only_layers is [0] (needs [])"),
    ("qwen3_moe", dict(norm_topk_prob=True, num_experts_per_tok=1), "num_experts_per_tok 1"),
], ids=["qwen2-sliding-window", "qwen3-sliding-layer", "qwen3-attention-bias", "moe-sparse-step",
        "moe-dense-layer", "moe-top-1-normalised"])
def test_an_import_with_no_exact_equivalent_is_refused(family, overrides, named):
    """transformers' own config of each model, as config.json holds it (the tool's refusal of a model directory,
    nothing written, is checked below)."""
    from datastates.hf import HFError
    from datastates.hf.arch import geometry_from_config
    with pytest.raises(HFError) as e:
        geometry_from_config(qwen_config(family, **overrides).to_dict(), "source")
    assert named in str(e.value), str(e.value)


def test_a_sliding_window_model_directory_is_refused_with_nothing_written(tmp_path):
    tiny_qwen("qwen2", str(tmp_path / "source"), use_sliding_window=True, sliding_window=16, max_window_layers=1)
    assert_import_refused(str(tmp_path / "source"), str(tmp_path), "use_sliding_window is True (needs False)")
