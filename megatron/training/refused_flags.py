"""Upstream Megatron-LM flags this trainer refuses, each with the reason and what to use instead.

A launch script's flag is honoured (the parser knows it and the trainer acts on it) or refused here, before any
work starts; argparse's "unrecognized arguments" is left for flags upstream does not have either. Refusals are
collected, so one run of a script lists every flag it must change.

The rule for GPU-only implementation choices (docs/from-megatron-lm.md): a flag that asks for a GPU-only
implementation of the same math (a fused kernel, flash or fused attention, Transformer Engine, fp8, CUDA
streams, NCCL buffers, the CUDA allocator, CUDA profilers) is refused on CPU ranks, naming what CPU ranks run
instead; a flag that turns such an implementation off (`--no-*-fusion`, `--attention-backend local`) is
honoured: it asks for what runs here. This trainer turns on no fused kernel on any device.
"""
from __future__ import annotations

_FP8 = ("fp8 training needs Transformer Engine's fp8 recipes on fp8-capable GPUs, which this trainer does not "
        "wire; train in --bf16 (the checkpoint format does not depend on it)")
_META_INIT = ("Megatron-FSDP's meta-device initialization is not wired into this trainer: the model is built on its "
              "device, then sharded (drop the flag)")
_FSDP_DTENSOR = ("belongs to megatron-core's fsdp_dtensor checkpoint loads; a datastates load always checks that the "
                 "saved shards cover each tensor exactly (it cannot be relaxed)")
_NCCL_UB = "NCCL user buffers belong to Megatron-FSDP on NCCL; not built here (drop the flag)"
_GPT_OSS = ("GPT-OSS's architecture (sliding-window attention, a learnable softmax offset, clamped quick-GeGLU, "
            "YaRN) is not built here yet; Llama- and Mixtral-style models are")
_MODELOPT = "belongs to upstream's post-training (nvidia-modelopt) arguments, not to pretrain_gpt.py's"
_RESTARTS = ("launch with torchrun --max-restarts N instead: the workers restart as processes and resume from the "
             "memory tier (--non-persistent-save-interval) in seconds; a hung rank fails past "
             "--distributed-timeout-minutes or --ckpt-publish-timeout-s, naming its stage (docs/restarts.md)")
_INPROCESS = "in-process restart needs nvidia-resiliency-ext's in-process wrapper, not built here; " + _RESTARTS
_FT_PACKAGE = "nvidia-resiliency-ext's fault-tolerance package (ft_launcher's rank monitor) is not built here; " + \
    _RESTARTS
_INPROCESS_OPTIONS = ("max-iterations", "monitor-thread-interval", "monitor-process-interval",
                      "progress-watchdog-interval", "heartbeat-interval", "soft-timeout", "hard-timeout",
                      "heartbeat-timeout", "barrier-timeout", "completion-timeout", "last-call-wait",
                      "termination-grace-time", "granularity", "active-world-size", "empty-cuda-cache")

_TORCH_DIST_ONLY = ("tunes megatron-core's torch_dist saver or loader, whose async and parallel paths this trainer "
                    "replaces with the datastates engine (--ckpt-format datastates, --async-ckpt); drop the flag")
_DEBUG_DUMPS = "periodic dumps of gradients, parameters or activations for debugging are not built here (drop it)"
_CHECKPOINT = {  # megatron-core's checkpoint group (tests/test_upstream_flags.py checks it against upstream's)
    "--save-retain-interval": "retention of every N-th checkpoint is not built here; --ckpt-keep-last K keeps the "
                              "newest K (the newest published one is never deleted)",
    "--non-persistent-global-ckpt-dir": "belongs to --non-persistent-ckpt-type global, not built here: the memory "
                                        "tier is node-local (--non-persistent-local-ckpt-dir, docs/memory-tier.md)",
    "--non-persistent-local-ckpt-algo": "the memory tier has one algorithm of its own (docs/memory-tier.md); drop "
                                        "the flag",
    "--dist-ckpt-format": "deprecated upstream; use --ckpt-format",
    "--dist-ckpt-workers": _TORCH_DIST_ONLY + " (the engine's writers: --ckpt-writer-threads)",
    "--async-strategy": _TORCH_DIST_ONLY + " (the lazy engine is the asynchronous strategy here: --async-ckpt)",
    "--async-ckpt-cpu-priority": "the engine's writer threads run below training's priority on their own; drop it",
    "--async-ckpt-io-priority": "the engine's writer threads run below training's priority on their own; drop it",
    "--async-ckpt-use-cpu-shm": "the engine copies the state into its own host staging (--ckpt-host-buffer-gb); "
                                "no worker process takes GPU tensors; drop it",
    "--ckpt-fully-parallel-load-exchange-algo": _TORCH_DIST_ONLY,
    "--ckpt-fully-parallel-load-process-group": _TORCH_DIST_ONLY,
    "--ckpt-fully-parallel-save-process-group": _TORCH_DIST_ONLY,
    "--no-ckpt-load-validate-sharding-integrity": "a load always checks that the saved shards cover each tensor "
                                                  "exactly; it cannot be skipped",
    "--disable-ckpt-load-validate-sharding-integrity": "a load always checks that the saved shards cover each "
                                                       "tensor exactly; it cannot be skipped",
    "--no-stream-ckpt-dequant": _FP8, "--disable-stream-ckpt-dequant": _FP8,
    "--dist-ckpt-save-pre-mcore-014": "the torch_dist layout of megatron-core before 0.14 is not written here",
    "--distrib-optim-fully-reshardable-mem-efficient": _TORCH_DIST_ONLY + " (datastates streams the optimizer "
                                                       "state through bounded staging)",
    "--ckpt-convert-format": "convert with tools/convert_checkpoint.py, or --load OLD --save NEW --save-after-load "
                             "(docs/from-megatron-lm.md)",
    "--ckpt-convert-save": "convert with tools/convert_checkpoint.py, or --load OLD --save NEW --save-after-load "
                           "(docs/from-megatron-lm.md)",
    "--ckpt-convert-update-legacy-dist-opt-format": "the distributed optimizer's legacy (pre-2024) checkpoint "
                                                    "layout is not read here",
    "--load-main-params-from-ckpt": "not built here: load the optimizer state (drop --no-load-optim), whose fp32 "
                                    "main params come back bit for bit",
    "--use-mp-args-from-checkpoint-args": "pass the parallel sizes on the command line: a datastates checkpoint "
                                          "loads into any TP/PP/DP layout",
    "--override-ckpt-iteration": "not built here; --ckpt-step N loads iteration N as saved",
    **{f"--save-{what}-interval": _DEBUG_DUMPS for what in ("wgrads", "dgrads", "params", "activations",
                                                            "tokens-per-expert")},
}

REFUSED = {
    "--fp8-format": _FP8, "--fp8-recipe": _FP8, "--fp8-amax-history-len": _FP8, "--fp8-amax-compute-algo": _FP8,
    "--fp8-param-gather": _FP8, "--fp8-margin": _FP8,
    "--init-model-with-meta-device": _META_INIT,
    "--use-nccl-ub": _NCCL_UB, "--fsdp-manual-registration": _NCCL_UB,
    "--use-flash-attn": "FlashAttention is a CUDA kernel (through Transformer Engine): use --attention-backend "
                        "flash with --transformer-impl transformer_engine on GPUs, or drop it on CPU ranks",
    "--cross-entropy-loss-fusion": "asks for a fused cross-entropy kernel; this trainer computes the unfused "
                                   "one on every device (drop the flag)",
    "--record-memory-history": "records the CUDA caching allocator's history; CPU ranks have none (drop it)",
    "--enable-gpt-oss": _GPT_OSS + "; it also " + _MODELOPT,
    "--export-force-local-attention": _MODELOPT,
    "--quick-geglu": _GPT_OSS, "--glu-linear-offset": _GPT_OSS, "--activation-func-clamp-value": _GPT_OSS,
    "--softmax-type": _GPT_OSS, "--window-size": _GPT_OSS, "--window-attn-skip-freq": _GPT_OSS,
    "--tokenizer-special-tokens": "megatron-core's new tokenizer library is not used here: add the special "
                                  "tokens to the tokenizer itself (--tokenizer-model directory)",
    "--moe-permute-fusion": "asks for Transformer Engine's fused token permutation (a CUDA kernel); the "
                            "unfused permutation runs on every device here (drop the flag)",
    "--moe-flex-dispatcher-backend": "belongs to the flex token dispatcher (DeepEP/HybridEP on CUDA); use "
                                     "--moe-token-dispatcher-type allgather",
    "--moe-router-force-load-balancing": "a benchmarking aid that routes tokens uniformly instead of by the "
                                         "router; not built here (drop the flag)",
    "--moe-per-layer-logging": "per-layer MoE loss logging is not built here; the total loss is logged",
    "--inprocess-restart": _INPROCESS, **{f"--inprocess-{o}": _INPROCESS for o in _INPROCESS_OPTIONS},
    "--enable-ft-package": _FT_PACKAGE, "--calc-ft-timeouts": _FT_PACKAGE, "--ft-num-warmup-iters": _FT_PACKAGE,
    "--no-strict-fsdp-dtensor-load": _FSDP_DTENSOR, "--disable-strict-fsdp-dtensor-load": _FSDP_DTENSOR,
    **_CHECKPOINT,
}


def refusals(unknown: list[str]) -> tuple[list[str], list[str]]:
    """Split argparse's leftovers into (refusal messages, unrecognized tokens); values of refused flags go
    with them."""
    messages, unrecognized, refused_value = [], [], False
    for token in unknown:
        flag = token.split("=", 1)[0]
        if flag in REFUSED:
            messages.append(f"{flag}: {REFUSED[flag]}")
            refused_value = True
        elif token.startswith("-") or not refused_value:
            unrecognized.append(token)
            refused_value = False
    return messages, unrecognized
