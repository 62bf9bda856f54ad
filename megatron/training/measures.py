"""What --log-throughput, --log-params-norm and --log-memory-to-tensorboard report.

The FLOPs are counted as upstream counts them for a GPT: every matrix multiply of the forward pass (QKV with
grouped queries, attention scores and values, the projection, the MLP with its gate for SwiGLU, the logits),
two FLOPs per multiply-add, three passes (forward, and a backward twice its cost).
"""
from __future__ import annotations

import torch

from megatron.core import parallel_state as ps


def flops_per_iteration(args, batch_size: int) -> float:
    """Model FLOPs of one iteration of `batch_size` sequences (forward and backward, no recompute)."""
    h, s, layers = args.hidden_size, args.seq_length, args.num_layers
    kv = args.kv_channels or h // args.num_attention_heads
    q_width = kv * args.num_attention_heads
    kv_width = kv * (args.num_query_groups if args.group_query_attention else args.num_attention_heads)
    attention = h * (q_width + 2 * kv_width) + 2 * s * q_width + q_width * h  # per token: QKV, scores+values, proj
    mlp = h * args.ffn_hidden_size * (3 if args.swiglu else 2)
    logits = h * args.padded_vocab_size
    per_token = layers * (attention + mlp) + logits
    return 2 * 3 * batch_size * s * per_token


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
