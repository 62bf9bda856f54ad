"""Megatron-LM compatible command line flags, plus the checkpoint flags (README.md, "Flags").

Only the flags this trainer honours are accepted; a Megatron-LM flag that would silently change nothing here is
rejected by argparse rather than ignored. `validate_args` checks the whole configuration against the world size
before any work starts (no model is built, no file is written) and raises `ArgumentError` with a clear message.
This module imports neither megatron-core nor torch.distributed, so it is cheap to use in tests.
"""
from __future__ import annotations

import argparse
import os

from .moe import add_moe_args, validate_moe
from .virtual_pipeline import add_virtual_pipeline_args, validate_virtual_pipeline


class ArgumentError(ValueError):
    """Inconsistent or unusable command line."""


CKPT_FORMATS = ("datastates", "torch_dist", "torch")
UPSTREAM_ONLY_FORMATS = ("torch_dcp", "fsdp_dtensor")  # refused with the reason
DEFAULT_SPLIT = "969, 30, 1"  # upstream's --split when --data-path is given


def _add_model_args(p):
    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int, default=None)
    g.add_argument("--hidden-size", type=int, default=None)
    g.add_argument("--ffn-hidden-size", type=int, default=None, help="default: 4 * hidden size")
    g.add_argument("--num-attention-heads", type=int, default=None)
    g.add_argument("--kv-channels", type=int, default=None)
    g.add_argument("--group-query-attention", action="store_true")
    g.add_argument("--num-query-groups", type=int, default=1)
    g.add_argument("--seq-length", type=int, default=None)
    g.add_argument("--max-position-embeddings", type=int, default=None)
    g.add_argument("--vocab-size", type=int, default=None,
                   help="NullTokenizer's vocabulary (pre-tokenized data); default 128 with --mock-data")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--position-embedding-type", choices=["learned_absolute", "rope", "none"],
                   default="learned_absolute")
    g.add_argument("--no-position-embedding", dest="add_position_embedding", action="store_false",
                   help="upstream's older spelling: no learned position table (--position-embedding-type none "
                        "unless rope)")
    g.add_argument("--rotary-percent", type=float, default=1.0)
    g.add_argument("--rotary-base", type=int, default=10000, help="the rotary embedding's base period")
    g.add_argument("--qk-layernorm", action="store_true", help="normalize queries and keys before attention")
    g.add_argument("--normalization", choices=["LayerNorm", "RMSNorm"], default="LayerNorm")
    g.add_argument("--norm-epsilon", type=float, default=1e-5)
    g.add_argument("--apply-layernorm-1p", action="store_true",
                   help="a zero-centred norm gamma (Transformer Engine's norms; not on CPU ranks)")
    g.add_argument("--swiglu", action="store_true")
    g.add_argument("--disable-bias-linear", action="store_true")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--fp16", action="store_true")
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--transformer-impl", choices=["local", "transformer_engine"], default=None,
                   help="default: transformer_engine when importable and CUDA is present, else local")


def _add_implementation_args(p):
    g = p.add_argument_group("implementation (the same math; see docs/from-megatron-lm.md for CPU ranks)")
    g.add_argument("--attention-backend", choices=["auto", "local", "unfused", "flash", "fused"], default="auto",
                   help="flash/fused need Transformer Engine on CUDA; CPU ranks run the local unfused attention")
    g.add_argument("--attention-softmax-in-fp32", action="store_true")
    for fusion in ("masked-softmax", "bias-gelu", "bias-swiglu", "bias-dropout", "rope", "gradient-accumulation"):
        g.add_argument(f"--no-{fusion}-fusion", action="store_true",
                       help="accepted: no fused kernel is turned on here, on any device")
    g.add_argument("--recompute-activations", action="store_true", help="selective recompute of core attention")
    g.add_argument("--recompute-granularity", choices=["full", "selective"], default=None)
    g.add_argument("--recompute-method", choices=["uniform", "block"], default=None)
    g.add_argument("--recompute-num-layers", type=int, default=None)
    g.add_argument("--recompute-modules", nargs="*", default=None)
    g.add_argument("--use-mcore-models", action="store_true",
                   help="accepted: the models are always megatron-core's (upstream ignores it too)")
    g.add_argument("--enable-experimental", action="store_true", help="megatron-core's experimental features")
    g.add_argument("--manual-gc", action="store_true",
                   help="Python's garbage collector off, run every --manual-gc-interval iterations")
    g.add_argument("--manual-gc-interval", type=int, default=0)
    g.add_argument("--empty-unused-memory-level", type=int, default=0, choices=[0, 1, 2],
                   help="empty the CUDA caching allocator after each step (1) and each forward-backward (2)")
    g.add_argument("--disable-bf16-reduced-precision-matmul", action="store_true",
                   help="no reduced-precision reductions in bf16 matmuls (a torch.backends.cuda setting)")


def _add_parallel_args(p):
    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--use-distributed-optimizer", action="store_true")
    g.add_argument("--overlap-grad-reduce", action="store_true")
    g.add_argument("--overlap-param-gather", action="store_true")
    g.add_argument("--distributed-backend", choices=["nccl", "gloo"], default=None,
                   help="default: nccl with CUDA, gloo without")
    g.add_argument("--distributed-timeout-minutes", type=int, default=10)
    g.add_argument("--context-parallel-size", type=int, default=1,
                   help="only 1: context parallelism needs Transformer Engine's attention")
    g.add_argument("--grad-reduce-in-bf16", action="store_true", help="reduce gradients in bf16 instead of fp32")
    g.add_argument("--accumulate-allreduce-grads-in-fp32", action="store_true",
                   help="accumulate and reduce gradients in fp32 (the default here, as upstream's with --bf16)")


def _add_training_args(p):
    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=None)
    g.add_argument("--global-batch-size", type=int, default=None)
    g.add_argument("--train-iters", type=int, default=None, help="iteration-based run (or --train-samples)")
    g.add_argument("--train-samples", type=int, default=None,
                   help="sample-based run: train on this many samples (LR schedule in samples)")
    g.add_argument("--rampup-batch-size", nargs="*", default=None, metavar="START INCREMENT SAMPLES",
                   help="with --train-samples: start at START, grow by INCREMENT up to --global-batch-size "
                        "over SAMPLES samples (megatron-core's num-microbatches calculator)")
    g.add_argument("--exit-interval", type=int, default=None,
                   help="exit (after saving when --save is set) once the iteration is a multiple of this")
    g.add_argument("--lr", type=float, default=None)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--decoupled-lr", type=float, default=None,
                   help="the embedding and output layer's own peak learning rate (default --lr)")
    g.add_argument("--decoupled-min-lr", type=float, default=None,
                   help="the embedding and output layer's own minimum learning rate (default --min-lr)")
    g.add_argument("--lr-decay-style", choices=["constant", "linear", "cosine", "inverse-square-root"],
                   default="linear")
    g.add_argument("--lr-decay-iters", type=int, default=None, help="default --train-iters")
    g.add_argument("--lr-decay-samples", type=int, default=None, help="default --train-samples")
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-warmup-samples", type=int, default=0)
    g.add_argument("--lr-warmup-fraction", type=float, default=None,
                   help="warmup as a fraction of the decay length (instead of --lr-warmup-iters/-samples)")
    g.add_argument("--lr-warmup-init", type=float, default=0.0)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--log-interval", type=int, default=1)
    g.add_argument("--calculate-per-token-loss", action="store_true",
                   help="the loss over the global batch's unmasked tokens rather than a mean of micro-batch means")
    g.add_argument("--no-check-for-nan-in-loss-and-grad", dest="check_for_nan_in_loss_and_grad",
                   action="store_false")
    g.add_argument("--log-all-ranks", action="store_true",
                   help="every rank logs its INFO lines (default: rank 0 only; warnings and errors always)")
    g.add_argument("--exit-duration-in-mins", type=float, default=None,
                   help="stop (after saving when --save is set) once the run is older than this")
    g.add_argument("--exit-signal-handler", action="store_true",
                   help="on SIGTERM, finish the iteration, save, wait until the checkpoint is published, exit 0")
    g.add_argument("--eval-iters", type=int, default=0,
                   help="iterations of validation data per evaluation [0: no evaluation; upstream's default is 100]")
    g.add_argument("--eval-interval", type=int, default=1000, help="evaluate every this many iterations")


def _add_logging_args(p):
    g = p.add_argument_group("logging")
    g.add_argument("--tensorboard-dir", type=str, default=None, help="write TensorBoard event files here")
    g.add_argument("--tensorboard-log-interval", type=int, default=1)
    g.add_argument("--tensorboard-queue-size", type=int, default=1000,
                   help="scalars TensorBoard's writer queues before it writes them out")
    g.add_argument("--log-validation-ppl-to-tensorboard", action="store_true")
    g.add_argument("--log-throughput", action="store_true", help="model TFLOP/s per rank in each log line")
    g.add_argument("--log-params-norm", action="store_true")
    g.add_argument("--log-num-zeros-in-grad", action="store_true")
    g.add_argument("--log-timers-to-tensorboard", action="store_true",
                   help="forward-backward, checkpoint wait and optimizer times of each iteration")
    g.add_argument("--log-memory-to-tensorboard", action="store_true",
                   help="CUDA allocator statistics; host resident memory on CPU ranks")
    g.add_argument("--logging-level", type=int, default=None, help="Python logging level [INFO = 20]")
    g.add_argument("--profile", action="store_true", help="profile --profile-step-start..end (needs "
                   "--use-pytorch-profiler on CPU ranks: nsys's CUDA profiler API is CUDA's)")
    g.add_argument("--use-pytorch-profiler", action="store_true",
                   help="torch.profiler traces into --tensorboard-dir")
    g.add_argument("--profile-step-start", type=int, default=10)
    g.add_argument("--profile-step-end", type=int, default=12)
    g.add_argument("--profile-ranks", nargs="+", type=int, default=[0])
    g.add_argument("--wandb-project", type=str, default=None,
                   help="log to Weights & Biases (offline unless WANDB_MODE or WANDB_API_KEY say otherwise)")
    g.add_argument("--wandb-exp-name", type=str, default=None)
    g.add_argument("--wandb-save-dir", type=str, default=None, help="the W&B run directory [--save/wandb]")


def _add_data_args(p):
    from .tokenizer import TOKENIZER_TYPES
    g = p.add_argument_group("data")
    g.add_argument("--mock-data", action="store_true",
                   help="megatron-core's MockGPTDataset, as upstream (the default when no data path is given)")
    g.add_argument("--data-path", nargs="*", default=None,
                   help="a megatron indexed data set prefix (<prefix>.bin/.idx), or a blend: WEIGHT PREFIX ...")
    g.add_argument("--split", type=str, default=None,
                   help="train,valid,test proportions of the documents of --data-path [969, 30, 1]")
    for split in ("train", "valid", "test"):
        g.add_argument(f"--{split}-data-path", nargs="*", default=None,
                       help=f"the {split} split's own prefix or blend (instead of --data-path and --split)")
    g.add_argument("--data-cache-path", type=str, default=None,
                   help="where the data sets' index caches go [a cache/ directory beside each data set]")
    g.add_argument("--num-dataset-builder-threads", type=int, default=1)
    g.add_argument("--no-mmap-bin-files", dest="mmap_bin_files", action="store_false",
                   help="read the .bin files with reads instead of mmap")
    g.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES, default=None,
                   help="default: GPT2BPETokenizer with --vocab-file and --merge-file, else NullTokenizer")
    g.add_argument("--vocab-file", type=str, default=None, help="GPT2BPETokenizer's vocab.json")
    g.add_argument("--merge-file", type=str, default=None, help="GPT2BPETokenizer's merges.txt")
    g.add_argument("--tokenizer-model", type=str, default=None,
                   help="a SentencePiece model file, or a local HuggingFace tokenizer directory")
    g.add_argument("--num-workers", type=int, default=0, help="data loader worker processes per rank")
    g.add_argument("--data-args-path", type=str, default=None,
                   help="a file holding --data-path's value (a prefix, or WEIGHT PREFIX pairs)")
    g.add_argument("--no-create-attention-mask-in-dataloader", dest="create_attention_mask_in_dataloader",
                   action="store_false", help="the model builds the causal mask itself")
    g.add_argument("--tiktoken-pattern", type=str, default=None,
                   help="accepted as upstream: it applies to TikTokenizer only, which is not built here")
    g.add_argument("--legacy-tokenizer", action="store_true",
                   help="accepted: the tokenizers built here are upstream's legacy ones")
    g.add_argument("--eod-mask-loss", action="store_true", help="no loss on end-of-document tokens")
    g.add_argument("--reset-position-ids", action="store_true", help="positions restart after each end of document")
    g.add_argument("--reset-attention-mask", action="store_true",
                   help="tokens attend within their own document only (a mask per sample)")


def _add_checkpoint_args(p):
    g = p.add_argument_group("checkpointing")
    g.add_argument("--save", type=str, default=None)
    g.add_argument("--load", type=str, default=None)
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--ckpt-format", choices=CKPT_FORMATS + UPSTREAM_ONLY_FORMATS, default="datastates")
    g.add_argument("--async-ckpt", "--async-save", dest="async_ckpt", action="store_true",
                   help="lazy asynchronous save (datastates); without it the save is synchronous")
    g.add_argument("--ckpt-host-buffer-gb", type=float, default=4.0)
    g.add_argument("--ckpt-writer-threads", type=int, default=4)
    g.add_argument("--ckpt-read-mode", choices=["stream", "parallel"], default="stream",
                   help="a resume reads each data file as one buffered stream, or with O_DIRECT reads in flight")
    g.add_argument("--ckpt-read-threads", type=int, default=None,
                   help="native read threads per rank [the engine's DEFAULT_READ_THREADS, 8]")
    g.add_argument("--ckpt-keep-last", type=str, default="all", help="number of checkpoints to keep, or 'all'")
    g.add_argument("--ckpt-fsync", dest="ckpt_fsync", action="store_true", default=True)
    g.add_argument("--no-ckpt-fsync", dest="ckpt_fsync", action="store_false")
    g.add_argument("--ckpt-direct-io", choices=["auto", "on", "off"], default="auto")
    g.add_argument("--ckpt-publish-timeout-s", type=float, default=600.0,
                   help="how long rank 0 waits for every rank's part of a checkpoint before failing the save")
    g.add_argument("--ckpt-on-failure", choices=["stop", "warn"], default="stop",
                   help="a failed save stops training (default) or is logged as a warning while training goes on; "
                        "either way the last published checkpoint stays intact")
    g.add_argument("--no-save-optim", action="store_true")
    g.add_argument("--no-save-rng", action="store_true")
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--no-load-rng", action="store_true")
    g.add_argument("--finetune", action="store_true",
                   help="load model weights only and start at iteration 0")
    g.add_argument("--exit-on-missing-checkpoint", action="store_true")
    g.add_argument("--save-after-load", action="store_true",
                   help="right after --load, save the loaded state at the loaded iteration to --save (another "
                        "directory), in this run's TP/PP/DP layout; with --train-iters equal to that iteration "
                        "this converts a checkpoint to a new layout and exits")
    g.add_argument("--use-dist-ckpt", action="store_true", help="accepted for compatibility")
    g.add_argument("--ckpt-fully-parallel-save", dest="ckpt_fully_parallel_save", action="store_true",
                   default=True, help="spread replicated state over the DP ranks (always, with datastates)")
    g.add_argument("--no-ckpt-fully-parallel-save", dest="ckpt_fully_parallel_save", action="store_false",
                   help="torch_dist only: DP rank 0 writes the replicated state")
    g.add_argument("--ckpt-fully-parallel-load", action="store_true",
                   help="torch_dist: megatron-core's fully parallel load (datastates ranks always read in parallel)")
    g.add_argument("--ckpt-assume-constant-structure", action="store_true",
                   help="torch_dist: reuse the save plan (datastates always reuses it while the structure holds)")
    g.add_argument("--auto-detect-ckpt-format", action="store_true",
                   help="accepted: a load always detects the checkpoint's format")
    g.add_argument("--dist-ckpt-strictness", default="assume_ok_unexpected",
                   choices=["assume_ok_unexpected", "log_unexpected", "log_all", "raise_unexpected", "raise_all",
                            "return_unexpected", "return_all", "ignore_all"],
                   help="what a load does with checkpoint entries the model lacks; a missing entry always fails")
    g.add_argument("--use-checkpoint-args", action="store_true",
                   help="take the model's architecture flags the command line leaves unset from the checkpoint "
                        "under --load")
    g.add_argument("--dist-ckpt-optim-fully-reshardable", action="store_true",
                   help="save the distributed optimizer's state in megatron-core's fully_reshardable layout "
                        "(model-shaped, loads into any TP/PP/DP layout) instead of dp_reshardable (its flat "
                        "bucket shards, which reshard across DP sizes only)")
    g = p.add_argument_group("memory tier (node-local checkpoints)")
    g.add_argument("--non-persistent-save-interval", type=int, default=None,
                   help="every K iterations, a lazy checkpoint of each rank's part to node-local memory (the newest "
                        "2 kept); --save-interval keeps writing to storage")
    g.add_argument("--non-persistent-ckpt-type", choices=["local", "global", "in_memory"], default="local",
                   help="only 'local' (node-local memory) is built here")
    g.add_argument("--non-persistent-local-ckpt-dir", type=str, default="/dev/shm/datastates",
                   help="where the memory tier lives; a directory per job is made under it")
    g.add_argument("--replication", action="store_true",
                   help="send each rank's memory-tier part to peers on other nodes (--replication-factor - 1)")
    g.add_argument("--replication-factor", type=int, default=2)
    g.add_argument("--replication-jump", type=int, default=None,
                   help="rank distance between the copies of a part (default: the ranks per node)")


def build_parser(extra_args_provider=None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Megatron-style GPT pretraining with lazy asynchronous checkpoints",
                                allow_abbrev=False)
    _add_model_args(p)
    _add_implementation_args(p)
    _add_parallel_args(p)
    _add_training_args(p)
    _add_data_args(p)
    _add_logging_args(p)
    _add_checkpoint_args(p)
    add_moe_args(p)
    add_virtual_pipeline_args(p)
    if extra_args_provider is not None:
        p = extra_args_provider(p)
    return p


def parse_args(extra_args_provider=None, argv=None) -> argparse.Namespace:
    """Parse the flags (sys.argv[1:] when argv is None). Use validate_args once the world size is known.

    An upstream flag this trainer refuses raises ArgumentError with the reason (all of them at once); a flag
    upstream does not know either is argparse's error."""
    from .flag_policy import refusals
    parser = build_parser(extra_args_provider)
    args, unknown = parser.parse_known_args(argv)
    messages, unrecognized = refusals(unknown)
    if messages:
        extra = f"\n  unrecognized: {' '.join(unrecognized)}" if unrecognized else ""
        raise ArgumentError("Megatron-LM flags this trainer does not support:\n  " + "\n  ".join(messages) + extra)
    if unrecognized:
        parser.error("unrecognized arguments: " + " ".join(unrecognized))
    return args


def _require(args, *names):
    missing = [n for n in names if getattr(args, n.replace("-", "_")) is None]
    if missing:
        raise ArgumentError("missing required flag(s): " + ", ".join("--" + n for n in missing))


def _loadable(path: str) -> tuple[bool, str]:
    """Whether --load points at something this trainer can load, and why not."""
    if not os.path.isdir(path):
        return False, f"--load {path!r} does not exist or is not a directory"
    from datastates import CheckpointError, commit  # the one reader of the tracker; only when --load is given
    try:
        latest = commit.find_latest(path)
    except CheckpointError as e:  # an unreadable tracker
        return False, f"--load {path!r}: {e}"
    return latest.path is not None, f"--load {path!r}: {latest.why_none()}"


def validate_args(args, world_size: int, *, cuda: bool | None = None) -> argparse.Namespace:
    """Check the configuration against the world size and fill derived values. Raises ArgumentError."""
    if cuda is None:
        import torch
        cuda = torch.cuda.is_available()
    args.world_size = world_size
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
    dp, mbs = args.data_parallel_size, args.micro_batch_size
    if args.global_batch_size is None:
        args.global_batch_size = mbs * dp
    if args.global_batch_size % (mbs * dp) != 0:
        raise ArgumentError(f"--global-batch-size {args.global_batch_size} is not divisible by micro-batch-size "
                            f"{mbs} x data-parallel size {dp} = {mbs * dp}")
    args.num_microbatches = args.global_batch_size // (mbs * dp)
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
    _validate_implementation(args)
    _validate_data(args)
    # Checkpointing.
    if args.ckpt_format in UPSTREAM_ONLY_FORMATS:
        raise ArgumentError(f"--ckpt-format {args.ckpt_format}: upstream's {args.ckpt_format} format is not built "
                            f"here; formats: {', '.join(CKPT_FORMATS)} (tools/convert_checkpoint.py converts "
                            "torch_dist checkpoints)")
    if args.save_interval is not None and args.save_interval <= 0:
        raise ArgumentError(f"--save-interval must be positive, got {args.save_interval}")
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
    if args.ckpt_host_buffer_gb <= 0 or args.ckpt_writer_threads <= 0 or \
            (args.ckpt_read_threads is not None and args.ckpt_read_threads <= 0):
        raise ArgumentError("--ckpt-host-buffer-gb, --ckpt-writer-threads and --ckpt-read-threads must be positive")
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
        jump = args.replication_jump or 1
        if jump <= 0 or world_size % (args.replication_factor * jump):
            raise ArgumentError(f"--replication-factor {args.replication_factor} x --replication-jump "
                                f"{args.replication_jump} must divide the world size {world_size}")
    if args.save_after_load:
        if args.save is None or args.load is None:
            raise ArgumentError("--save-after-load needs both --load and --save")
        if os.path.normpath(args.save) == os.path.normpath(args.load):
            raise ArgumentError("--save-after-load: --save must be another directory than --load (the loaded "
                                "iteration is saved again)")
    if args.load is not None:
        ok, why = _loadable(args.load)
        fresh = (os.path.normpath(args.load) == os.path.normpath(args.save or "")
                 and not os.path.exists(os.path.join(args.load, "latest_checkpointed_iteration.txt")))
        if not ok and (args.exit_on_missing_checkpoint or not fresh):
            # Megatron starts from scratch when --load equals --save and nothing was saved there yet (the usual
            # "resume if possible" launch); anything else that points at nothing loadable is an error.
            raise ArgumentError(why)
        args.load_exists = ok
    else:
        args.load_exists = False
    # Device specific.
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
    if args.sequence_parallel and tp == 1:
        args.sequence_parallel = False
    try:
        validate_moe(args, world_size, cuda)
        validate_virtual_pipeline(args)
    except ValueError as e:
        raise ArgumentError(str(e)) from None
    return args


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
