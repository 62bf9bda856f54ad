"""The mixture-of-experts, virtual-pipeline, multi-latent attention and multi-token prediction flags: accepted where
megatron-core runs them on CPU ranks, refused before any work, naming the flag and why, where it does not or where
they disagree (in-process, cheap)."""
import pytest

from megatron.training.arguments import ArgumentError, parse_args
from megatron.training.argument_checks import validate_args

BASE = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--micro-batch-size", "2", "--train-iters", "4", "--lr", "1e-3", "--mock-data", "--disable-bias-linear"]
MOE = ["--num-experts", "4"]


def check(extra, world=4, cuda=False):
    return validate_args(parse_args(argv=BASE + extra), world, cuda=cuda)


def test_moe_defaults_and_expert_parallel_sizes():
    args = check(MOE + ["--expert-model-parallel-size", "2", "--tensor-model-parallel-size", "2",
                        "--sequence-parallel", "--ffn-hidden-size", "96"])
    assert args.moe_ffn_hidden_size == 96 and args.expert_tensor_parallel_size == 2
    args = check(MOE + ["--moe-layer-freq", "[1,0,1,0]", "--expert-tensor-parallel-size", "1"])
    assert args.moe_layer_freq == [1, 0, 1, 0] and args.expert_tensor_parallel_size == 1
    assert check(MOE + ["--moe-layer-freq", "([0]*1+[1]*3)"]).moe_layer_freq == [0, 1, 1, 1]  # upstream's spelling
    assert check(MOE + ["--moe-token-dispatcher-type", "alltoall"]).moe_token_dispatcher_type == "alltoall"


@pytest.mark.parametrize("extra,message", [
    (["--expert-model-parallel-size", "2"], "--expert-model-parallel-size applies to mixture-of-experts layers"),
    (["--moe-router-enable-expert-bias"], "--moe-router-enable-expert-bias applies to mixture-of-experts"),
    (MOE + ["--expert-model-parallel-size", "3"], "--num-experts 4 is not divisible by --expert-model-parallel-size 3"),
    (MOE + ["--expert-model-parallel-size", "4", "--expert-tensor-parallel-size", "2"],
     "world size 4 is not divisible by --expert-tensor-parallel-size 2 x --expert-model-parallel-size 4"),
    (MOE + ["--moe-router-topk", "5"], "--moe-router-topk 5 must be in 1..--num-experts 4"),
    (MOE + ["--moe-router-topk", "1"], "needs --moe-router-pre-softmax"),
    (MOE + ["--moe-router-enable-expert-bias"], "needs --moe-router-score-function sigmoid"),
    (MOE + ["--moe-layer-freq", "[1,0]"], "--moe-layer-freq lists 2 layers, --num-layers is 4"),
    (MOE + ["--moe-router-enable-expert-bias", "--moe-router-score-function", "softmax"], "sigmoid"),
    (MOE + ["--tensor-model-parallel-size", "2"], "needs --sequence-parallel"),
    (MOE + ["--moe-token-dispatcher-type", "flex"], "flex needs DeepEP"),
    (MOE + ["--moe-grouped-gemm"], "--moe-grouped-gemm needs CUDA: .*SequentialMLP"),
])
def test_moe_refusals(extra, message):
    with pytest.raises(ArgumentError, match=message):
        check(extra)


def test_moe_layer_freq_is_parsed_not_evaluated(capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(argv=BASE + MOE + ["--moe-layer-freq", "__import__('os')"])
    assert e.value.code == 2  # argparse's usage error, naming the flag and the value
    assert "--moe-layer-freq" in capsys.readouterr().err


def test_expert_biases_are_refused_where_megatron_core_cannot_train_them():
    argv = [f for f in BASE if f != "--disable-bias-linear"] + MOE
    with pytest.raises(ArgumentError, match="biases only with expert TP 1; pass --disable-bias-linear"):
        validate_args(parse_args(argv=argv + ["--tensor-model-parallel-size", "2", "--sequence-parallel"]), 4,
                      cuda=False)
    with pytest.raises(ArgumentError, match="SequentialMLP experts .* pass --disable-bias-linear"):
        validate_args(parse_args(argv=argv), 4, cuda=False)  # the local layer spec: what pretrain_gpt.py crashed on


def test_virtual_pipeline_sizes():
    pp2 = ["--pipeline-model-parallel-size", "2", "--global-batch-size", "8"]
    assert check(pp2 + ["--num-virtual-stages-per-pipeline-rank", "2"]).virtual_pipeline_model_parallel_size == 2
    assert check(pp2 + ["--num-layers-per-virtual-pipeline-stage", "1"]).virtual_pipeline_model_parallel_size == 2
    assert check(pp2).virtual_pipeline_model_parallel_size is None


@pytest.mark.parametrize("extra,message", [
    (["--num-virtual-stages-per-pipeline-rank", "2"], "need --pipeline-model-parallel-size > 1"),
    (["--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "3"],
     "--num-virtual-stages-per-pipeline-rank 3 does not divide the 2 layers"),
    (["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1",
      "--num-virtual-stages-per-pipeline-rank", "2"], "give one"),
    (["--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "2", "--global-batch-size",
      "6"], "3 micro-batches per iteration .* not a multiple of --pipeline-model-parallel-size 2"),
])
def test_virtual_pipeline_refusals(extra, message):
    with pytest.raises(ArgumentError, match=message):
        check(extra, world=2)


MLA = ["--multi-latent-attention", "--q-lora-rank", "32", "--kv-lora-rank", "16", "--qk-head-dim", "16",
       "--qk-pos-emb-head-dim", "8", "--v-head-dim", "16"]


def test_mla_and_mtp_defaults():
    args = check(MLA + ["--mtp-num-layers", "1"])
    assert args.rope_type == "yarn" and args.kv_channels == 16  # upstream's MLA rotary; heads v-head-dim wide
    assert args.mtp_num_layers == 1 and args.mtp_loss_scaling_factor == 0.1
    assert check(["--rope-type", "rope"]).rope_type == "rope"  # what standard attention runs


@pytest.mark.parametrize("extra,message", [
    (["--kv-lora-rank", "16"], "^--kv-lora-rank applies to multi-latent attention: it needs --multi-latent-attention"),
    (["--rope-type", "yarn"], "^--rope-type applies to multi-latent attention"),
    (["--mscale-all-dim", "1.0"], "^--mscale-all-dim applies to multi-latent attention"),
    (MLA + ["--group-query-attention", "--num-query-groups", "2"], "^--group-query-attention and "
                                                                    "--multi-latent-attention exclude each other"),
    (MLA + ["--kv-channels", "32"], "^--kv-channels 32: with --multi-latent-attention each head's output is "
                                    "--v-head-dim 16 wide"),
    (MLA + ["--tensor-model-parallel-size", "2", "--sequence-parallel"], "^--sequence-parallel with "
                                                                         "--multi-latent-attention on CPU ranks"),
    (["--mtp-loss-scaling-factor", "0.3"], "^--mtp-loss-scaling-factor applies to multi-token prediction"),
    (["--mtp-num-layers", "0"], "^--mtp-num-layers must be positive"),
    (["--mtp-num-layers", "1", "--tensor-model-parallel-size", "2", "--sequence-parallel"],
     "^--sequence-parallel with --mtp-num-layers on CPU ranks"),
])
def test_mla_and_mtp_refusals(extra, message):
    with pytest.raises(ArgumentError, match=message):
        check(extra)


def test_mla_on_cuda_ranks_takes_transformer_engine_and_sequence_parallel():
    with pytest.raises(ArgumentError, match="^--multi-latent-attention with --transformer-impl local on CUDA"):
        check(MLA + ["--transformer-impl", "local"], cuda=True)
    args = check(MLA + ["--mtp-num-layers", "1", "--transformer-impl", "transformer_engine",
                        "--tensor-model-parallel-size", "2", "--sequence-parallel"], cuda=True)
    assert args.sequence_parallel and args.multi_latent_attention


def test_use_checkpoint_args_takes_the_experts_not_their_layout():
    from megatron.training.arguments import build_parser
    from megatron.training.args_from_checkpoint import architecture_flags
    flags = architecture_flags(build_parser())
    assert {"num_experts", "moe_ffn_hidden_size", "moe_layer_freq", "moe_router_enable_expert_bias", "qk_layernorm",
            "rotary_base", "multi_latent_attention", "kv_lora_rank", "v_head_dim", "mtp_num_layers"} <= set(flags)
    assert not {"expert_model_parallel_size", "expert_tensor_parallel_size", "moe_token_dispatcher_type"} & set(flags)
