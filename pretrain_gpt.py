"""Pretrain a GPT model with megatron-core, checkpointed lazily and asynchronously by datastates.

    torchrun --nproc_per_node 4 pretrain_gpt.py --tensor-model-parallel-size 2 \\
        --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --vocab-size 128 \\
        --micro-batch-size 2 --global-batch-size 8 --train-iters 20 --lr 1e-3 --mock-data \\
        --save ckpt --load ckpt --save-interval 5 --async-ckpt
"""
from __future__ import annotations

import os
import sys
from functools import partial

# This repository's trainer is `megatron.training` here, beside megatron-core's `megatron.core`; megatron-core
# 0.17+ ships upstream's own `megatron/training` too. Put this directory first on the path whatever the start:
# another working directory, torchrun, or `python -P` / PYTHONSAFEPATH=1 (which leave the script's directory out).
_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path[:1]:
    sys.path.insert(0, _HERE)

import torch  # noqa: E402


def model_provider(pre_process=True, post_process=True, vp_stage=None):
    """Build the GPT model of this rank's pipeline stage (`vp_stage`: its virtual stage, with virtual pipelines)."""
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.enums import AttnBackend
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig
    from megatron.training import get_args
    from megatron.training.latent_attention import mla_config_kwargs
    from megatron.training.moe import moe_config_kwargs
    from megatron.training.multi_token import mtp_block_spec, mtp_config_kwargs

    args = get_args()
    cuda = torch.cuda.is_available()
    dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32
    config = (MLATransformerConfig if args.multi_latent_attention else TransformerConfig)(
        num_layers=args.num_layers, hidden_size=args.hidden_size, ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads, kv_channels=args.kv_channels,
        num_query_groups=args.num_query_groups if args.group_query_attention else None,
        hidden_dropout=args.hidden_dropout, attention_dropout=args.attention_dropout,
        init_method_std=args.init_method_std, normalization=args.normalization, layernorm_epsilon=args.norm_epsilon,
        layernorm_zero_centered_gamma=args.apply_layernorm_1p,
        gated_linear_unit=args.swiglu, activation_func=torch.nn.functional.silu if args.swiglu else
        torch.nn.functional.gelu, add_bias_linear=not args.disable_bias_linear, add_qkv_bias=args.add_qkv_bias,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size, sequence_parallel=args.sequence_parallel,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        use_cpu_initialization=not cuda, perform_initialization=args.perform_initialization, params_dtype=dtype,
        bf16=args.bf16, fp16=args.fp16, pipeline_dtype=dtype, attention_backend=AttnBackend[args.attention_backend],
        attention_softmax_in_fp32=args.attention_softmax_in_fp32, recompute_granularity=args.recompute_granularity,
        recompute_method=args.recompute_method, recompute_num_layers=args.recompute_num_layers,
        **({"recompute_modules": args.recompute_modules} if args.recompute_modules else {}),
        calculate_per_token_loss=args.calculate_per_token_loss,
        batch_p2p_comm=cuda,  # gloo has no coalesced send/recv: pairs of isend/irecv instead
        qk_layernorm=args.qk_layernorm, deterministic_mode=args.deterministic_mode,
        transformer_impl=args.transformer_impl,  # (FSDP2 shards megatron-core's own linears only with "local")
        **moe_config_kwargs(args), **mla_config_kwargs(args), **mtp_config_kwargs(args))
    spec = _layer_spec(args, config, vp_stage)
    return GPTModel(config=config, transformer_layer_spec=spec,
                    mtp_block_spec=mtp_block_spec(args, config, spec, vp_stage), vocab_size=args.padded_vocab_size,
                    max_sequence_length=args.max_position_embeddings,
                    pre_process=pre_process, post_process=post_process,
                    share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                    position_embedding_type=args.position_embedding_type, rotary_percent=args.rotary_percent,
                    rotary_base=args.rotary_base, vp_stage=vp_stage)


def _layer_spec(args, config, vp_stage):
    """megatron-core's layer spec, adapted on CPU ranks (cpu_shim: multi-latent attention's core attention)."""
    from megatron.training import cpu_shim
    from megatron.training.latent_attention import mark_missing_te
    spec = _megatron_core_spec(args, config, vp_stage)
    if args.multi_latent_attention:
        mark_missing_te()
        if cpu_shim.installed():
            spec = cpu_shim.latent_attention_local_spec(spec)
    return spec


def _megatron_core_spec(args, config, vp_stage):
    """megatron-core's decoder block spec (dense and MoE layers) with experts, else one layer's."""
    from megatron.core.models.gpt import gpt_layer_specs as specs
    from megatron.training import cpu_shim
    te = args.transformer_impl == "transformer_engine"
    if args.num_experts is not None:
        from megatron.training.moe import define_missing_te_gemm
        define_missing_te_gemm()
        block = specs.get_gpt_decoder_block_spec(config, use_transformer_engine=te, normalization=args.normalization,
                                                 vp_stage=vp_stage)
        if args.sequence_parallel and cpu_shim.installed():  # each layer's norms marked, as for dense layers
            marked = [cpu_shim.sequence_parallel_local_spec(s, config) for s in block.layer_specs]
            block.layer_specs = [m.layer_specs[0] for m in marked]
            block.layer_norm = marked[0].layer_norm
        return block
    if te:
        return specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=args.qk_layernorm,
                                                                multi_latent_attention=args.multi_latent_attention)
    spec = specs.get_gpt_layer_local_spec(normalization=args.normalization, qk_layernorm=args.qk_layernorm,
                                          multi_latent_attention=args.multi_latent_attention)
    if args.sequence_parallel and cpu_shim.installed():
        spec = cpu_shim.sequence_parallel_local_spec(spec, config)
    return spec


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """The micro-batch's mean loss over its unmasked tokens; with --calculate-per-token-loss its sum and token
    count instead (megatron-core's schedules then divide by the global batch's tokens)."""
    from megatron.training import get_args
    losses = output_tensor.float().reshape(-1)
    mask = loss_mask.reshape(-1).float()
    total, tokens = torch.sum(losses * mask), mask.sum()
    if get_args().calculate_per_token_loss:
        return total, tokens.to(torch.int), {"lm loss": torch.stack([total.detach(), tokens.detach()])}
    loss = total / tokens
    return loss, {"lm loss": loss.detach().clone()}  # the schedule scales `loss` in place


def forward_step(data_iterator, model):
    """One micro-batch: (output tensor, loss function), as megatron-core's schedules expect. The loss mask goes
    into the model too: its multi-token prediction layers (--mtp-num-layers) mask their own losses with it."""
    batch = next(data_iterator)
    output_tensor = model(batch["tokens"], batch["position_ids"], batch.get("attention_mask"), labels=batch["labels"],
                          loss_mask=batch["loss_mask"])
    return output_tensor, partial(loss_func, batch["loss_mask"])


def train_valid_test_datasets_provider(args):
    """(train, valid, test): megatron-core's GPTDataset blends of --data-path and --split (or --mock-data)."""
    from megatron.training.data import build_train_valid_test_datasets
    return build_train_valid_test_datasets(args)


def _this_repository_trainer():
    import megatron.training
    where = os.path.dirname(os.path.abspath(megatron.training.__file__))
    if where != os.path.join(_HERE, "megatron", "training"):
        raise ImportError(f"megatron.training was imported from {where}, not from this repository ({_HERE}): "
                          "something imported upstream's megatron.training before pretrain_gpt.py ran")
    return megatron.training.pretrain


if __name__ == "__main__":
    pretrain = _this_repository_trainer()
    pretrain(train_valid_test_datasets_provider, model_provider, forward_step_func=forward_step)
