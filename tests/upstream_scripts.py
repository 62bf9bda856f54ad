"""The flags that six of upstream Megatron-LM's example launch scripts pass to `pretrain_gpt.py` (issue 25).

Rebuilt by hand as data from NVIDIA/Megatron-LM at commit d98e8a64ddf34856e74b24714e3bedb2f5a39553
(2026-08-22); the scripts themselves are upstream's code and are not copied here. Flag names are spelled
exactly as upstream spells them. Values are scaled down for 4 CPU ranks: sizes, layers, heads, sequence length,
parallel degrees, batch sizes, sample and iteration counts and intervals; each scaled value carries upstream's
value in a comment. Ratios and choices (learning rates, betas, dropout, formats) are upstream's own; so are
the splits, except where a 100-document data set would get an empty split.

Every branch of an if/else in a script is kept as a named side: a run takes one branch of an if/else
(`mock_data` or `real_data`) and may leave out a lone `if` (`fp8`, `megatron_fsdp`, `profile`, `wandb`).
`default_sides` are the sides the script takes with its own default settings. A flag maps to `SWITCH` (takes
no value), to one value, or to a tuple of values (upstream declares it with nargs '+'). Placeholders in braces
are filled by `argv`: `{save}`, `{tensorboard}`, `{data}`, `{cache}`, `{tokenizer}`, `{vocab}`, `{merge}`.

Upstream quirks, kept as facts:
- the mock/real data branches quote `--split '99,1,0'` inside a string that bash word-splits, so upstream's
  parser sees the quotes (its split parser skips them; they are left out here);
- `--enable-gpt-oss` and `--export-force-local-attention` exist only in megatron/post_training/arguments.py,
  which upstream's pretrain_gpt.py adds when nvidia-modelopt is installed;
- upstream's own validate_args refuses the GPT-3 script as published: "Cannot specify both
  --step-batch-size-schedule and --global-batch-size".
"""
from __future__ import annotations

from dataclasses import dataclass, field

UPSTREAM = "NVIDIA/Megatron-LM"
UPSTREAM_COMMIT = "d98e8a64ddf34856e74b24714e3bedb2f5a39553"
SWITCH = None  # a flag that takes no value


@dataclass(frozen=True)
class UpstreamScript:
    path: str  # in UPSTREAM at UPSTREAM_COMMIT
    flags: dict  # passed on every run: flag -> SWITCH, a value, or a tuple of values
    sides: dict = field(default_factory=dict)  # side name -> flags of that branch
    default_sides: tuple = ()


# Blocks that upstream repeats word for word across scripts.
_MOCK_DATA = {  # the "MOCK" branch of the data if/else (Llama-3, Llama-3 FSDP, GPT-OSS)
    "--mock-data": SWITCH,
    "--tokenizer-type": "NullTokenizer",
    "--vocab-size": "512",  # 128256
    "--data-cache-path": "{cache}",
    "--tiktoken-pattern": "v2",
    "--split": "99,1,0",
    "--no-create-attention-mask-in-dataloader": SWITCH,
    "--no-mmap-bin-files": SWITCH,
    "--num-workers": "1",
}
_REAL_DATA = {  # its other branch
    "--data-path": "{data}",
    "--tokenizer-type": "HuggingFaceTokenizer",
    "--tokenizer-model": "{tokenizer}",
    "--data-cache-path": "{cache}",
    "--split": "99,1,0",
    "--no-create-attention-mask-in-dataloader": SWITCH,
    "--no-mmap-bin-files": SWITCH,
    "--num-workers": "1",
    "--vocab-size": "512",  # 128256
}
_FP8 = {
    "--fp8-format": "hybrid",
    "--fp8-amax-history-len": "1024",
    "--fp8-amax-compute-algo": "max",
    "--fp8-param-gather": SWITCH,
}
_MEGATRON_FSDP = {  # what both Megatron-FSDP scripts add when USE_MEGATRON_FSDP is 1
    "--use-megatron-fsdp": SWITCH,
    "--data-parallel-sharding-strategy": "optim_grads_params",
    "--no-gradient-accumulation-fusion": SWITCH,
    "--calculate-per-token-loss": SWITCH,
    "--init-model-with-meta-device": SWITCH,
    "--ckpt-format": "fsdp_dtensor",
    "--fsdp-double-buffer": SWITCH,
    "--use-nccl-ub": SWITCH,
}
_LLAMA3_8B_MODEL = {
    "--use-mcore-models": SWITCH,
    "--num-layers": "4",  # 32
    "--hidden-size": "64",  # 4096
    "--ffn-hidden-size": "224",  # 14336
    "--num-attention-heads": "8",  # 32
    "--group-query-attention": SWITCH,
    "--num-query-groups": "2",  # 8
    "--kv-channels": "8",  # 128
    "--seq-length": "64",  # 8192
    "--max-position-embeddings": "64",  # 8192
    "--position-embedding-type": "rope",
    "--rotary-base": "1000000",
    "--rotary-percent": "1.0",
    "--attention-dropout": "0.0",
    "--hidden-dropout": "0.0",
    "--swiglu": SWITCH,
    "--normalization": "RMSNorm",
    "--init-method-std": "0.0134",
    "--attention-backend": "fused",
    "--apply-layernorm-1p": SWITCH,
    "--untie-embeddings-and-output-weights": SWITCH,
    "--disable-bias-linear": SWITCH,
}
_LLAMA3_8B_SCHEDULE = {  # 4 ranks are DP 4: 8 samples a step, 8 steps
    "--micro-batch-size": "1",
    "--global-batch-size": "8",  # 128
    "--train-samples": "64",  # 1953125000
    "--lr-decay-samples": "64",  # 1949218748
    "--lr-warmup-samples": "16",  # 3906252
    "--lr": "0.00015",
    "--min-lr": "0.00001",
    "--decoupled-lr": "5.0e-4",
    "--decoupled-min-lr": "4.5e-5",
    "--lr-decay-style": "cosine",
    "--clip-grad": "1.0",
    "--weight-decay": "0.1",
    "--adam-beta1": "0.9",
    "--adam-beta2": "0.95",
    "--bf16": SWITCH,
}
_LLAMA3_8B_PARALLEL = {  # TP 1, CP 1 as upstream; the 4 ranks are data parallel
    "--tensor-model-parallel-size": "1",
    "--context-parallel-size": "1",
    "--sequence-parallel": SWITCH,
    "--use-distributed-optimizer": SWITCH,
    "--overlap-grad-reduce": SWITCH,
    "--overlap-param-gather": SWITCH,
}
_LLAMA3_8B_LOGGING = {
    "--log-interval": "1",
    "--eval-iters": "2",  # 32
    "--eval-interval": "4",  # 100
    "--save-interval": "4",  # 1000
    "--log-throughput": SWITCH,
    "--distributed-timeout-minutes": "60",
    "--save": "{save}",
    "--load": "{save}",
    "--tensorboard-dir": "{tensorboard}",
}
_PROFILE_RANK_0 = {
    "--profile": SWITCH,
    "--profile-step-start": "4",  # 10 (DeepSeek-V3), 8 (Llama-3 FSDP)
    "--profile-step-end": "6",  # 12
    "--profile-ranks": ("0",),
}

GPT3_175B = UpstreamScript(
    path="examples/gpt3/train_gpt3_175b_distributed.sh",
    flags={
        "--num-layers": "4",  # 96
        "--hidden-size": "64",  # 12288
        "--num-attention-heads": "4",  # 96
        "--seq-length": "64",  # 2048
        "--max-position-embeddings": "64",  # 2048
        "--attention-backend": "auto",
        "--micro-batch-size": "1",
        "--global-batch-size": "4",  # 1536
        "--step-batch-size-schedule": "0:1 128:2 384:4",  # "0:16 2.4B:320 4.8B:624 7.2B:928 9.6B:1232 12B:1536"
        "--train-iters": "8",  # 500000
        "--weight-decay": "0.1",
        "--adam-beta1": "0.9",
        "--adam-beta2": "0.95",
        "--init-method-std": "0.006",
        "--clip-grad": "1.0",
        "--fp16": SWITCH,
        "--lr": "6.0e-5",
        "--lr-decay-style": "cosine",
        "--min-lr": "6.0e-6",
        "--lr-warmup-fraction": ".001",
        "--lr-decay-iters": "7",  # 430000
        "--tensor-model-parallel-size": "2",  # 8
        "--pipeline-model-parallel-size": "2",  # 16
        "--data-path": "{data}",
        "--vocab-file": "{vocab}",
        "--merge-file": "{merge}",
        "--split": "94,5,1",  # 949,50,1: would leave a 100-document corpus no test document
        "--log-interval": "1",  # 100
        "--save-interval": "4",  # 10000
        "--eval-interval": "4",  # 1000
        "--save": "{save}",
        "--load": "{save}",
        "--eval-iters": "2",  # 10
        "--tensorboard-dir": "{tensorboard}",
    },
)

LLAMA3_8B_FP8 = UpstreamScript(
    path="examples/llama/train_llama3_8b_h100_fp8.sh",
    flags={
        **_LLAMA3_8B_MODEL,
        **_LLAMA3_8B_SCHEDULE,
        "--grad-reduce-in-bf16": SWITCH,
        "--cross-entropy-loss-fusion": SWITCH,
        "--calculate-per-token-loss": SWITCH,
        "--manual-gc": SWITCH,
        "--empty-unused-memory-level": "1",
        "--exit-duration-in-mins": "235",
        **_LLAMA3_8B_PARALLEL,
        **_LLAMA3_8B_LOGGING,
        "--profile": SWITCH,
        "--profile-step-start": "4",
        "--profile-step-end": "6",
        "--ckpt-format": "torch_dist",
    },
    sides={"fp8": _FP8, "mock_data": _MOCK_DATA, "real_data": _REAL_DATA},
    default_sides=("fp8", "mock_data"),
)

MIXTRAL_8X7B = UpstreamScript(
    path="examples/mixtral/train_mixtral_8x7b_distributed.sh",
    flags={
        "--use-mcore-models": SWITCH,
        "--disable-bias-linear": SWITCH,
        "--seq-length": "64",  # 4096
        "--max-position-embeddings": "512",  # 32768
        "--num-layers": "4",  # 32
        "--hidden-size": "64",  # 4096
        "--ffn-hidden-size": "224",  # 14336
        "--num-attention-heads": "8",  # 32
        "--init-method-std": "0.01",
        "--attention-dropout": "0.0",
        "--hidden-dropout": "0.0",
        "--normalization": "RMSNorm",
        "--position-embedding-type": "rope",
        "--swiglu": SWITCH,
        "--untie-embeddings-and-output-weights": SWITCH,
        "--group-query-attention": SWITCH,
        "--num-query-groups": "2",  # 8
        "--no-masked-softmax-fusion": SWITCH,
        "--no-position-embedding": SWITCH,
        "--rotary-base": "1000000",
        "--num-experts": "4",  # 8
        "--moe-router-topk": "2",
        "--moe-router-load-balancing-type": ("aux_loss",),
        "--moe-aux-loss-coeff": ("1e-2",),
        "--moe-grouped-gemm": SWITCH,
        "--moe-token-dispatcher-type": "alltoall",
        "--overlap-param-gather": SWITCH,
        "--overlap-grad-reduce": SWITCH,
        "--tokenizer-type": "Llama2Tokenizer",
        "--tokenizer-model": "{tokenizer}",
        "--data-path": "{data}",
        "--split": "90,8,2",  # 99990,8,2: would leave a 100-document corpus no validation document
        "--micro-batch-size": "1",
        "--global-batch-size": "8",  # 256
        "--lr": "1e-4",
        "--train-iters": "8",  # 500000
        "--lr-decay-iters": "5",  # 320000
        "--lr-decay-style": "cosine",
        "--min-lr": "1.0e-5",
        "--weight-decay": "0.1",
        "--lr-warmup-iters": "1",  # 500
        "--clip-grad": "1.0",
        "--bf16": SWITCH,
        "--tensor-model-parallel-size": "1",
        "--pipeline-model-parallel-size": "2",  # 4
        "--expert-model-parallel-size": "2",  # 8
        "--use-distributed-optimizer": SWITCH,
        "--sequence-parallel": SWITCH,
        "--log-interval": "1",
        "--save-interval": "4",  # 10000
        "--eval-interval": "4",  # 1000
        "--eval-iters": "2",  # 10
        "--save": "{save}",
        "--load": "{save}",
        "--tensorboard-dir": "{save}/tensorboard",
        "--no-load-optim": SWITCH,
        "--no-load-rng": SWITCH,
    },
    sides={"wandb": {"--wandb-project": "Mixtral", "--wandb-exp-name": "Mixtral_8x7B"}},  # if WANDB_API_KEY
)

DEEPSEEK_V3_FSDP = UpstreamScript(
    path="examples/megatron_fsdp/sbatch_mfsdp_deepseek_v3.sh",
    flags={
        "--distributed-timeout-minutes": "60",
        "--tensor-model-parallel-size": "1",
        "--expert-model-parallel-size": "4",  # 8
        "--expert-tensor-parallel-size": "1",
        "--context-parallel-size": "1",
        "--use-distributed-optimizer": SWITCH,
        "--overlap-grad-reduce": SWITCH,
        "--overlap-param-gather": SWITCH,
        "--use-mcore-models": SWITCH,
        "--sequence-parallel": SWITCH,
        "--use-flash-attn": SWITCH,
        "--disable-bias-linear": SWITCH,
        "--micro-batch-size": "1",  # 4
        "--global-batch-size": "8",  # 2048
        "--train-samples": "64",  # 585937500
        "--exit-duration-in-mins": "220",
        "--no-check-for-nan-in-loss-and-grad": SWITCH,
        "--manual-gc": SWITCH,
        "--manual-gc-interval": "2",  # 10
        "--recompute-granularity": "selective",
        "--recompute-modules": ("mlp", "moe", "mla_up_proj", "layernorm"),
        "--transformer-impl": "transformer_engine",
        "--seq-length": "64",  # 4096
        "--data-cache-path": "{cache}",
        "--tokenizer-type": "HuggingFaceTokenizer",
        "--tokenizer-model": "{tokenizer}",  # deepseek-ai/DeepSeek-V3, a model hub name
        "--data-path": "{data}",
        "--split": "99,1,0",
        "--no-mmap-bin-files": SWITCH,
        "--no-create-attention-mask-in-dataloader": SWITCH,
        "--num-workers": "1",  # 6
        "--num-layers": "4",  # 61
        "--hidden-size": "64",  # 7168
        "--ffn-hidden-size": "160",  # 18432
        "--num-attention-heads": "8",  # 128
        "--kv-channels": "16",  # 128
        "--max-position-embeddings": "64",  # 4096
        "--position-embedding-type": "rope",
        "--rotary-base": "10000",
        "--make-vocab-size-divisible-by": "3232",
        "--normalization": "RMSNorm",
        "--norm-epsilon": "1e-6",
        "--swiglu": SWITCH,
        "--untie-embeddings-and-output-weights": SWITCH,
        "--multi-latent-attention": SWITCH,
        "--attention-dropout": "0.0",
        "--hidden-dropout": "0.0",
        "--clip-grad": "1.0",
        "--weight-decay": "0.1",
        "--qk-layernorm": SWITCH,
        "--lr-decay-samples": "64",  # 584765624
        "--lr-warmup-samples": "8",  # 1536000
        "--lr-warmup-init": "3.9e-7",
        "--lr": "3.9e-6",
        "--min-lr": "3.9e-7",
        "--lr-decay-style": "cosine",
        "--adam-beta1": "0.9",
        "--adam-beta2": "0.95",
        "--num-experts": "8",  # 256
        "--moe-layer-freq": "[0]*1+[1]*3",  # [0]*3+[1]*58
        "--moe-ffn-hidden-size": "32",  # 2048
        "--moe-shared-expert-intermediate-size": "32",  # 2048
        "--moe-router-load-balancing-type": ("seq_aux_loss",),
        "--moe-router-topk": "4",  # 8
        "--moe-token-dispatcher-type": "flex",
        "--moe-flex-dispatcher-backend": "hybridep",
        "--moe-router-pre-softmax": SWITCH,
        "--moe-grouped-gemm": SWITCH,
        "--moe-aux-loss-coeff": ("1e-4",),
        "--moe-router-group-topk": "2",  # 4
        "--moe-router-num-groups": "4",  # 8
        "--moe-router-topk-scaling-factor": "2.5",
        "--moe-router-score-function": "sigmoid",
        "--moe-router-enable-expert-bias": SWITCH,
        "--moe-router-bias-update-rate": "1e-3",
        "--moe-router-dtype": "fp32",
        "--moe-permute-fusion": SWITCH,
        "--moe-router-force-load-balancing": SWITCH,
        "--q-lora-rank": "32",  # 1536
        "--kv-lora-rank": "16",  # 512
        "--qk-head-dim": "16",  # 128
        "--qk-pos-emb-head-dim": "8",  # 64
        "--v-head-dim": "16",  # 128
        "--rotary-scaling-factor": "40",
        "--mscale": "1.0",
        "--mscale-all-dim": "1.0",
        "--mtp-num-layers": "1",
        "--mtp-loss-scaling-factor": "0.1",
        "--eval-iters": "2",  # 32
        "--eval-interval": "4",  # 100
        "--auto-detect-ckpt-format": SWITCH,
        "--load": "{save}",
        "--save": "{save}",
        "--save-interval": "4",  # 100
        "--dist-ckpt-strictness": "log_all",
        "--init-method-std": "0.02",
        "--log-timers-to-tensorboard": SWITCH,
        "--log-memory-to-tensorboard": SWITCH,
        "--log-num-zeros-in-grad": SWITCH,
        "--log-params-norm": SWITCH,
        "--log-validation-ppl-to-tensorboard": SWITCH,
        "--log-throughput": SWITCH,
        "--log-interval": "1",
        "--logging-level": "40",
        "--tensorboard-dir": "{tensorboard}",
        "--bf16": SWITCH,
        "--enable-experimental": SWITCH,
    },
    sides={
        "megatron_fsdp": {  # if USE_MEGATRON_FSDP (default 1)
            **_MEGATRON_FSDP,
            "--use-distributed-optimizer": SWITCH,
            "--megatron-fsdp-grad-comm-dtype": "bf16",
            "--megatron-fsdp-main-grads-dtype": "bf16",
        },
        "profile": _PROFILE_RANK_0,  # if PROFILE (default 0)
        "wandb": {  # if WANDB (default 1); the name is built from TP, EP, MBS, GBS
            "--wandb-project": "your_own_wandb_project",
            "--wandb-exp-name": "DeepSeek-V3-TP1EP4-MBS1GBS8-",
        },
    },
    default_sides=("megatron_fsdp", "wandb"),
)

GPT_OSS = UpstreamScript(
    path="examples/gptoss/02_train.sh",
    flags={
        "--no-masked-softmax-fusion": SWITCH,
        "--transformer-impl": "transformer_engine",
        "--disable-bias-linear": SWITCH,
        "--untie-embeddings-and-output-weights": SWITCH,
        "--no-rope-fusion": SWITCH,
        "--normalization": "RMSNorm",
        "--num-layers": "4",  # 12
        "--hidden-size": "64",  # 512
        "--ffn-hidden-size": "256",  # 2048
        "--num-attention-heads": "8",  # 64
        "--group-query-attention": SWITCH,
        "--num-query-groups": "2",  # 8
        "--seq-length": "64",  # 8192
        "--max-position-embeddings": "64",  # 8192
        "--use-mcore-models": SWITCH,
        "--rotary-percent": "1.0",
        "--rope-type": "rope",
        "--position-embedding-type": "rope",
        "--rotary-base": "10000",
        "--no-bias-gelu-fusion": SWITCH,
        "--export-force-local-attention": SWITCH,
        "--no-bias-dropout-fusion": SWITCH,
        "--quick-geglu": SWITCH,
        "--glu-linear-offset": "1.0",
        "--softmax-type": "learnable",
        "--window-attn-skip-freq": "2",
        "--activation-func-clamp-value": "7.0",
        "--window-size": "15,0",  # 127,0
        "--enable-gpt-oss": SWITCH,
        "--num-experts": "4",
        "--moe-router-topk": "2",
        "--moe-router-load-balancing-type": ("aux_loss",),
        "--moe-aux-loss-coeff": ("1e-3",),
        "--moe-grouped-gemm": SWITCH,
        "--moe-token-dispatcher-type": "alltoall",
        "--overlap-param-gather": SWITCH,
        "--overlap-grad-reduce": SWITCH,
        "--moe-ffn-hidden-size": "256",  # 2048
        "--moe-router-dtype": "fp32",
        "--moe-z-loss-coeff": "1e-3",
        "--moe-permute-fusion": SWITCH,
        "--micro-batch-size": "1",
        "--global-batch-size": "8",  # 128
        "--lr": "1.0e-5",
        "--train-samples": "64",  # 1953125000
        "--lr-decay-samples": "64",  # 1949218748
        "--lr-decay-style": "cosine",
        "--min-lr": "1.0e-6",
        "--weight-decay": "0.1",
        "--lr-warmup-fraction": "0.05",
        "--clip-grad": "1.0",
        "--bf16": SWITCH,
        "--use-flash-attn": SWITCH,
        "--attention-softmax-in-fp32": SWITCH,
        "--accumulate-allreduce-grads-in-fp32": SWITCH,
        "--disable-bf16-reduced-precision-matmul": SWITCH,
        "--recompute-activations": SWITCH,
        "--tensor-model-parallel-size": "1",
        "--pipeline-model-parallel-size": "4",  # the world size, 8
        "--expert-model-parallel-size": "1",
        "--sequence-parallel": SWITCH,
        "--context-parallel-size": "1",
        "--use-distributed-optimizer": SWITCH,
        **_FP8,  # not behind an if in this script
        "--log-interval": "1",
        "--save-interval": "4",  # 10000
        "--eval-interval": "50000000",
        "--eval-iters": "0",
        "--save": "{save}",
        "--tensorboard-dir": "{save}/tensorboard",
        "--moe-per-layer-logging": SWITCH,
        "--no-load-optim": SWITCH,
        "--no-load-rng": SWITCH,
        "--log-throughput": SWITCH,
    },
    sides={"mock_data": _MOCK_DATA, "real_data": _REAL_DATA},
    default_sides=("mock_data",),
)

LLAMA3_8B_FSDP_FP8 = UpstreamScript(
    path="examples/megatron_fsdp/train_llama3_8b_fsdp_h100_fp8.sh",
    flags={
        **_LLAMA3_8B_MODEL,
        **_LLAMA3_8B_SCHEDULE,
        "--cross-entropy-loss-fusion": SWITCH,
        "--no-check-for-nan-in-loss-and-grad": SWITCH,
        "--manual-gc": SWITCH,
        "--empty-unused-memory-level": "1",
        "--exit-duration-in-mins": "235",
        **_LLAMA3_8B_PARALLEL,
        **_LLAMA3_8B_LOGGING,
        "--logging-level": "20",
    },
    sides={
        "megatron_fsdp": {**_MEGATRON_FSDP, "--fsdp-manual-registration": SWITCH},  # if USE_MEGATRON_FSDP (default 1)
        "fp8": _FP8,
        "mock_data": _MOCK_DATA,
        "real_data": _REAL_DATA,
        "profile": {**_PROFILE_RANK_0, "--record-memory-history": SWITCH},  # if NSYS_PROFILE (default 0)
    },
    default_sides=("megatron_fsdp", "fp8", "mock_data"),
)

SCRIPTS = {
    "gpt3_175b": GPT3_175B,
    "llama3_8b_fp8": LLAMA3_8B_FP8,
    "mixtral_8x7b": MIXTRAL_8X7B,
    "deepseek_v3_fsdp": DEEPSEEK_V3_FSDP,
    "gpt_oss": GPT_OSS,
    "llama3_8b_fsdp_fp8": LLAMA3_8B_FSDP_FP8,
}


def argv(script: str, *sides: str, **paths) -> list[str]:
    """The command line `script` passes to pretrain_gpt.py with the named sides, placeholders filled from `paths`.

    A placeholder that is a whole value and given a list or tuple fills several words (a weighted blend:
    data=["0.3", "a", "0.7", "b"]).
    """
    spec = SCRIPTS[script]
    unknown = [s for s in sides if s not in spec.sides]
    if unknown:
        raise KeyError(f"{script} has no side {unknown}; its sides are {sorted(spec.sides)}")
    words = []
    for flags in (spec.flags, *(spec.sides[s] for s in sides)):
        for flag, value in flags.items():
            words.append(flag)
            for v in () if value is SWITCH else (value,) if isinstance(value, str) else value:
                filled = paths.get(v[1:-1]) if v.startswith("{") and v.endswith("}") else None
                if isinstance(filled, (list, tuple)):
                    words.extend(str(w) for w in filled)
                    continue
                try:
                    words.append(v.format(**paths))
                except KeyError as e:
                    raise KeyError(f"{script} {flag} {v}: pass {e.args[0]}=... to argv") from None
    return words
