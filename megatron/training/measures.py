"""What --log-throughput, --log-params-norm and --log-memory-to-tensorboard report.

The FLOPs are the model's matrix multiplies, counted per token as upstream counts them: each decoder layer's
attention (standard with grouped queries, or multi-latent attention's low-rank projections) and MLP (dense, or a
mixture of experts: router, the top-k routed experts, the shared expert) by the layer pattern, each multi-token
prediction layer, the logits. Two FLOPs per multiply-add, three passes (forward, and a backward twice its cost).
Attention scores span the whole sequence (the causal mask's skipped half is counted, as the kernels compute it).
"""
from __future__ import annotations

import torch

from megatron.core import parallel_state as ps


def flops_per_iteration(args, batch_size: int) -> float:
    """Model FLOPs of one iteration of `batch_size` sequences (forward and backward, no recompute)."""
    return 2 * 3 * batch_size * args.seq_length * multiply_adds_per_token(args)


def multiply_adds_per_token(args) -> int:
    """One token's multiply-adds in the forward pass: the decoder, the MTP layers, the logits."""
    logits = args.hidden_size * args.padded_vocab_size
    pattern = moe_layer_pattern(args)
    decoder = sum(attention(args) + (moe_mlp(args) if moe else dense_mlp(args)) for moe in pattern)
    return decoder + (args.mtp_num_layers or 0) * mtp_layer(args, last_is_moe=pattern[-1]) + logits


def moe_layer_pattern(args) -> list[bool]:
    """Which decoder layers are MoE: none without experts, --moe-layer-freq's list, or every N-th from the first."""
    if args.num_experts is None:
        return [False] * args.num_layers
    freq = args.moe_layer_freq
    if isinstance(freq, list):
        return [bool(moe) for moe in freq]
    return [i % freq == 0 for i in range(args.num_layers)]


def attention(args) -> int:
    """One token's attention: multi-latent or standard."""
    return latent_attention(args) if args.multi_latent_attention else standard_attention(args)


def standard_attention(args) -> int:
    """QKV (keys and values per query group), scores and values over the sequence, the output projection."""
    h, heads = args.hidden_size, args.num_attention_heads
    head_dim = args.kv_channels or h // heads
    groups = args.num_query_groups if args.group_query_attention else heads
    q_width, kv_width = heads * head_dim, groups * head_dim
    return h * (q_width + 2 * kv_width) + 2 * args.seq_length * q_width + q_width * h


def latent_attention(args) -> int:
    """Queries (one projection, or down to --q-lora-rank and up), keys/values down to the latent plus the shared
    rotary part and up per head, scores over qk + rotary dims, values of v_head_dim, the output projection."""
    h, heads, rope = args.hidden_size, args.num_attention_heads, args.qk_pos_emb_head_dim
    q_head = args.qk_head_dim + rope
    queries = (h * heads * q_head if args.q_lora_rank is None
               else h * args.q_lora_rank + args.q_lora_rank * heads * q_head)
    keys_values = h * (args.kv_lora_rank + rope) + args.kv_lora_rank * heads * (args.qk_head_dim + args.v_head_dim)
    scores_values = args.seq_length * heads * (q_head + args.v_head_dim)
    return queries + keys_values + scores_values + heads * args.v_head_dim * h


def feed_forward(args, ffn_hidden: int) -> int:
    """One MLP of `ffn_hidden`: up (with SwiGLU's gate) and down."""
    return args.hidden_size * ffn_hidden * (3 if args.swiglu else 2)


def dense_mlp(args) -> int:
    return feed_forward(args, args.ffn_hidden_size)


def moe_mlp(args) -> int:
    """The router's scores over all experts, the top-k routed experts, the shared expert if any."""
    router = args.hidden_size * args.num_experts
    routed = args.moe_router_topk * feed_forward(args, args.moe_ffn_hidden_size)
    shared = args.moe_shared_expert_intermediate_size
    return router + routed + (feed_forward(args, shared) if shared else 0)


def mtp_layer(args, last_is_moe: bool) -> int:
    """One MTP layer: its 2h -> h projection, a transformer layer like the decoder's last, its logits."""
    h = args.hidden_size
    mlp = moe_mlp(args) if last_is_moe else dense_mlp(args)
    return 2 * h * h + attention(args) + mlp + h * args.padded_vocab_size


def params_norm(model: list) -> float:
    """The L2 norm of the model chunks' parameters, each counted once across tensor and pipeline ranks."""
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
    from megatron.core.transformer.module import param_is_not_shared
    params = [p for chunk in model for p in chunk.parameters()]
    squares = torch.zeros(1, dtype=torch.float64, device=params[0].device)
    for p in params:
        if param_is_not_shared(p) and param_is_not_tensor_parallel_duplicate(p):
            squares += p.detach().double().pow(2).sum()
    torch.distributed.all_reduce(squares, group=ps.get_model_parallel_group())
    return float(squares.sqrt())


def memory(device) -> dict:
    """The CUDA allocator's figures with CUDA; the process's resident memory on CPU ranks."""
    if device.type == "cuda":
        stats = torch.cuda.memory_stats(device)
        return {"mem-allocated-bytes": stats["allocated_bytes.all.current"],
                "mem-max-allocated-bytes": stats["allocated_bytes.all.peak"],
                "mem-reserved-bytes": stats["reserved_bytes.all.current"]}
    import psutil
    return {"mem-resident-bytes": psutil.Process().memory_info().rss}
