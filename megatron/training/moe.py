"""Mixture-of-experts flags (Megatron-LM's names), their checks before any work, and megatron-core's config of them.

The model is megatron-core's own: `GPTModel` with the decoder block spec of `get_gpt_decoder_block_spec` (MoE
layers at `--moe-layer-freq`), its `TopKRouter`, its token dispatchers and its experts; its
`get_megatron_optimizer` then returns a `ChainedOptimizer` of a dense and an expert optimizer (see
optimizer_state). Imports neither torch nor megatron-core: argument validation uses it.
"""
from __future__ import annotations

import ast

LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none")
DISPATCHER_TYPES = ("allgather", "alltoall", "flex")
# The flags that only mean something with --num-experts: (name, value when unset).
_MOE_ONLY = (("moe_ffn_hidden_size", None), ("moe_shared_expert_intermediate_size", None),
             ("moe_router_enable_expert_bias", False), ("moe_grouped_gemm", False),
             ("moe_aux_loss_coeff", 0.0), ("moe_layer_freq", 1), ("moe_router_topk", 2),
             ("moe_router_load_balancing_type", "aux_loss"), ("moe_token_dispatcher_type", "allgather"),
             ("moe_router_score_function", "softmax"), ("moe_router_pre_softmax", False),
             ("moe_router_dtype", None), ("moe_router_num_groups", None), ("moe_router_group_topk", None),
             ("moe_router_topk_scaling_factor", None), ("moe_z_loss_coeff", None),
             ("expert_model_parallel_size", 1), ("expert_tensor_parallel_size", None))


# The MoE flags that shape the weights or the function of the model (--use-checkpoint-args takes them from the
# checkpoint); the expert layout, the dispatcher and the balancing loss's weight are the run's choices.
ARCHITECTURE = ("num_experts", "moe_ffn_hidden_size", "moe_router_topk", "moe_router_load_balancing_type",
                "moe_router_score_function", "moe_router_pre_softmax", "moe_shared_expert_intermediate_size",
                "moe_layer_freq", "moe_router_enable_expert_bias", "moe_router_num_groups", "moe_router_group_topk",
                "moe_router_topk_scaling_factor")


def moe_layer_freq(text: str):
    """An int N (an MoE layer every N layers) or a list of 0/1 per layer such as "[1,0,1,0]" or, as upstream's
    scripts write it, "([0]*1+[1]*3)": lists, integers, + and * only (parsed, never evaluated)."""
    try:
        value = _list_expression(ast.parse(text.strip(), mode="eval").body)
    except (ValueError, SyntaxError, TypeError):
        value = None
    if (isinstance(value, int) and value > 0) or (isinstance(value, list) and value
                                                  and all(v in (0, 1) for v in value)):
        return value
    raise ValueError(f"--moe-layer-freq {text!r}: give an integer or a list of 0/1 such as [1,0,1,0] or "
                     "([0]*1+[1]*3)")


def _list_expression(node):
    """The value of an expression of integer constants, lists of them, + and *; ValueError for anything else."""
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.List):
        return [_list_expression(e) for e in node.elts]
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
        left, right = _list_expression(node.left), _list_expression(node.right)
        return left + right if isinstance(node.op, ast.Add) else left * right
    raise ValueError(ast.dump(node))


def add_moe_args(parser) -> None:
    g = parser.add_argument_group("mixture of experts")
    g.add_argument("--num-experts", type=int, default=None, help="experts per MoE layer (off: dense MLPs)")
    g.add_argument("--moe-ffn-hidden-size", type=int, default=None, help="each expert's hidden size [--ffn-hidden-size]")
    g.add_argument("--moe-router-topk", type=int, default=2,
                   help="experts each token is routed to")
    g.add_argument("--moe-router-load-balancing-type", choices=LOAD_BALANCING_TYPES, default="aux_loss",
                   help="the router's load-balancing loss")
    g.add_argument("--moe-router-score-function", choices=["softmax", "sigmoid"], default="softmax",
                   help="the router's score function")
    g.add_argument("--moe-router-pre-softmax", action="store_true",
                   help="softmax before the top-k selection instead of after")
    g.add_argument("--moe-router-dtype", choices=["fp32", "fp64"], default=None,
                   help="the router's logits and probabilities in this precision [the activations']")
    g.add_argument("--moe-router-num-groups", type=int, default=None, help="group-limited routing: expert groups")
    g.add_argument("--moe-router-group-topk", type=int, default=None, help="group-limited routing: groups per token")
    g.add_argument("--moe-router-topk-scaling-factor", type=float, default=None,
                   help="scale the top-k routing weights by this [none]")
    g.add_argument("--moe-z-loss-coeff", type=float, default=None, help="weight of the router's z-loss")
    g.add_argument("--moe-aux-loss-coeff", type=float, default=0.0,
                   help="the weight of the load-balancing loss")
    g.add_argument("--moe-token-dispatcher-type", choices=DISPATCHER_TYPES, default="allgather",
                   help="how tokens reach their experts (flex is refused: DeepEP is not wired)")
    g.add_argument("--moe-shared-expert-intermediate-size", type=int, default=None,
                   help="a shared expert of this hidden size beside the routed ones")
    g.add_argument("--moe-layer-freq", type=moe_layer_freq, default=1,
                   help="an MoE layer every N layers, or a 0/1 list per layer such as [1,0,1,0]")
    g.add_argument("--moe-router-enable-expert-bias", action="store_true",
                   help="aux-loss-free load balancing: a per-expert bias (a saved buffer) updated from the load")
    g.add_argument("--moe-router-bias-update-rate", type=float, default=1e-3,
                   help="the update rate of the expert bias (aux-loss-free load balancing)")
    g.add_argument("--moe-grouped-gemm", action="store_true",
                   help="grouped GEMM experts (CUDA only; on CPU the experts are SequentialMLP)")
    g.add_argument("--expert-model-parallel-size", type=int, default=1,
                   help="expert-parallel size (EP)")
    g.add_argument("--expert-tensor-parallel-size", type=int, default=None, help="[--tensor-model-parallel-size]")


def validate_moe(args, world_size: int, cuda: bool) -> None:
    """The MoE flags against each other and the world size; raises ValueError naming the flag."""
    if args.num_experts is None:
        for name, unset in _MOE_ONLY:
            if getattr(args, name) != unset:
                raise ValueError(f"--{name.replace('_', '-')} applies to mixture-of-experts layers: it needs "
                                 "--num-experts")
        return
    ep = args.expert_model_parallel_size
    if args.num_experts <= 0 or ep <= 0:
        raise ValueError("--num-experts and --expert-model-parallel-size must be positive")
    if args.expert_tensor_parallel_size is None:
        args.expert_tensor_parallel_size = args.tensor_model_parallel_size
    etp, pp = args.expert_tensor_parallel_size, args.pipeline_model_parallel_size
    if args.num_experts % ep:
        raise ValueError(f"--num-experts {args.num_experts} is not divisible by --expert-model-parallel-size {ep}")
    if world_size % (etp * ep * pp):
        raise ValueError(f"world size {world_size} is not divisible by --expert-tensor-parallel-size {etp} x "
                         f"--expert-model-parallel-size {ep} x --pipeline-model-parallel-size {pp}")
    if not 0 < args.moe_router_topk <= args.num_experts:
        raise ValueError(f"--moe-router-topk {args.moe_router_topk} must be in 1..--num-experts {args.num_experts}")
    if args.moe_router_topk == 1 and args.moe_router_score_function == "softmax" and \
            not args.moe_router_pre_softmax and args.moe_router_load_balancing_type != "sinkhorn":
        raise ValueError("--moe-router-topk 1 with a softmax router needs --moe-router-pre-softmax (a softmax over "
                         "one expert has no gradient)")
    if args.moe_router_enable_expert_bias and args.moe_router_score_function != "sigmoid":
        raise ValueError("--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid")
    if isinstance(args.moe_layer_freq, list) and len(args.moe_layer_freq) != args.num_layers:
        raise ValueError(f"--moe-layer-freq lists {len(args.moe_layer_freq)} layers, --num-layers is "
                         f"{args.num_layers}")
    if not args.disable_bias_linear and etp != 1:
        raise ValueError(f"--expert-tensor-parallel-size {etp}: megatron-core's experts have biases only with "
                         "expert TP 1; pass --disable-bias-linear")
    if not args.disable_bias_linear and args.transformer_impl == "local":
        raise ValueError("--num-experts with biased linear layers (no --disable-bias-linear): megatron-core's local "
                         "SequentialMLP experts (0.16.1 and 0.19.2, transformer/mlp.py) add the expert bias in place "
                         "to the output of an autograd function, which PyTorch refuses in training; pass "
                         "--disable-bias-linear")
    if args.moe_token_dispatcher_type == "flex":
        raise ValueError("--moe-token-dispatcher-type flex needs DeepEP on CUDA; use allgather or alltoall")
    if args.moe_grouped_gemm and not cuda:
        raise ValueError("--moe-grouped-gemm needs CUDA: megatron-core's grouped-GEMM experts (the grouped_gemm "
                         "package, Transformer Engine) have no CPU kernels; without the flag the same experts run "
                         "as SequentialMLP, one GEMM per local expert, with the same checkpoint keys")
    if args.tensor_model_parallel_size > 1 and not args.sequence_parallel:
        raise ValueError("--num-experts with --tensor-model-parallel-size > 1 needs --sequence-parallel "
                         "(megatron-core's MoE layer trains TP only with it)")
    if args.moe_ffn_hidden_size is None:
        args.moe_ffn_hidden_size = args.ffn_hidden_size


def moe_config_kwargs(args) -> dict:
    """TransformerConfig's MoE fields from the flags (nothing when the model is dense)."""
    if args.num_experts is None:
        return {}
    return dict(num_moe_experts=args.num_experts, moe_ffn_hidden_size=args.moe_ffn_hidden_size,
                moe_router_topk=args.moe_router_topk,
                moe_router_load_balancing_type=args.moe_router_load_balancing_type,
                moe_router_score_function=args.moe_router_score_function,
                moe_router_pre_softmax=args.moe_router_pre_softmax, moe_aux_loss_coeff=args.moe_aux_loss_coeff,
                moe_router_dtype=args.moe_router_dtype, moe_router_num_groups=args.moe_router_num_groups,
                moe_router_group_topk=args.moe_router_group_topk,
                moe_router_topk_scaling_factor=args.moe_router_topk_scaling_factor,
                moe_z_loss_coeff=args.moe_z_loss_coeff,
                moe_token_dispatcher_type=args.moe_token_dispatcher_type,
                moe_shared_expert_intermediate_size=args.moe_shared_expert_intermediate_size,
                moe_layer_freq=args.moe_layer_freq, moe_router_enable_expert_bias=args.moe_router_enable_expert_bias,
                moe_router_bias_update_rate=args.moe_router_bias_update_rate,
                moe_grouped_gemm=args.moe_grouped_gemm,
                expert_model_parallel_size=args.expert_model_parallel_size,
                expert_tensor_parallel_size=args.expert_tensor_parallel_size)


def define_missing_te_gemm() -> None:
    """megatron-core 0.16.1 without Transformer Engine: the router's linear checks `te_general_gemm is not None`,
    but `moe_utils` defines that name only when TE imports, so the first forward fails with NameError. 0.19
    defines it as None without TE; so does this, where it is missing (nothing changes where it is defined)."""
    from megatron.core.transformer.moe import moe_utils
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
