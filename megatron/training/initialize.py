"""Process setup: torch.distributed, megatron-core's parallel_state, seeds."""
from __future__ import annotations

import datetime
import logging
import os
import random
import sys

import numpy as np
import torch

from datastates.logs import setup_logging

from . import cpu_shim
from .arguments import ArgumentError, parse_args
from .failures import stage
from .argument_checks import validate_args
from .global_vars import set_args, set_tokenizer


def _world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def _validate_for_the_world(args) -> None:
    """validate_args on the world torchrun gave. Flags that passed at the job's start fail on a torchrun restart
    only because the world changed (an elastic job that lost nodes): the error then says so, before anything is
    read or written, so the newest checkpoint stays as it was."""
    world = _world_size_from_env()
    try:
        validate_args(args, world)
    except ArgumentError as e:
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        if attempt == "0":
            raise
        raise ArgumentError(f"torchrun restart {attempt}: the world of the {os.environ.get('GROUP_WORLD_SIZE', '?')} "
                            f"node(s) present, {world} ranks, does not fit this job: {e}. Nothing was loaded or "
                            "written: the newest checkpoint is as it was; relaunch on nodes whose ranks fit") from None


def apply_args_defaults(args, defaults: dict | None) -> None:
    """Megatron-LM's `args_defaults`: a script's own defaults for the flags its command line leaves unset."""
    for key, value in (defaults or {}).items():
        if not hasattr(args, key):
            raise ArgumentError(f"args_defaults names {key!r}, which is not a flag of this trainer")
        if getattr(args, key) is None:
            setattr(args, key, value)


def initialize_megatron(extra_args_provider=None, argv=None, args_defaults=None):
    """Parse and validate flags (before any work), then init distributed, model parallel groups and seeds."""
    args = parse_args(extra_args_provider, argv)
    apply_args_defaults(args, args_defaults)
    if args.use_checkpoint_args:
        from .args_from_checkpoint import apply_checkpoint_args
        apply_checkpoint_args(args)
    _validate_for_the_world(args)
    if not args.enable_msc:
        from .checkpointing.formats import disable_mcore_msc
        disable_mcore_msc()
    rank = int(os.environ.get("RANK", "0"))
    set_tokenizer(setup_data_and_schedule(args, rank))
    cuda = torch.cuda.is_available()
    cpu_shim.install()  # no-op with CUDA
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
    args.owns_process_group = not torch.distributed.is_initialized()
    if args.owns_process_group:
        with stage("the process group set-up", args.distributed_timeout_minutes):
            _init_default_group(args, rank)
    args.rank = torch.distributed.get_rank()
    setup_logging(args.rank, all_ranks=args.log_all_ranks or None, stream=sys.stdout,
                  level=args.logging_level or logging.INFO)
    if args.enable_experimental:
        from megatron.core.config import set_experimental_flag
        set_experimental_flag(True)
    if args.deterministic_mode:  # before the first cuBLAS handle, which reads the workspace setting
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
    if args.disable_bf16_reduced_precision_matmul:
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    args.device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    from megatron.core import parallel_state as ps
    with stage("megatron-core's process groups set-up", args.distributed_timeout_minutes):
        ps.initialize_model_parallel(args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                                     virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
                                     expert_model_parallel_size=args.expert_model_parallel_size,
                                     expert_tensor_parallel_size=args.expert_tensor_parallel_size,
                                     distributed_timeout_minutes=args.distributed_timeout_minutes)  # default 30
    set_seed(args.seed)
    set_args(args)
    return args


def _init_default_group(args, rank: int) -> None:
    """torch.distributed's default group, bounded by --distributed-timeout-minutes."""
    timeout = datetime.timedelta(minutes=args.distributed_timeout_minutes)
    store = {}
    if args.world_size == 1 and "MASTER_PORT" not in os.environ:
        # one process started without a launcher meets nobody: a store of its own on a port the kernel picks,
        # so it never collides with another run on the machine
        store["store"] = torch.distributed.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timeout)
    else:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29500")
        store = attempt_store(args.world_size, timeout)
    torch.distributed.init_process_group(backend=args.distributed_backend, rank=rank, world_size=args.world_size,
                                         timeout=timeout, **store)


def attempt_store(world_size: int, timeout: datetime.timedelta) -> dict:
    """The store of this torchrun attempt, as `init_process_group`'s keyword (empty when torch's own is right).

    torchrun (c10d rendezvous) shares its agent's TCPStore with the workers by default and keeps it across
    restarts, without a prefix per attempt: the workers of a restart would read the addresses the killed
    attempt's ranks published (gloo's connectFullMesh or NCCL's unique id, "Connection refused"; PyTorch issues
    135712 and 167288). Every key of this attempt (process groups, megatron-core's groups, the checkpoint
    coordination) goes under its own prefix, the agent's restart count. One agent's count is the same for all
    its workers, and static rendezvous agents count each failure alike (every node's workers fail with it); c10d
    rendezvous agents of several nodes can count differently (a node restarted for a membership change does not
    count it), so multi-node jobs with restarts set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (docs/restarts.md),
    which gives every attempt of a c10d rendezvous a fresh store hosted by its rank 0."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if int(os.environ.get("GROUP_WORLD_SIZE", "1")) > 1 and int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) \
            and os.environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE") != "1":
        logging.getLogger(__name__).warning(
            "torchrun shares its rendezvous store with the workers across %s nodes and may restart them: the "
            "nodes' restart counts can differ after a restart, so set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in the "
            "launcher's environment (docs/restarts.md)", os.environ["GROUP_WORLD_SIZE"])
    agent = torch.distributed.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                                       is_master=False, timeout=timeout)
    return {"store": torch.distributed.PrefixStore(f"attempt_{attempt}/", agent)}


def setup_data_and_schedule(args, rank: int):
    """What the flags imply before any work: the tokenizer and the padded vocabulary (upstream's rule), the data
    paths checked, the num-microbatches calculator and, for --train-samples, the number of iterations. Returns
    the tokenizer; a bad data path stops here with ArgumentError."""
    from .data import check_data_paths
    from .schedules import init_microbatches, train_iters_for_samples
    from .tokenizer import build_tokenizer, padded_vocab_size
    tokenizer = build_tokenizer(args)
    # the real vocabulary, saved with the flags: with a tokenizer type other than NullTokenizer --vocab-size is
    # unset, and the Hugging Face export (datastates.hf) needs it to drop the padded rows
    args.tokenizer_vocab_size = tokenizer.vocab_size
    args.padded_vocab_size = padded_vocab_size(tokenizer.vocab_size, args.make_vocab_size_divisible_by,
                                               args.tensor_model_parallel_size)
    try:
        check_data_paths(args)
    except ValueError as e:
        raise ArgumentError(str(e)) from None
    init_microbatches(args, rank)
    if args.train_samples is not None:
        args.train_iters = train_iters_for_samples(args)
    return tokenizer


def shutdown_distributed(args) -> None:
    """Destroy megatron-core's groups and, when `initialize_megatron` created it, the process group: gloo's
    worker threads can still hold finished async work (pipeline isend/irecv, coalesced collectives) whose
    destruction during interpreter finalization aborts the process ("terminate called without an active
    exception")."""
    from megatron.core import parallel_state as ps
    from megatron.core.num_microbatches_calculator import destroy_num_microbatches_calculator
    ps.destroy_model_parallel()
    destroy_num_microbatches_calculator()
    if getattr(args, "owns_process_group", False) and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def set_seed(seed: int):
    """Megatron's _set_random_seed: one seed per pipeline stage, the TP tracker seeded per TP rank."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    seed = seed + 100 * ps.get_pipeline_model_parallel_rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        model_parallel_cuda_manual_seed(seed)
    else:
        # The CUDA RNG tracker cannot fork CPU generators; the inference tracker keeps megatron-core's API and
        # leaves every draw on torch's default (CPU) generator, which is saved and restored per rank.
        model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True, force_reset_rng=True)
