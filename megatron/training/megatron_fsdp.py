"""--use-megatron-fsdp: megatron-core's Megatron-FSDP (`FullyShardedDataParallel` over flat per-group buffers), a
CUDA-only implementation: refused on CPU ranks with that reason, honoured on CUDA with upstream's own refusals
beside it (megatron-core 0.19.2's megatron/training/arguments.py), and the model wrapped as upstream's `get_model`
wraps it.

Its parameters and Adam's states are DTensors sharded on dim 0 unevenly, where its buffers cut them; the engine's
DTensor provider saves them by their true boxes, learned once per layout (datastates/dtensor_layouts.py). The
trainer's own checkpoints of such a run need the state assembly in megatron/training/checkpointing/ to take those
DTensors (as it does FSDP2's) and the distributed optimizer's Megatron-FSDP state, which is not wired yet: a run
with --save or --load is refused until it is (docs/fsdp.md).
"""
from __future__ import annotations

import dataclasses
import os

import torch

CPU_ONLY = ("Megatron-FSDP is a CUDA-only implementation (its constructor takes the current CUDA device, its buffers "
            "and streams are CUDA's); use --use-torch-fsdp2 on CPU (torch's fully_shard, any device; docs/fsdp.md)")
# its options, honoured only beside it (name, the flag); their defaults are None until validation fills them
OPTIONS = (("data_parallel_sharding_strategy", "--data-parallel-sharding-strategy"),
           ("megatron_fsdp_main_params_dtype", "--megatron-fsdp-main-params-dtype"),
           ("megatron_fsdp_main_grads_dtype", "--megatron-fsdp-main-grads-dtype"),
           ("megatron_fsdp_grad_comm_dtype", "--megatron-fsdp-grad-comm-dtype"),
           ("fsdp_double_buffer", "--fsdp-double-buffer"))
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "auto": None}


def add_arguments(g) -> None:
    """Upstream's flags, in the parallelism group."""
    g.add_argument("--use-megatron-fsdp", action="store_true",
                   help="Megatron-FSDP (megatron-core's FullyShardedDataParallel over flat buffers; CUDA only, "
                        "refused on CPU ranks: use --use-torch-fsdp2 there; docs/fsdp.md)")
    g.add_argument("--data-parallel-sharding-strategy", default=None,
                   choices=["no_shard", "optim", "optim_grads", "optim_grads_params"],
                   help="what Megatron-FSDP shards over the DP ranks (default optim_grads_params)")
    for what, default in (("params", "fp32"), ("grads", "auto")):
        g.add_argument(f"--megatron-fsdp-main-{what}-dtype", default=None, choices=list(_DTYPES),
                       help=f"Megatron-FSDP's main {what[:-1]} buffer (default {default})")
    g.add_argument("--megatron-fsdp-grad-comm-dtype", default=None, choices=list(_DTYPES),
                   help="the dtype Megatron-FSDP reduces gradients in (default auto: the main gradients')")
    g.add_argument("--fsdp-double-buffer", action="store_true", default=None,
                   help="double-buffer Megatron-FSDP's communication memory")


def validate(args, cuda: bool) -> None:
    """On CPU ranks the flag is refused (and its options without it); on CUDA, upstream's refusals beside it.
    Raises ValueError naming the flag; fills the options' defaults and, as upstream does, the distributed
    optimizer (Megatron-FSDP shards the optimizer state through it)."""
    if not getattr(args, "use_megatron_fsdp", False):
        for name, flag in OPTIONS:
            if getattr(args, name, None) is not None:
                raise ValueError(f"{flag} is an option of --use-megatron-fsdp, which is not given")
        return
    if not cuda:
        raise ValueError(f"--use-megatron-fsdp: {CPU_ONLY}")
    if args.use_torch_fsdp2:
        raise ValueError("--use-megatron-fsdp with --use-torch-fsdp2: two implementations of the same sharding; "
                         "pick one")
    if os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1":
        raise ValueError("--use-megatron-fsdp with CUDA_DEVICE_MAX_CONNECTIONS=1: megatron-core's Megatron-FSDP "
                         "overlaps its communication on more than one connection; unset it or raise it")
    if args.ckpt_format != "datastates":
        raise ValueError(f"--use-megatron-fsdp with --ckpt-format {args.ckpt_format}: megatron-core saves "
                         "Megatron-FSDP's uneven DTensor shards only in its fsdp_dtensor format; here use "
                         "--ckpt-format datastates")
    if args.save or args.load:
        flag = "--save" if args.save else "--load"
        raise ValueError(f"--use-megatron-fsdp with {flag}: the trainer's checkpoints of a Megatron-FSDP run are "
                         "not wired yet (the engine saves its DTensors, docs/fsdp.md); train without them, or "
                         "use --use-torch-fsdp2, whose checkpoints are")
    args.data_parallel_sharding_strategy = args.data_parallel_sharding_strategy or "optim_grads_params"
    args.megatron_fsdp_main_params_dtype = args.megatron_fsdp_main_params_dtype or "fp32"
    args.megatron_fsdp_main_grads_dtype = args.megatron_fsdp_main_grads_dtype or "auto"
    args.megatron_fsdp_grad_comm_dtype = args.megatron_fsdp_grad_comm_dtype or "auto"
    args.fsdp_double_buffer = bool(args.fsdp_double_buffer)
    args.use_distributed_optimizer = True  # upstream's rule: Megatron-FSDP's optimizer is the distributed one
    settable = _ddp_fields()
    for what, default in (("main_params", "fp32"), ("main_grads", "auto"), ("grad_comm", "auto")):
        if getattr(args, f"megatron_fsdp_{what}_dtype") != default and f"megatron_fsdp_{what}_dtype" not in settable:
            raise ValueError(f"--megatron-fsdp-{what.replace('_', '-')}-dtype needs megatron-core 0.19 or newer "
                             "(the installed one has no such setting)")


def _ddp_fields() -> set[str]:
    from megatron.core.distributed import DistributedDataParallelConfig
    return {f.name for f in dataclasses.fields(DistributedDataParallelConfig)}


def wrap(args, module: torch.nn.Module, config, ddp_config, chunk: int) -> torch.nn.Module:
    """`module` inside megatron-core's FullyShardedDataParallel, configured from `ddp_config` and the flags as
    upstream's `get_megatron_ddp_config` does."""
    from megatron.core.distributed import FullyShardedDataParallel
    options = {"use_megatron_fsdp": True, "data_parallel_sharding_strategy": args.data_parallel_sharding_strategy,
               "fsdp_double_buffer": args.fsdp_double_buffer}
    settable = _ddp_fields()
    for what in ("main_params", "main_grads", "grad_comm"):
        if f"megatron_fsdp_{what}_dtype" in settable:  # megatron-core 0.19+ (validate refused them before)
            options[f"megatron_fsdp_{what}_dtype"] = _DTYPES[getattr(args, f"megatron_fsdp_{what}_dtype")]
    return FullyShardedDataParallel(config=config, ddp_config=dataclasses.replace(ddp_config, **options),
                                    module=module, disable_bucketing=chunk > 0)
