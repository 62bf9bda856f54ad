"""Megatron-LM compatible command line flags, plus the checkpoint flags (README.md, "Flags").

Every upstream flag is honoured or refused with its reason (`refused_flags`), never accepted and ignored;
`argument_checks.validate_args` then checks the whole configuration against the world size before any work starts.
This module imports neither megatron-core nor torch.distributed, so it is cheap to use in tests.
"""
from __future__ import annotations

import argparse
import sys

from datastates import AUTO_CODEC, CODEC_SETTINGS

from . import megatron_fsdp
from .latent_attention import add_mla_args
from .moe import add_moe_args
from .multi_token import add_mtp_args
from .virtual_pipeline import add_virtual_pipeline_args


class ArgumentError(ValueError):
    """Inconsistent or unusable command line."""


CKPT_FORMATS = ("datastates", "torch_dist", "torch")
UPSTREAM_ONLY_FORMATS = ("torch_dcp", "fsdp_dtensor")  # refused with the reason
DEFAULT_SPLIT = "969, 30, 1"  # upstream's --split when --data-path is given


def _add_model_args(p):
    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int, default=None,
                   help="transformer layers of the model")
    g.add_argument("--hidden-size", type=int, default=None,
                   help="the model's hidden size")
    g.add_argument("--ffn-hidden-size", type=int, default=None, help="default: 4 * hidden size")
    g.add_argument("--num-attention-heads", type=int, default=None,
                   help="attention heads per layer")
    g.add_argument("--kv-channels", type=int, default=None,
                   help="the projection size per attention head [hidden size / heads]")
    g.add_argument("--group-query-attention", action="store_true",
                   help="grouped-query attention, with --num-query-groups key/value heads")
    g.add_argument("--num-query-groups", type=int, default=1,
                   help="key/value head groups with --group-query-attention")
    g.add_argument("--seq-length", type=int, default=None,
                   help="tokens per sample")
    g.add_argument("--max-position-embeddings", type=int, default=None,
                   help="rows of the learned position table [--seq-length]")
    g.add_argument("--vocab-size", type=int, default=None,
                   help="NullTokenizer's vocabulary (pre-tokenized data); default 128 with --mock-data")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                   help="pad the vocabulary to a multiple of this (times TP), as upstream")
    g.add_argument("--position-embedding-type", choices=["learned_absolute", "rope", "none"],
                   default="learned_absolute",
                   help="learned absolute positions, rotary embeddings, or none")
    g.add_argument("--no-position-embedding", dest="add_position_embedding", action="store_false",
                   help="upstream's older spelling: no learned position table (--position-embedding-type none "
                        "unless rope)")
    g.add_argument("--rotary-percent", type=float, default=1.0,
                   help="the share of each head's dimensions that the rotary embedding rotates")
    g.add_argument("--rotary-base", type=int, default=10000, help="the rotary embedding's base period")
    g.add_argument("--qk-layernorm", action="store_true", help="normalize queries and keys before attention")
    g.add_argument("--normalization", choices=["LayerNorm", "RMSNorm"], default="LayerNorm",
                   help="the layers' normalization")
    g.add_argument("--norm-epsilon", type=float, default=1e-5,
                   help="the normalization's epsilon")
    g.add_argument("--apply-layernorm-1p", action="store_true",
                   help="a zero-centred norm gamma (Transformer Engine's norms; not on CPU ranks)")
    g.add_argument("--swiglu", action="store_true",
                   help="SwiGLU MLPs (a gated linear unit with SiLU) instead of GeLU")
    g.add_argument("--disable-bias-linear", action="store_true",
                   help="no biases in the linear layers")
    g.add_argument("--add-qkv-bias", action="store_true",
                   help="biases on the query/key/value projections even with --disable-bias-linear (Qwen2)")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true",
                   help="an output layer of its own instead of the word embedding's weights")
    g.add_argument("--hidden-dropout", type=float, default=0.1,
                   help="dropout after the attention and MLP blocks")
    g.add_argument("--attention-dropout", type=float, default=0.1,
                   help="dropout of the attention probabilities")
    g.add_argument("--init-method-std", type=float, default=0.02,
                   help="standard deviation of the normal initialization of the weights")
    g.add_argument("--no-initialization", dest="perform_initialization", action="store_false",
                   help="skip the weights' random initialization (they come from --load); megatron-core's "
                        "perform_initialization=False")
    g.add_argument("--fp16", action="store_true",
                   help="fp16 parameters with dynamic loss scaling (fp32 main params in the optimizer)")
    g.add_argument("--bf16", action="store_true",
                   help="bf16 parameters (fp32 main params in the optimizer)")
    g.add_argument("--transformer-impl", choices=["local", "transformer_engine"], default=None,
                   help="default: transformer_engine when importable and CUDA is present, else local")


def _add_implementation_args(p):
    g = p.add_argument_group("implementation (the same math; see docs/from-megatron-lm.md for CPU ranks)")
    g.add_argument("--attention-backend", choices=["auto", "local", "unfused", "flash", "fused"], default="auto",
                   help="flash/fused need Transformer Engine on CUDA; CPU ranks run the local unfused attention")
    g.add_argument("--attention-softmax-in-fp32", action="store_true",
                   help="compute the attention softmax in fp32")
    for fusion in ("masked-softmax", "bias-gelu", "bias-swiglu", "bias-dropout", "rope", "gradient-accumulation"):
        g.add_argument(f"--no-{fusion}-fusion", action="store_true",
                       help="accepted: no fused kernel is turned on here, on any device")
    g.add_argument("--recompute-activations", action="store_true", help="selective recompute of core attention")
    g.add_argument("--recompute-granularity", choices=["full", "selective"], default=None,
                   help="megatron-core's activation recompute (CUDA ranks only: it restores CUDA RNG states)")
    g.add_argument("--recompute-method", choices=["uniform", "block"], default=None,
                   help="with --recompute-granularity full: which layers recompute")
    g.add_argument("--recompute-num-layers", type=int, default=None,
                   help="with --recompute-granularity full: layers per recompute unit")
    g.add_argument("--recompute-modules", nargs="*", default=None,
                   help="with --recompute-granularity selective: the modules recomputed [megatron-core's]")
    g.add_argument("--use-mcore-models", action="store_true",
                   help="accepted: the models are always megatron-core's (upstream ignores it too)")
    g.add_argument("--enable-experimental", action="store_true", help="megatron-core's experimental features")
    g.add_argument("--manual-gc", action="store_true",
                   help="Python's garbage collector off, run every --manual-gc-interval iterations")
    g.add_argument("--manual-gc-interval", type=int, default=0,
                   help="run Python's garbage collector every N iterations, with automatic collection off (0: "
                        "automatic)")
    g.add_argument("--empty-unused-memory-level", type=int, default=0, choices=[0, 1, 2],
                   help="empty the CUDA caching allocator after each step (1) and each forward-backward (2)")
    g.add_argument("--disable-bf16-reduced-precision-matmul", action="store_true",
                   help="no reduced-precision reductions in bf16 matmuls (a torch.backends.cuda setting)")
    g.add_argument("--deterministic-mode", action="store_true",
                   help="deterministic kernels where torch has them (torch.use_deterministic_algorithms; an op "
                        "without one warns, naming it), cuBLAS's fixed workspace, megatron-core's deterministic_mode")


def _add_parallel_args(p):
    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1,
                   help="tensor-parallel size (TP)")
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1,
                   help="pipeline-parallel size (PP)")
    g.add_argument("--sequence-parallel", action="store_true",
                   help="sequence parallelism inside each tensor-parallel group")
    g.add_argument("--use-distributed-optimizer", action="store_true",
                   help="megatron-core's DistributedOptimizer (ZeRO-1: optimizer state sharded over DP)")
    g.add_argument("--use-torch-fsdp2", action="store_true",
                   help="fully sharded data parallelism: megatron-core's TorchFullyShardedDataParallel (torch's "
                        "fully_shard over the DP group), parameters, gradients and Adam's moments sharded as "
                        "DTensors; not with pipeline or expert parallelism or --use-distributed-optimizer "
                        "(docs/fsdp.md)")
    g.add_argument("--torch-fsdp2-no-reshard-after-forward", action="store_false",
                   dest="torch_fsdp2_reshard_after_forward",
                   help="keep each FSDP2 module's gathered parameters from the forward to the backward pass "
                        "(more memory, one all-gather fewer per module)")
    megatron_fsdp.add_arguments(g)
    g.add_argument("--overlap-grad-reduce", action="store_true",
                   help="overlap the gradient reduction with the backward pass (CUDA streams; refused on CPU ranks)")
    g.add_argument("--overlap-param-gather", action="store_true",
                   help="overlap the distributed optimizer's parameter all-gather with the forward pass (CUDA "
                        "streams; refused on CPU ranks)")
    g.add_argument("--distributed-backend", choices=["nccl", "gloo"], default=None,
                   help="default: nccl with CUDA, gloo without")
    g.add_argument("--distributed-timeout-minutes", type=float, default=10,
                   help="how long a collective waits for the other ranks; past it the rank fails naming its stage, "
                        "and torchrun restarts the job (docs/restarts.md)")
    g.add_argument("--context-parallel-size", type=int, default=1,
                   help="only 1: context parallelism needs Transformer Engine's attention")
    g.add_argument("--grad-reduce-in-bf16", action="store_true", help="reduce gradients in bf16 instead of fp32")
    g.add_argument("--accumulate-allreduce-grads-in-fp32", action="store_true",
                   help="accumulate and reduce gradients in fp32 (the default here, as upstream's with --bf16)")


def _add_training_args(p):
    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=None,
                   help="samples per micro-batch per rank")
    g.add_argument("--global-batch-size", type=int, default=None,
                   help="samples per iteration over all data-parallel ranks [micro-batch size x DP]")
    g.add_argument("--train-iters", type=int, default=None, help="iteration-based run (or --train-samples)")
    g.add_argument("--train-samples", type=int, default=None,
                   help="sample-based run: train on this many samples (LR schedule in samples)")
    g.add_argument("--rampup-batch-size", nargs="*", default=None, metavar="START INCREMENT SAMPLES",
                   help="with --train-samples: start at START, grow by INCREMENT up to --global-batch-size "
                        "over SAMPLES samples (megatron-core's num-microbatches calculator)")
    g.add_argument("--step-batch-size-schedule", type=str, default=None, metavar='"THRESHOLD:BATCH ..."',
                   help="the global batch size from each threshold of consumed tokens on (K/M/B/T suffixes: "
                        "1e3/1e6/1e9/1e12), e.g. \"0:16 2.4B:320\"; the first threshold is 0, the last batch size is "
                        "--global-batch-size (upstream's step schedule)")
    g.add_argument("--exit-interval", type=int, default=None,
                   help="exit (after saving when --save is set) once the iteration is a multiple of this")
    g.add_argument("--lr", type=float, default=None,
                   help="the peak learning rate")
    g.add_argument("--min-lr", type=float, default=0.0,
                   help="the learning rate at the end of the decay")
    g.add_argument("--decoupled-lr", type=float, default=None,
                   help="the embedding and output layer's own peak learning rate (default --lr)")
    g.add_argument("--decoupled-min-lr", type=float, default=None,
                   help="the embedding and output layer's own minimum learning rate (default --min-lr)")
    g.add_argument("--lr-decay-style", choices=["constant", "linear", "cosine", "inverse-square-root"],
                   default="linear",
                   help="the learning rate's decay after warm-up")
    g.add_argument("--lr-decay-iters", type=int, default=None, help="default --train-iters")
    g.add_argument("--lr-decay-samples", type=int, default=None, help="default --train-samples")
    g.add_argument("--lr-warmup-iters", type=int, default=0,
                   help="iterations of linear warm-up")
    g.add_argument("--lr-warmup-samples", type=int, default=0,
                   help="samples of linear warm-up (sample-based schedules)")
    g.add_argument("--lr-warmup-fraction", type=float, default=None,
                   help="warmup as a fraction of the decay length (instead of --lr-warmup-iters/-samples)")
    g.add_argument("--lr-warmup-init", type=float, default=0.0,
                   help="the learning rate warm-up starts from")
    g.add_argument("--weight-decay", type=float, default=0.01,
                   help="AdamW's weight decay")
    g.add_argument("--adam-beta1", type=float, default=0.9,
                   help="Adam's beta1")
    g.add_argument("--adam-beta2", type=float, default=0.999,
                   help="Adam's beta2")
    g.add_argument("--adam-eps", type=float, default=1e-8,
                   help="Adam's epsilon")
    g.add_argument("--clip-grad", type=float, default=1.0,
                   help="clip the global gradient norm to this (0: no clipping)")
    g.add_argument("--seed", type=int, default=1234,
                   help="the random seed (each rank's RNGs derive from it)")
    g.add_argument("--log-interval", type=int, default=1,
                   help="print the training line every N iterations")
    g.add_argument("--calculate-per-token-loss", action="store_true",
                   help="the loss over the global batch's unmasked tokens rather than a mean of micro-batch means")
    g.add_argument("--no-check-for-nan-in-loss-and-grad", dest="check_for_nan_in_loss_and_grad",
                   action="store_false",
                   help="do not stop on a NaN loss or gradient")
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
    g.add_argument("--tensorboard-log-interval", type=int, default=1,
                   help="write the training scalars every N iterations")
    g.add_argument("--tensorboard-queue-size", type=int, default=1000,
                   help="scalars TensorBoard's writer queues before it writes them out")
    g.add_argument("--log-validation-ppl-to-tensorboard", action="store_true",
                   help="also write the validation perplexity")
    g.add_argument("--log-throughput", action="store_true", help="model TFLOP/s per rank in each log line")
    g.add_argument("--log-params-norm", action="store_true",
                   help="log the parameters' norm")
    g.add_argument("--log-num-zeros-in-grad", action="store_true",
                   help="log the number of zeros in the gradients")
    g.add_argument("--log-timers-to-tensorboard", action="store_true",
                   help="forward-backward, checkpoint wait and optimizer times of each iteration")
    g.add_argument("--log-memory-to-tensorboard", action="store_true",
                   help="CUDA allocator statistics; host resident memory on CPU ranks")
    g.add_argument("--logging-level", type=int, default=None, help="Python logging level [INFO = 20]")
    g.add_argument("--profile", action="store_true", help="profile --profile-step-start..end (needs "
                   "--use-pytorch-profiler on CPU ranks: nsys's CUDA profiler API is CUDA's)")
    g.add_argument("--use-pytorch-profiler", action="store_true",
                   help="torch.profiler traces into --tensorboard-dir")
    g.add_argument("--profile-step-start", type=int, default=10,
                   help="the first profiled iteration")
    g.add_argument("--profile-step-end", type=int, default=12,
                   help="the iteration the profile stops before")
    g.add_argument("--profile-ranks", nargs="+", type=int, default=[0],
                   help="the ranks profiled")
    g.add_argument("--wandb-project", type=str, default=None,
                   help="log to Weights & Biases (offline unless WANDB_MODE or WANDB_API_KEY say otherwise)")
    g.add_argument("--wandb-exp-name", type=str, default=None,
                   help="the W&B run's name")
    g.add_argument("--wandb-save-dir", type=str, default=None,
                   help="the W&B run directory [--save/wandb, or ./wandb when --save is unset or a URL]")


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
    g.add_argument("--num-dataset-builder-threads", type=int, default=1,
                   help="threads building the data sets' indexes")
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
    g.add_argument("--save", type=str, default=None,
                   help="where checkpoints are saved: a directory, s3://bucket/prefix or msc://profile/prefix")
    g.add_argument("--load", type=str, default=None,
                   help="the save root (or one iter_XXXXXXX directory) to resume from; a run with nothing there "
                        "yet starts fresh when --load is --save")
    g.add_argument("--save-interval", "--persistent-save-interval", type=int, default=None,
                   help="save a checkpoint to --save every K iterations (and at the end of the run)")
    g.add_argument("--ckpt-format", choices=CKPT_FORMATS + UPSTREAM_ONLY_FORMATS, default="datastates",
                   metavar="{" + ",".join(CKPT_FORMATS) + "}",  # upstream's other formats: refused with the reason
                   help="how new checkpoints are saved: this engine, megatron-core's torch_dist, or torch.save; a "
                        "load detects the format")
    g.add_argument("--async-ckpt", "--async-save", dest="async_ckpt", action="store_true",
                   help="lazy asynchronous save (datastates); without it the save is synchronous")
    g.add_argument("--ckpt-host-buffer-gb", type=float, default=None,
                   help="cap, in GiB, on each rank's host staging [unset: all that the rank saves, within half of the "
                        "node's available memory over its ranks; docs/sizing.md]")
    g.add_argument("--ckpt-writer-threads", type=int, default=4,
                   help="native writer threads per rank")
    g.add_argument("--ckpt-read-mode", choices=["stream", "parallel"], default="stream",
                   help="a resume reads each data file as one buffered stream, or with O_DIRECT reads in flight")
    g.add_argument("--ckpt-read-threads", type=int, default=None,
                   help="native read threads per rank [the engine's DEFAULT_READ_THREADS, 8]")
    g.add_argument("--ckpt-compress", choices=CODEC_SETTINGS, default="off",
                   help="lossless compression of the saved tensor chunks, on encoder threads behind the snapshot "
                        "(docs/compression.md): "
                        f"off, auto (object stores: {AUTO_CODEC}; file systems and the memory tier: off), or a "
                        "codec (off by default: no storage measured was durable sooner with it)")
    g.add_argument("--ckpt-keep-last", type=str, default="all", help="number of checkpoints to keep, or 'all'")
    g.add_argument("--ckpt-fsync", dest="ckpt_fsync", action="store_true", default=True,
                   help="fsync the data, manifests and directories of each checkpoint (the default)")
    g.add_argument("--no-ckpt-fsync", dest="ckpt_fsync", action="store_false",
                   help="do not fsync: a checkpoint is published before it is durable")
    g.add_argument("--ckpt-direct-io", choices=["auto", "on", "off"], default="auto",
                   help="O_DIRECT writes where the file system accepts them (auto), always (on, an error where "
                        "refused), or never")
    g.add_argument("--ckpt-publish-timeout-s", type=float, default=600.0,
                   help="how long rank 0 waits for every rank's part of a checkpoint before failing the save")
    g.add_argument("--ckpt-on-failure", choices=["stop", "warn"], default="stop",
                   help="a failed save stops training (default) or is logged as a warning while training goes on; "
                        "either way the last published checkpoint stays intact")
    g.add_argument("--save-hf", type=str, default=None, metavar="DIR",
                   help="also publish checkpoints as transformers models under DIR (iter_XXXXXXX/, and `latest` "
                        "naming the newest complete one), exported from each published checkpoint behind "
                        "training (docs/huggingface.md)")
    g.add_argument("--save-hf-interval", type=int, default=None, metavar="N",
                   help="--save-hf: export every N iterations, a multiple of --save-interval [--save-interval]; the "
                        "last checkpoint of the run is always exported")
    g.add_argument("--save-hf-tokenizer", type=str, default=None, metavar="DIR",
                   help="--save-hf: copy this transformers tokenizer's files into each model [the run's "
                        "--tokenizer-model with HuggingFaceTokenizer]")
    g.add_argument("--save-hf-keep-last", type=int, default=None, metavar="K",
                   help="--save-hf: keep the newest K models [all]")
    g.add_argument("--save-hf-max-shard-size", type=int, default=2 << 30, metavar="BYTES",
                   help="--save-hf: safetensors files of at most BYTES, as the conversion tool's --max-shard-size; "
                        "spread over the ranks")
    g.add_argument("--no-save-optim", action="store_true",
                   help="save no optimizer state (the model and the training state only)")
    g.add_argument("--no-save-rng", action="store_true",
                   help="save no RNG states")
    g.add_argument("--no-load-optim", action="store_true",
                   help="resume without the optimizer state (a fresh optimizer)")
    g.add_argument("--no-load-rng", action="store_true",
                   help="resume without the RNG states")
    g.add_argument("--finetune", action="store_true",
                   help="load model weights only and start at iteration 0")
    g.add_argument("--pretrained-checkpoint", type=str, default=None, metavar="DIR",
                   help="when --load holds no checkpoint, fine-tune from this one (as --finetune: its weights, from "
                        "iteration 0); a restart once --load holds one resumes from --load")
    g.add_argument("--ckpt-step", type=int, default=None, metavar="N",
                   help="load iteration N of the save root loaded (--load, else --pretrained-checkpoint) instead of "
                        "the newest; it must be published there")
    g.add_argument("--use-persistent-ckpt-worker", action="store_true",
                   help="accepted: the engine's writer threads always live across saves")
    g.add_argument("--verify-integrity", action="store_true",
                   help="accepted: datastates always checksums every saved chunk (crc32c) and checks it on load")
    g.add_argument("--exit-on-missing-checkpoint", action="store_true",
                   help="fail when --load holds no checkpoint instead of training from scratch")
    g.add_argument("--save-after-load", action="store_true",
                   help="right after --load, save the loaded state at the loaded iteration to --save (another "
                        "directory), in this run's TP/PP/DP layout; with --train-iters equal to that iteration "
                        "this converts a checkpoint to a new layout and exits")
    g.add_argument("--use-dist-ckpt", action="store_true", help="accepted for compatibility")
    g.add_argument("--enable-msc", dest="enable_msc", action="store_true", default=True,
                   help="accepted (upstream's flag): msc://profile/prefix paths on --save and --load resolve through "
                        "multi-storage-client's config (MSC_CONFIG) whenever it is installed")
    g.add_argument("--disable-msc", dest="enable_msc", action="store_false",
                   help="refuse msc:// paths, as upstream does with this flag")
    g.add_argument("--ckpt-fully-parallel-save", dest="ckpt_fully_parallel_save", action="store_true",
                   default=True, help="spread replicated state over the DP ranks (always, with datastates)")
    g.add_argument("--no-ckpt-fully-parallel-save", "--disable-ckpt-fully-parallel-save",
                   dest="ckpt_fully_parallel_save", action="store_false",
                   help="torch_dist only: DP rank 0 writes the replicated state")
    g.add_argument("--ckpt-fully-parallel-load", dest="ckpt_fully_parallel_load", action="store_true", default=None,
                   help="read each saved byte from storage once per DP group and pass it between the ranks that need "
                        "it (datastates: the exchange; torch_dist: megatron-core's fully parallel load) [datastates: "
                        "on for object stores, off on file systems]")
    g.add_argument("--no-ckpt-fully-parallel-load", dest="ckpt_fully_parallel_load", action="store_false",
                   help="every rank reads what it needs itself, replicas included")
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
    g.add_argument("--no-use-tokenizer-model-from-checkpoint-args",
                   "--disable-use-tokenizer-model-from-checkpoint-args",
                   dest="use_tokenizer_model_from_checkpoint_args", action="store_false", default=True,
                   help="accepted: --use-checkpoint-args never takes the tokenizer model's path from the checkpoint")
    g.add_argument("--dist-ckpt-optim-fully-reshardable", action="store_true",
                   help="save the distributed optimizer's state in megatron-core's fully_reshardable layout "
                        "(model-shaped, loads into any TP/PP/DP layout) instead of dp_reshardable (its flat "
                        "bucket shards, which reshard across DP sizes only)")


def _add_memory_tier_args(p):
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
    g.add_argument("--replication-factor", type=int, default=2,
                   help="copies of each rank's memory-tier part, its own included, with --replication")
    g.add_argument("--replication-jump", type=int, default=None,
                   help="rank distance between the copies of a part (default: the ranks per node)")


class HelpFormatter(argparse.HelpFormatter):
    """--help: each flag that takes a value shows its default after its help (a default of None is said in the
    help's own words, in brackets)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.option_strings and action.nargs != 0 and action.default not in (None, argparse.SUPPRESS):
            text += " [default: %(default)s]"
        return text


def _add_weights_publication_args(p):
    g = p.add_argument_group("policy weights to the inference side (docs/rl-weights.md)")
    g.add_argument("--publish-weights-dir", type=str, default=None, metavar="DIR",
                   help="publish a policy version every --publish-weights-interval iterations into DIR, node-local "
                        "shared memory (e.g. /dev/shm/policy): the Hugging Face model's tensors (--save-hf's "
                        "mapping) from the save of that iteration, iter_XXXXXXX/ and `latest`, read with "
                        "datastates.weights")
    g.add_argument("--publish-weights-interval", type=int, default=None, metavar="N",
                   help="--publish-weights-dir: a version every N iterations, a multiple of --save-interval or "
                        "--non-persistent-save-interval (a version is the save's own snapshot)")
    g.add_argument("--publish-weights-keep-last", type=int, default=2, metavar="K",
                   help="--publish-weights-dir: the newest K versions are kept; an older one is freed once no "
                        "reader holds it")
    g.add_argument("--publish-weights-deltas", type=int, default=0, metavar="K",
                   help="--publish-weights-dir: also write each version's changed elements against the one before "
                        "(DIR/deltas/), the newest K kept, so that a reader behind reads only what changed (0: none)")


def build_parser(extra_args_provider=None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Megatron-style GPT pretraining with lazy asynchronous checkpoints",
                                allow_abbrev=False, formatter_class=HelpFormatter)
    _add_model_args(p)
    _add_implementation_args(p)
    _add_parallel_args(p)
    _add_training_args(p)
    _add_data_args(p)
    _add_logging_args(p)
    _add_checkpoint_args(p)
    _add_memory_tier_args(p)
    _add_weights_publication_args(p)
    add_moe_args(p)
    add_mla_args(p)
    add_mtp_args(p)
    add_virtual_pipeline_args(p)
    if extra_args_provider is not None:
        p = extra_args_provider(p)
    return p


def answer_help(extra_args_provider=None, argv=None) -> None:
    """Print --help and exit when asked, before megatron-core is imported (its import warns where Transformer
    Engine and Apex are missing, which would come before the help)."""
    argv = sys.argv[1:] if argv is None else argv
    if "-h" in argv or "--help" in argv:
        build_parser(extra_args_provider).parse_known_args(argv)


def parse_args(extra_args_provider=None, argv=None) -> argparse.Namespace:
    """Parse the flags (sys.argv[1:] when argv is None). Use argument_checks.validate_args once the world size is known.

    An upstream flag this trainer refuses raises ArgumentError with the reason (all of them at once); a flag
    upstream does not know either is argparse's error."""
    from .refused_flags import refusals
    parser = build_parser(extra_args_provider)
    args, unknown = parser.parse_known_args(argv)
    messages, unrecognized = refusals(unknown)
    if messages:
        extra = f"\n  unrecognized: {' '.join(unrecognized)}" if unrecognized else ""
        raise ArgumentError("Megatron-LM flags this trainer does not support:\n  " + "\n  ".join(messages) + extra)
    if unrecognized:
        parser.error("unrecognized arguments: " + " ".join(unrecognized))
    return args
