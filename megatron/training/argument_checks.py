"""validate_args: the whole configuration checked against the world size before any work starts (no model is
built, no file is written), derived values filled in; ArgumentError names the flag and the way out. Like
arguments.py, it imports neither megatron-core nor torch.distributed.
"""
from __future__ import annotations

import argparse
import os

from datastates import CheckpointError, find_latest, fitted_replication, node_of, published_iterations, storage_for
from datastates.paths import (TRACKER, iteration_of, join as join_path, normalize as normalize_path,
                             scheme as url_scheme)

from .arguments import CKPT_FORMATS, DEFAULT_SPLIT, UPSTREAM_ONLY_FORMATS, ArgumentError
from .latent_attention import validate_mla
from .local_dirs import unwritable
from . import megatron_fsdp
from .fsdp import validate_fsdp2
from .moe import validate_moe
from .multi_token import validate_mtp
from .virtual_pipeline import validate_virtual_pipeline


def _require(args, *names):
    missing = [n for n in names if getattr(args, n.replace("-", "_")) is None]
    if missing:
        raise ArgumentError("missing required flag(s): " + ", ".join("--" + n for n in missing))


def _loadable(path: str, flag: str = "--load") -> tuple[bool, str]:
    """Whether `flag` points at something this trainer can load, and why not."""
    if url_scheme(path) is None and not os.path.isdir(path):
        return False, f"{flag} {path!r} does not exist or is not a directory"
    try:
        latest = find_latest(path)
    except CheckpointError as e:  # an unreadable tracker
        return False, f"{flag} {path!r}: {e}"
    return latest.path is not None, f"{flag} {path!r}: {latest.why_none()}"


def _validate_local_directories(args) -> None:
    """--save and the memory tier's directory on a file system can be created and written, before any work (URLs
    are probed by _validate_object_stores; --save-hf by check_save_hf)."""
    dirs = [("--save", args.save)]
    if args.non_persistent_save_interval is not None:
        dirs.append(("--non-persistent-local-ckpt-dir", args.non_persistent_local_ckpt_dir))
    for flag, path in dirs:
        if path is not None and url_scheme(path) is None:
            why = unwritable(flag, path)
            if why:
                raise ArgumentError(why)


def _validate_object_stores(args) -> None:
    """s3:// and msc:// on --save and --load (each on any storage: a run loads from one and saves to another): the
    datastates format, or torch_dist on msc:// where megatron-core writes through multi-storage-client, and a
    store that answers (credentials, bucket, endpoint) before any work."""
    urls = [(flag, path) for flag, path in (("--save", args.save), ("--load", args.load)) if path and url_scheme(path)]
    if not urls:
        return
    for flag, path in urls:
        if args.ckpt_format == "torch":
            raise ArgumentError(f"{flag} {path!r}: --ckpt-format torch writes local files (torch.save); object "
                                f"stores need --ckpt-format datastates (or torch_dist on an msc:// profile)")
        if args.ckpt_format == "torch_dist" and not path.startswith("msc://"):
            raise ArgumentError(f"{flag} {path!r}: --ckpt-format torch_dist: megatron-core reaches object stores "
                                f"through multi-storage-client only; use an msc:// profile for that bucket "
                                f"(an s3 provider in MSC_CONFIG), or --ckpt-format datastates")
        if path.startswith("msc://") and not args.enable_msc:
            raise ArgumentError(f"{flag} {path!r}: msc:// paths are disabled by --disable-msc")
        if args.ckpt_format == "torch_dist":
            from .checkpointing.formats import mcore_msc_missing
            why = mcore_msc_missing()
            if why:
                raise ArgumentError(f"{flag} {path!r}: --ckpt-format torch_dist on msc:// needs megatron-core's "
                                    f"multi-storage-client support: {why}; use --ckpt-format datastates")
        try:
            storage_for(path).list(path)
        except (OSError, CheckpointError, ImportError) as e:
            raise ArgumentError(f"{flag} {path!r}: {getattr(e, 'strerror', None) or e}") from None


def validate_args(args, world_size: int, *, cuda: bool | None = None) -> argparse.Namespace:
    """Check the configuration against the world size and fill derived values. Raises ArgumentError."""
    if cuda is None:
        import torch
        cuda = torch.cuda.is_available()
    args.world_size = world_size
    _validate_layout(args, world_size)
    _validate_run(args)
    _validate_implementation(args)
    _validate_data(args)
    _validate_checkpointing(args, world_size)
    _validate_object_stores(args)
    _validate_local_directories(args)
    _validate_load(args)
    _validate_device(args, cuda)
    try:
        validate_moe(args, world_size, cuda)
        validate_mla(args, cuda)
        validate_mtp(args, cuda)
        validate_virtual_pipeline(args)
        validate_fsdp2(args)
        megatron_fsdp.validate(args, cuda)
    except ValueError as e:
        raise ArgumentError(str(e)) from None
    _validate_save_hf(args)
    _validate_publish_weights(args)
    return args


def _validate_save_hf(args) -> None:
    """--save-hf's refusals (the offline export's, of the model's flags) at start-up, before any work."""
    if getattr(args, "save_hf", None) is None:
        for flag in ("save_hf_interval", "save_hf_keep_last", "save_hf_tokenizer"):
            if getattr(args, flag, None) is not None:
                raise ArgumentError(f"--{flag.replace('_', '-')} given without --save-hf")
        return
    from .checkpointing.hf_publish import check_save_hf
    why = check_save_hf(args)
    if why:
        raise ArgumentError(why)




def _validate_publish_weights(args) -> None:
    """--publish-weights-dir's refusals at start-up (its interval against the saves, and --save-hf's own)."""
    if getattr(args, "publish_weights_dir", None) is None:
        if getattr(args, "publish_weights_interval", None) is not None:
            raise ArgumentError("--publish-weights-interval given without --publish-weights-dir")
        return
    from .checkpointing.weights_publish import check_publish_weights
    why = check_publish_weights(args)
    if why:
        raise ArgumentError(why)


def _validate_layout(args, world_size: int) -> None:
    """Sizes against the world size: TP x PP divides it, heads and layers split evenly, the batch adds up."""
    _require(args, "num-layers", "hidden-size", "num-attention-heads", "seq-length", "micro-batch-size", "lr")
    for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "micro_batch_size",
                 "train_iters", "train_samples", "tensor_model_parallel_size", "pipeline_model_parallel_size"):
        if getattr(args, name) is not None and getattr(args, name) <= 0:
            raise ArgumentError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    if world_size % (tp * pp) != 0:
        raise ArgumentError(f"world size {world_size} is not divisible by tensor-model-parallel-size {tp} x "
                            f"pipeline-model-parallel-size {pp} = {tp * pp}")
    args.data_parallel_size = world_size // (tp * pp)
    if args.num_attention_heads % tp != 0:
        raise ArgumentError(f"--num-attention-heads {args.num_attention_heads} is not divisible by "
                            f"--tensor-model-parallel-size {tp}")
    if args.group_query_attention and args.num_query_groups % tp != 0:
        raise ArgumentError(f"--num-query-groups {args.num_query_groups} is not divisible by "
                            f"--tensor-model-parallel-size {tp}")
    if args.hidden_size % args.num_attention_heads != 0 and args.kv_channels is None:
        raise ArgumentError(f"--hidden-size {args.hidden_size} is not divisible by --num-attention-heads "
                            f"{args.num_attention_heads} (pass --kv-channels)")
    if args.num_layers % pp != 0:
        raise ArgumentError(f"--num-layers {args.num_layers} is not divisible by "
                            f"--pipeline-model-parallel-size {pp}")
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = 4 * args.hidden_size
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if args.seq_length > args.max_position_embeddings and args.position_embedding_type == "learned_absolute":
        raise ArgumentError(f"--seq-length {args.seq_length} exceeds --max-position-embeddings "
                            f"{args.max_position_embeddings}")
    if args.step_batch_size_schedule is not None:
        return  # the schedule's final batch size is the global batch size (schedules.validate_schedule)
    dp, mbs = args.data_parallel_size, args.micro_batch_size
    if args.global_batch_size is None:
        args.global_batch_size = mbs * dp
    if args.global_batch_size % (mbs * dp) != 0:
        raise ArgumentError(f"--global-batch-size {args.global_batch_size} is not divisible by micro-batch-size "
                            f"{mbs} x data-parallel size {dp} = {mbs * dp}")
    args.num_microbatches = args.global_batch_size // (mbs * dp)


def _validate_run(args) -> None:
    """The schedule, evaluation, exit conditions, metrics sinks and precision."""
    from .schedules import validate_schedule
    try:
        validate_schedule(args)
    except ValueError as e:
        raise ArgumentError(str(e)) from None
    for flag in ("eval_iters", "tensorboard_log_interval", "tensorboard_queue_size"):
        if getattr(args, flag) < 0 or (flag != "eval_iters" and getattr(args, flag) == 0):
            raise ArgumentError(f"--{flag.replace('_', '-')} must be positive, got {getattr(args, flag)}")
    if args.eval_interval <= 0:
        raise ArgumentError(f"--eval-interval must be positive, got {args.eval_interval}")
    if args.distributed_timeout_minutes <= 0:
        raise ArgumentError(f"--distributed-timeout-minutes must be positive, got {args.distributed_timeout_minutes:g}")
    if args.exit_duration_in_mins is not None and args.exit_duration_in_mins <= 0:
        raise ArgumentError(f"--exit-duration-in-mins must be positive, got {args.exit_duration_in_mins}")
    _require_package(args.tensorboard_dir, "--tensorboard-dir", "tensorboard", "tensorboard")
    _require_package(args.wandb_project, "--wandb-project", "wandb", "wandb")
    if args.wandb_project and not (args.wandb_save_dir or args.save):
        raise ArgumentError("--wandb-project needs --wandb-save-dir (or --save, whose wandb/ directory it uses)")
    if args.decoupled_min_lr is not None and args.decoupled_lr is None:
        raise ArgumentError("--decoupled-min-lr needs --decoupled-lr (the embedding and output layer's own peak)")
    if args.fp16 and args.bf16:
        raise ArgumentError("--fp16 and --bf16 are mutually exclusive")


def _validate_checkpointing(args, world_size: int) -> None:
    if args.ckpt_format == "torch_dcp":
        raise ArgumentError("--ckpt-format torch_dcp: --use-torch-fsdp2 runs save lazily in the default datastates "
                            "format here, and a torch_dcp checkpoint under --load is found and read without the "
                            "flag: drop it (tools/convert_checkpoint.py --to torch_dcp writes upstream's format, "
                            "docs/fsdp.md)")
    if args.ckpt_format in UPSTREAM_ONLY_FORMATS:
        raise ArgumentError(f"--ckpt-format {args.ckpt_format}: upstream's {args.ckpt_format} format is not saved "
                            f"here; formats: {', '.join(CKPT_FORMATS)} (sharded runs save their state in the default "
                            f"datastates format; tools/convert_checkpoint.py --from/--to {args.ckpt_format} reads "
                            "and writes upstream's, docs/fsdp.md)")
    if args.save_interval is not None and args.save_interval <= 0:
        raise ArgumentError(f"--save-interval must be positive, got {args.save_interval}")
    if args.verify_integrity and args.ckpt_format != "datastates":
        raise ArgumentError(f"--verify-integrity: --ckpt-format {args.ckpt_format} saves no checksums here; "
                            "--ckpt-format datastates checksums every chunk and checks it on load")
    if args.ckpt_step is not None and args.ckpt_step < 0:
        raise ArgumentError(f"--ckpt-step must be an iteration (0 or more), got {args.ckpt_step}")
    if args.save_interval is not None and args.save is None:
        raise ArgumentError("--save-interval given without --save")
    if args.ckpt_keep_last == "all":
        args.ckpt_keep_last = None
    else:
        try:
            args.ckpt_keep_last = int(args.ckpt_keep_last)
        except ValueError:
            raise ArgumentError(f"--ckpt-keep-last must be an integer or 'all', got {args.ckpt_keep_last!r}")
        if args.ckpt_keep_last < 1:
            raise ArgumentError("--ckpt-keep-last must be >= 1")
    if (args.ckpt_host_buffer_gb is not None and args.ckpt_host_buffer_gb <= 0) or args.ckpt_writer_threads <= 0 or \
            (args.ckpt_read_threads is not None and args.ckpt_read_threads <= 0):
        raise ArgumentError("--ckpt-host-buffer-gb, --ckpt-writer-threads and --ckpt-read-threads must be positive")
    if args.ckpt_compress != "off" and args.ckpt_format != "datastates":
        raise ArgumentError(f"--ckpt-compress {args.ckpt_compress} applies to --ckpt-format datastates only (its engine "
                            f"compresses the chunks it writes); --ckpt-format {args.ckpt_format} saves as "
                            f"{'megatron-core' if args.ckpt_format == 'torch_dist' else 'torch.save'} does: drop "
                            "--ckpt-compress or --ckpt-format")
    if args.ckpt_publish_timeout_s <= 0:
        raise ArgumentError(f"--ckpt-publish-timeout-s must be positive, got {args.ckpt_publish_timeout_s:g}")
    if args.async_ckpt and args.ckpt_format != "datastates":
        raise ArgumentError(f"--async-ckpt is the datastates engine's lazy save; --ckpt-format {args.ckpt_format} "
                            "selects another writer, which saves synchronously here: drop --ckpt-format (its "
                            "checkpoints still load, whatever --ckpt-format says) or drop --async-ckpt")
    if args.non_persistent_save_interval is not None:
        if args.non_persistent_save_interval <= 0:
            raise ArgumentError(f"--non-persistent-save-interval must be positive, got "
                                f"{args.non_persistent_save_interval}")
        if args.non_persistent_ckpt_type != "local":
            raise ArgumentError(f"--non-persistent-ckpt-type {args.non_persistent_ckpt_type}: only 'local' "
                                "(node-local memory) is available")
        if args.ckpt_format != "datastates":
            raise ArgumentError("--non-persistent-save-interval needs --ckpt-format datastates")
    if args.replication:
        if args.non_persistent_save_interval is None:
            raise ArgumentError("--replication replicates the memory tier: it needs --non-persistent-save-interval")
        if args.replication_factor < 2:
            raise ArgumentError(f"--replication-factor must be >= 2 with --replication, got "
                                f"{args.replication_factor}")
        if args.replication_jump is not None and args.replication_jump <= 0:
            raise ArgumentError(f"--replication-jump must be positive, got {args.replication_jump}")
        # the tier's own rule (the jump defaults to the ranks per node), refused at a job's start; a torchrun
        # restart on fewer nodes replicates among those left, with a NOTICE (LocalTier)
        per_node = node_of(0, world_size)[1]
        factor, jump = fitted_replication(world_size, per_node, args.replication_factor, args.replication_jump)
        restarted = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0"
        if factor < args.replication_factor and not restarted:
            given = "" if args.replication_jump else f" (the ranks per node, {per_node}, when not given)"
            raise ArgumentError(f"--replication-factor {args.replication_factor} x --replication-jump {jump}"
                                f"{given} must divide the world size {world_size}: this world cannot replicate "
                                f"as asked")
    if args.save_after_load:
        if args.save is None or args.load is None:
            raise ArgumentError("--save-after-load needs both --load and --save")
        if os.path.normpath(args.save) == os.path.normpath(args.load):
            raise ArgumentError("--save-after-load: --save must be another directory than --load (the loaded "
                                "iteration is saved again)")


def _validate_load(args) -> None:
    """--load points at something loadable, or is the fresh "resume if possible" --load equal to --save, or
    --pretrained-checkpoint is loadable in its stead; --ckpt-step names a published iteration of the one loaded."""
    finetune_from = args.pretrained_checkpoint
    if args.load is not None:
        ok, why = _loadable(args.load)
        fresh = (normalize_path(args.load) == normalize_path(args.save or ".")
                 and not storage_for(args.load).exists(join_path(args.load, TRACKER)))
        if not ok and finetune_from is None and (args.exit_on_missing_checkpoint or not fresh):
            # Megatron starts from scratch when --load equals --save and nothing was saved there yet (the usual
            # "resume if possible" launch); anything else that points at nothing loadable is an error.
            raise ArgumentError(why)
        args.load_exists = ok
    else:
        args.load_exists = False
    if finetune_from is not None and not args.load_exists:  # upstream: then fine-tune from it
        ok, why = _loadable(finetune_from, "--pretrained-checkpoint")
        if not ok:
            raise ArgumentError(why + (f" (and --load {args.load!r} holds no checkpoint)" if args.load else ""))
    if args.ckpt_step is not None:
        _validate_ckpt_step(args, args.load if args.load_exists or finetune_from is None else finetune_from)


def _validate_ckpt_step(args, root: str | None) -> None:
    """--ckpt-step N: iteration N of the save root the run loads from is published."""
    if root is None:
        raise ArgumentError(f"--ckpt-step {args.ckpt_step} needs --load or --pretrained-checkpoint")
    if iteration_of(root) is not None:
        raise ArgumentError(f"--ckpt-step {args.ckpt_step}: {root!r} is one checkpoint already; give its save root")
    published = published_iterations(root)
    if args.ckpt_step not in published:
        raise ArgumentError(f"--ckpt-step {args.ckpt_step}: {root!r} holds no published checkpoint of that "
                            f"iteration (published: {', '.join(map(str, published)) or 'none'})")


def _validate_device(args, cuda: bool) -> None:
    """The backend and implementation the device allows; on CPU ranks, GPU-only choices are refused."""
    if args.distributed_backend is None:
        args.distributed_backend = "nccl" if cuda else "gloo"
    if args.transformer_impl is None:
        args.transformer_impl = "transformer_engine" if (cuda and _te_importable()) else "local"
    if not cuda:
        # megatron-core's own classes train on CPU ranks (cpu_shim adapts its CUDA sites); what needs CUDA
        # streams or fp16 loss scaling on a GPU is refused here, before any work.
        for flag in ("overlap_grad_reduce", "overlap_param_gather"):
            if getattr(args, flag):
                raise ArgumentError(f"--{flag.replace('_', '-')} needs CUDA: megatron-core overlaps the "
                                    "communication on a CUDA stream")
        if args.transformer_impl == "transformer_engine":
            raise ArgumentError("--transformer-impl transformer_engine needs CUDA")
        if args.distributed_backend == "nccl":
            raise ArgumentError("--distributed-backend nccl needs CUDA")
        if args.empty_unused_memory_level:
            raise ArgumentError("--empty-unused-memory-level empties the CUDA caching allocator; CPU ranks have "
                                "none: drop it (or pass 0)")
        if args.recompute_granularity is not None:
            flag = ("--recompute-activations" if args.recompute_activations
                    else f"--recompute-granularity {args.recompute_granularity}")
            raise ArgumentError(f"{flag}: megatron-core's recompute saves and restores CUDA RNG states, which CPU "
                                "ranks do not have; drop it (it trades memory for time, the math is the same)")
        if args.profile and not args.use_pytorch_profiler:
            raise ArgumentError("--profile without --use-pytorch-profiler drives nsys through CUDA's profiler API; "
                                "on CPU ranks add --use-pytorch-profiler (torch.profiler traces)")
    if args.apply_layernorm_1p and args.transformer_impl != "transformer_engine":
        raise ArgumentError("--apply-layernorm-1p (a zero-centred norm gamma) needs Transformer Engine's norms; "
                            "megatron-core's torch norms (--transformer-impl local, CPU ranks) refuse it")
    if args.attention_backend in ("flash", "fused") and args.transformer_impl != "transformer_engine":
        raise ArgumentError(f"--attention-backend {args.attention_backend} is Transformer Engine's CUDA attention; "
                            "with --transformer-impl local (CPU ranks) use local, unfused or auto")
    if args.use_distributed_optimizer and args.ckpt_format == "torch":
        raise ArgumentError("--use-distributed-optimizer with --ckpt-format torch: the legacy format writes one file "
                            "per (TP, PP) rank from DP rank 0, but the distributed optimizer's state is sharded "
                            "across DP ranks; use --ckpt-format datastates or torch_dist")
    if args.sequence_parallel and args.tensor_model_parallel_size == 1:
        args.sequence_parallel = False

def _validate_implementation(args) -> None:
    """Implementation choices that are the same math: the positions table, recompute, gradients, profiling."""
    if not args.add_position_embedding and args.position_embedding_type == "learned_absolute":
        args.position_embedding_type = "none"  # upstream's reading of --no-position-embedding
    if args.context_parallel_size != 1:
        raise ArgumentError(f"--context-parallel-size {args.context_parallel_size}: context parallelism needs "
                            "Transformer Engine's attention, not built here; use 1 (data or tensor parallelism)")
    if args.grad_reduce_in_bf16 and args.accumulate_allreduce_grads_in_fp32:
        raise ArgumentError("--grad-reduce-in-bf16 and --accumulate-allreduce-grads-in-fp32 contradict: give one")
    if args.recompute_activations:
        args.recompute_granularity = "selective"
    if args.recompute_granularity == "full" and (args.recompute_method is None or args.recompute_num_layers is None):
        raise ArgumentError("--recompute-granularity full needs --recompute-method (uniform or block) and "
                            "--recompute-num-layers")
    if args.recompute_granularity != "full" and (args.recompute_method or args.recompute_num_layers):
        raise ArgumentError("--recompute-method and --recompute-num-layers apply to --recompute-granularity full")
    if args.manual_gc_interval < 0:
        raise ArgumentError(f"--manual-gc-interval must be >= 0, got {args.manual_gc_interval}")
    if args.profile and args.use_pytorch_profiler and not args.tensorboard_dir:
        raise ArgumentError("--profile --use-pytorch-profiler writes its traces to --tensorboard-dir: give one")
    if args.profile and not 0 <= args.profile_step_start < args.profile_step_end:
        raise ArgumentError(f"--profile-step-start {args.profile_step_start} must be >= 0 and before "
                            f"--profile-step-end {args.profile_step_end}")


def _read_data_args(args) -> None:
    """--data-args-path: the file holds --data-path's words; quotes a launch script left in --split go."""
    if args.data_args_path is not None:
        if args.data_path:
            raise ArgumentError("--data-args-path and --data-path both give the data: give one")
        try:
            with open(args.data_args_path) as f:
                args.data_path = f.read().split()
        except OSError as e:
            raise ArgumentError(f"--data-args-path {args.data_args_path!r}: {e.strerror}") from None
        if not args.data_path:
            raise ArgumentError(f"--data-args-path {args.data_args_path!r} is empty")
    if args.split is not None:
        args.split = args.split.strip("'\"")


def _validate_data(args) -> None:
    """Mock data or data paths (not both), --split only with --data-path, and the tokenizer's flags."""
    _read_data_args(args)
    if args.tokenizer_type is None:  # what upstream's GPT-3 script relies on: the BPE files name the tokenizer
        args.tokenizer_type = "GPT2BPETokenizer" if args.vocab_file and args.merge_file else "NullTokenizer"
    from .tokenizer import TokenizerArgumentError, check_tokenizer_args
    per_split = [p for p in (args.train_data_path, args.valid_data_path, args.test_data_path) if p]
    if args.data_path and per_split:
        raise ArgumentError("--data-path and --train/valid/test-data-path are exclusive: give one")
    if per_split and not args.train_data_path:
        raise ArgumentError("--valid-data-path/--test-data-path need --train-data-path (the data to train on)")
    if per_split and args.split is not None:
        raise ArgumentError("--split divides --data-path; with --train/valid/test-data-path each split has its "
                            "own data: drop --split")
    if args.mock_data and (args.data_path or per_split):
        raise ArgumentError("--mock-data and a data path are mutually exclusive")
    if not (args.data_path or per_split):
        args.mock_data = True  # megatron-core's MockGPTDataset: it caches under --data-cache-path, splits 1,1,1
        if args.vocab_size is None and args.tokenizer_type == "NullTokenizer":
            args.vocab_size = 128
    elif args.data_path and args.split is None:
        args.split = DEFAULT_SPLIT
    if args.num_workers < 0 or args.num_dataset_builder_threads < 1:
        raise ArgumentError("--num-workers must be >= 0 and --num-dataset-builder-threads >= 1")
    try:
        check_tokenizer_args(args)
    except TokenizerArgumentError as e:
        raise ArgumentError(str(e)) from None


def _require_package(value, flag: str, module: str, package: str) -> None:
    import importlib.util
    if value and importlib.util.find_spec(module) is None:
        raise ArgumentError(f"{flag} needs the {package!r} package, which is not installed: pip install {package}")


def _te_importable() -> bool:
    import importlib.util
    return importlib.util.find_spec("transformer_engine") is not None
