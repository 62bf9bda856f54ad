"""The training loop: the only place that knows *when* to checkpoint.

    for each iteration i+1:
        forward/backward of every micro-batch          (reads params; a pending lazy snapshot copies meanwhile)
        gradient reductions (DP, SP layer norms, tied embedding), clipping, all megatron-core's
        checkpoints.wait_for_snapshot()                 <- right before anything saved is mutated
        optimizer.step(); scheduler.step()
        if (i+1) % save_interval == 0: checkpoints.save(i+1)    (returns at once with --async-ckpt)
        checkpoints.maybe_finalize()                    logs the saves that finished

The objects that train are megatron-core's on every device: DistributedDataParallel, `get_megatron_optimizer`
(`--use-distributed-optimizer` included) and the `get_forward_backward_func` schedules. On CPU ranks (gloo)
they run under `cpu_shim.cuda_free()`, the one module that adapts megatron-core's CUDA assumptions.
"""
from __future__ import annotations

import datetime
import gc
import logging
import math
from dataclasses import dataclass
import time

import torch
import torch.distributed as dist

from megatron.core import parallel_state as ps
from torch.distributed.elastic.multiprocessing.errors import record
from megatron.core.enums import ModelType

from . import cpu_shim, fsdp, megatron_fsdp
from .checkpointing import CheckpointManager
from .data import MicroBatches, build_train_valid_test_datasets
from .evaluation import describe, evaluate, evaluations_before
from .exits import ExitConditions
from .failures import stage
from .global_vars import get_tokenizer
from .initialize import initialize_megatron, shutdown_distributed
from .measures import flops_per_iteration, memory, params_norm
from .metrics import Metrics
from .multi_token import take_mtp_losses
from .profiling import Profiler
from .schedules import batch_at, scheduler_steps
from .utils import print_rank_0, print_rank_last
from .virtual_pipeline import build_model_chunks, data_iterators

log = logging.getLogger(__name__)


# ----- model and optimizer -----

def build_scheduler(args, optimizer):
    """megatron-core's OptimizerParamScheduler, stepped by the samples of each iteration (see schedules)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    warmup, decay, total = scheduler_steps(args)
    return OptimizerParamScheduler(
        optimizer, init_lr=args.lr_warmup_init, max_lr=args.lr, min_lr=args.min_lr,
        lr_warmup_steps=warmup, lr_decay_steps=decay,
        lr_decay_style=args.lr_decay_style, start_wd=args.weight_decay, end_wd=args.weight_decay,
        wd_incr_steps=total, wd_incr_style="constant")


def setup_model_and_optimizer(args, model_provider):
    """megatron-core's model, DistributedDataParallel (grad buffers) and optimizer, on every device.

    Returns (the GPT model chunks, the DDP wrappers that train them, optimizer, scheduler): one chunk per virtual
    pipeline stage (one without them).

    `get_megatron_optimizer` gives `DistributedOptimizer` with --use-distributed-optimizer, else
    `Float16OptimizerWithFloat16Params` (--bf16/--fp16) or `FP32Optimizer`, chained with a second one for the
    experts of a MoE model; gradient clipping is theirs."""
    from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    gpts = build_model_chunks(model_provider, args.virtual_pipeline_model_parallel_size)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=not args.grad_reduce_in_bf16, overlap_grad_reduce=args.overlap_grad_reduce,
        overlap_param_gather=args.overlap_param_gather, use_distributed_optimizer=args.use_distributed_optimizer,
        # fp16: the dynamic loss scaler skips the steps whose scaled gradients overflow (NaN included), so a
        # NaN there is expected, not fatal
        check_for_nan_in_grad=args.check_for_nan_in_loss_and_grad and not args.fp16)
    model = [_wrap(args, gpt, ddp_config, i) for i, gpt in enumerate(gpts)]
    config = gpts[0].config
    opt_config = OptimizerConfig(
        optimizer="adam", lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_eps=args.adam_eps,
        clip_grad=args.clip_grad, bf16=args.bf16, fp16=args.fp16, params_dtype=config.params_dtype,
        use_distributed_optimizer=args.use_distributed_optimizer, log_num_zeros_in_grad=args.log_num_zeros_in_grad,
        decoupled_lr=args.decoupled_lr, decoupled_min_lr=args.decoupled_min_lr)
    optimizer = get_megatron_optimizer(opt_config, model)
    # What Megatron-LM's train() wires into the schedules: loss scaling, the end-of-backward gradient
    # reductions (DP, sequence-parallel layer norms, the embedding tied across pipeline stages), no_sync.
    config.grad_scale_func = optimizer.scale_loss
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = [m.no_sync for m in model] if len(model) > 1 else model[0].no_sync
    if args.overlap_param_gather:
        config.param_sync_func = ([m.start_param_sync for m in model] if len(model) > 1
                                  else model[0].start_param_sync)
    return gpts, model, optimizer, build_scheduler(args, optimizer)


def _wrap(args, gpt, ddp_config, chunk: int):
    """One model chunk on its device, in 16-bit if asked, inside megatron-core's DistributedDataParallel (as in
    Megatron-LM, only the first chunk's gradients are bucketed)."""
    from megatron.core.distributed import DistributedDataParallel
    if args.device.type == "cuda":
        gpt.cuda(torch.cuda.current_device())
    module = gpt
    if args.bf16 or args.fp16:
        from megatron.core.transformer.module import Float16Module
        module = Float16Module(gpt.config, gpt)  # 16-bit inputs in, fp32 logits out, as in Megatron-LM
    if args.use_torch_fsdp2:
        return fsdp.wrap(args, module, gpt.config)
    if args.use_megatron_fsdp:
        return megatron_fsdp.wrap(args, module, gpt.config, ddp_config, chunk)
    return DistributedDataParallel(config=gpt.config, ddp_config=ddp_config, module=module,
                                   disable_bucketing=chunk > 0)


# ----- one step -----

def _reduce_losses(args, reported):
    """Mean over micro-batches, then over DP ranks (last pipeline stage only)."""
    if not reported:
        return {}
    out = {}
    for key in reported[0]:
        values = torch.stack([r[key].detach().float().reshape(-1) for r in reported])
        if values.shape[1] == 2:  # (loss sum, tokens) of --calculate-per-token-loss: over all tokens
            v = values.sum(0)
            if args.data_parallel_size > 1:
                dist.all_reduce(v, group=ps.get_data_parallel_group())
            out[key] = (v[0] / v[1]).item()
            continue
        v = values.mean()
        if args.data_parallel_size > 1:
            dist.all_reduce(v, group=ps.get_data_parallel_group())
            v = v / args.data_parallel_size
        out[key] = v.item()
    return out


@dataclass
class Step:
    """What one iteration reports: its losses (last pipeline stage), the optimizer's answers, its phases' times."""
    losses: dict
    stepped: bool
    grad_norm: float
    num_zeros: int | None
    times: dict


def train_step(args, model, optimizer, forward_step_func, batches, num_microbatches, checkpoints) -> Step:
    """One iteration of `num_microbatches` micro-batches from `batches`."""
    from megatron.core.pipeline_parallel import get_forward_backward_func
    t0 = time.perf_counter()
    for chunk in model:
        chunk.zero_grad_buffer()  # gradients are not part of the checkpoint
    optimizer.zero_grad()
    data = data_iterators([next(batches) for _ in range(num_microbatches)], model)
    reported = get_forward_backward_func()(
        forward_step_func=forward_step_func, data_iterator=data, model=model,
        num_microbatches=num_microbatches, seq_length=args.seq_length, micro_batch_size=args.micro_batch_size,
        forward_only=False)
    if args.empty_unused_memory_level >= 2:
        torch.cuda.empty_cache()
    t1 = time.perf_counter()
    # The optimizer step below mutates params and optimizer state: the snapshots of pending saves must be
    # taken. (With --overlap-param-gather the forward pass gathers params too, but a save finishes
    # that gather before building its state, so the saved params are the saved step's and nothing mutates
    # them before this point.)
    checkpoints.wait_for_snapshot()
    t2 = time.perf_counter()
    ok, grad_norm, num_zeros = optimizer.step()
    if args.empty_unused_memory_level >= 1:
        torch.cuda.empty_cache()
    times = {"forward-backward-time": t1 - t0, "checkpoint-wait-time": t2 - t1,
             "optimizer-time": time.perf_counter() - t2}
    losses = _reduce_losses(args, reported if ps.is_pipeline_last_stage() else [])
    if args.mtp_num_layers is not None and ps.is_pipeline_last_stage():
        losses.update(take_mtp_losses(num_microbatches, ps.get_data_parallel_group(), args.data_parallel_size))
    return Step(losses, ok, grad_norm or 0.0, num_zeros, times)


# ----- loop -----

class Run:
    """What the loop reports through and stops by: the metrics sinks, the evaluation data, the exit conditions."""

    def __init__(self, args, model, forward_step_func, datasets, start_time: float):
        self.args, self.model, self.forward_step_func = args, model, forward_step_func
        self.train_ds, self.valid_ds, self.test_ds = datasets
        self.vocab_size = get_tokenizer().vocab_size
        self.metrics = Metrics(args)
        self.exits = ExitConditions(args, start_time)
        self.profiler = Profiler(args, dist.get_rank())
        self.records_seen = 0
        if args.manual_gc:  # collected every --manual-gc-interval iterations instead (upstream's flag)
            gc.disable()

    def log_iteration(self, iteration: int, consumed: int, gbs: int, step: Step, lr: float, seconds: float) -> None:
        """Upstream's iteration line (last rank) and the metrics sinks; the optional figures of the flags."""
        args = self.args
        scalars = {**step.losses, "learning-rate": lr, "batch-size": gbs, "grad-norm": float(step.grad_norm),
                   "iteration-time": seconds, "samples-per-second": gbs / seconds if seconds else 0.0}
        line = (f" [{datetime.datetime.now():%Y-%m-%d %H:%M:%S}] iteration {iteration:8d}/{args.train_iters:8d} |"
                f" consumed samples: {consumed:12d} | elapsed time per iteration (ms): {seconds * 1e3:.1f} |")
        if args.log_throughput:
            scalars["throughput"] = flops_per_iteration(args, gbs) / seconds / 1e12 / args.world_size
            line += f" throughput per rank (TFLOP/s): {scalars['throughput']:.3f} |"
        line += f" learning rate: {lr:.6E} | global batch size: {gbs:5d} |"
        for k, v in step.losses.items():
            line += f" {k}: {v!r} |"
        line += f" grad norm: {step.grad_norm:.6f} |"
        if args.log_num_zeros_in_grad:
            scalars["num-zeros"] = step.num_zeros
            line += f" num zeros: {step.num_zeros} |"
        if args.log_params_norm:  # a collective: every rank computes it
            scalars["params-norm"] = params_norm(self.model)
            line += f" params norm: {scalars['params-norm']:.6f} |"
        print_rank_last(line)
        if args.log_timers_to_tensorboard:
            scalars.update(step.times)
        if args.log_memory_to_tensorboard:
            scalars.update(memory(args.device))
        self.metrics.log(iteration, scalars)

    def log_checkpoints(self, checkpoints, iteration: int, agree: bool) -> None:
        """The checkpoints that finished since the last call, to the metrics sinks at the run's `iteration`; with
        `agree` (a point every rank reaches: a save, the end) the slowest rank's stall of each too."""
        for record in checkpoints.records[self.records_seen:]:
            self.metrics.log_checkpoint(iteration, record)
        self.records_seen = len(checkpoints.records)
        if agree:
            self.metrics.log_slowest(iteration)

    def evaluate(self, iteration: int, dataset, split: str, evaluations_done: int) -> None:
        args = self.args
        if dataset is None or not args.eval_iters:
            return
        first = evaluations_done * args.eval_iters * args.global_batch_size
        reported = evaluate(args, self.model, self.forward_step_func, dataset, first, vocab_size=self.vocab_size,
                            what=f"{split} data")
        losses = _reduce_losses(args, reported)
        if losses:
            print_rank_last(describe(losses, f"iteration {iteration} on {split} set"))
        self.metrics.log(iteration, {f"{k} {split}": v for k, v in losses.items()} |
                         ({f"{k} {split} ppl": math.exp(min(20.0, v)) for k, v in losses.items()}
                          if args.log_validation_ppl_to_tensorboard else {}), every_iteration=True)

    def after_iteration(self, iteration: int) -> None:
        self.profiler.step(iteration)
        if self.args.manual_gc and self.args.manual_gc_interval and iteration % self.args.manual_gc_interval == 0:
            gc.collect()

    def close(self) -> None:
        if self.args.manual_gc:
            gc.enable()
        self.profiler.close()
        self.metrics.close()
        self.exits.close()


def train(args, model, optimizer, scheduler, run: Run, checkpoints, iteration, consumed):
    """Train until --train-iters, --exit-interval or an exit condition; returns (iteration, why it stopped)."""
    batches = MicroBatches(run.train_ds, consumed, args.micro_batch_size, ps.get_data_parallel_rank(),
                           ps.get_data_parallel_world_size(), vocab_size=run.vocab_size,
                           num_workers=args.num_workers, device=args.device,
                           causal_mask=args.create_attention_mask_in_dataloader)
    for chunk in model:
        chunk.train()
    saved_last, start, stop = None, iteration, None
    t_last = time.perf_counter()
    while iteration < args.train_iters and stop is None:
        with stage(f"iteration {iteration + 1}", args.distributed_timeout_minutes):  # a lost or hung peer
            gbs, num_microbatches = batch_at(consumed)  # the ramp's batch size after `consumed` samples
            step = train_step(args, model, optimizer, run.forward_step_func, batches, num_microbatches, checkpoints)
            if step.stepped:
                scheduler.step(increment=gbs)
            iteration += 1
            consumed += gbs
            run.after_iteration(iteration)
            if iteration % args.log_interval == 0:
                now = time.perf_counter()
                run.log_iteration(iteration, consumed, gbs, step, optimizer.param_groups[0]["lr"],
                                  (now - t_last) / args.log_interval)
                t_last = now
            if args.eval_interval and iteration % args.eval_interval == 0:
                run.evaluate(iteration, run.valid_ds, "validation", evaluations_before(args, iteration))
            saving = bool(args.save and args.save_interval and iteration % args.save_interval == 0)
            if saving:
                checkpoints.save(iteration, consumed)
                saved_last = iteration
            elif args.non_persistent_save_interval and iteration % args.non_persistent_save_interval == 0:
                checkpoints.save_local(iteration, consumed)  # storage has this iteration already otherwise
            checkpoints.maybe_finalize()
            run.log_checkpoints(checkpoints, iteration, agree=saving)
            if args.exit_interval and iteration % args.exit_interval == 0:
                stop = f"--exit-interval {args.exit_interval}"
            else:
                stop = run.exits.reason()
    # Megatron saves once more where training stops, when that iteration was not a save point.
    if args.save and iteration > start and saved_last != iteration:
        with stage(f"the checkpoint of iteration {iteration}", args.distributed_timeout_minutes):
            checkpoints.save(iteration, consumed)
    return iteration, stop


@record  # under torchrun: the exception goes to its error file, and the job's report names the rank that failed first
def pretrain(train_valid_test_dataset_provider, model_provider, model_type=None, forward_step_func=None,
             extra_args_provider=None, args_defaults=None, argv=None):
    """Megatron's entry point: initialize, build, load, train, finish every checkpoint.

    As in Megatron-LM, `args_defaults` are the script's defaults for flags its command line leaves unset;
    `model_type` may only be the decoder-only ModelType.encoder_or_decoder, the one kind built here.
    `train_valid_test_dataset_provider(args)` returns the (train, valid, test) data sets (valid and test may be
    None)."""
    start_time = time.time()  # --exit-duration-in-mins counts from here, as upstream's does
    if model_type not in (None, ModelType.encoder_or_decoder):
        raise ValueError(f"pretrain: model_type {model_type} is not supported: this trainer builds decoder-only "
                         "models (ModelType.encoder_or_decoder)")
    args = initialize_megatron(extra_args_provider, argv, args_defaults)
    with cpu_shim.cuda_free():  # megatron-core's CUDA assumptions, adapted on CPU ranks (a no-op with CUDA)
        return _pretrain(args, train_valid_test_dataset_provider, model_provider, forward_step_func, start_time)


def _pretrain(args, train_valid_test_dataset_provider, model_provider, forward_step_func, start_time):
    print_rank_0(f"> world size {args.world_size}: tensor-parallel {args.tensor_model_parallel_size}, "
                 f"pipeline-parallel {args.pipeline_model_parallel_size}, data-parallel {args.data_parallel_size}, "
                 f"{args.num_microbatches} micro-batch(es) per iteration"
                 f"{' at the final batch size' if args.rampup_batch_size or args.step_batch_size_schedule else ''}, "
                 f"device {args.device}")
    gpt, model, optimizer, scheduler = setup_model_and_optimizer(args, model_provider)
    checkpoints = CheckpointManager(args, gpt, optimizer, scheduler, ddp=model)
    run = None
    try:
        with stage("the checkpoint load", args.distributed_timeout_minutes):
            iteration, consumed = checkpoints.load()
        if args.save_after_load:
            if iteration > 0:
                checkpoints.save(iteration, consumed)
            else:
                log.warning("--save-after-load: nothing was loaded at iteration > 0, nothing saved")
        datasets = (train_valid_test_dataset_provider or build_train_valid_test_datasets)(args)
        run = Run(args, model, forward_step_func, datasets, start_time)
        iteration, stop = train(args, model, optimizer, scheduler, run, checkpoints, iteration, consumed)
        with stage("the wait for the last checkpoints", args.distributed_timeout_minutes):
            checkpoints.wait()  # every checkpoint durable and published
        run.log_checkpoints(checkpoints, iteration, agree=True)
        if stop is not None:
            print_rank_0(f"exiting program at iteration {iteration}: {stop}")
        elif iteration >= args.train_iters:  # the end of training: the validation and test sets, as upstream
            run.evaluate(iteration, run.valid_ds, "validation", evaluations_before(args, iteration + 1))
            run.evaluate(iteration, run.test_ds, "test", 0)
    finally:
        checkpoints.close()
        if run is not None:
            run.close()
    dist.barrier()
    if iteration >= args.train_iters:
        checkpoints.remove_memory_tier()  # the job is finished: its restart point in memory is not needed
    print_rank_0(f"> training done at iteration {iteration}")
    shutdown_distributed(args)
    return iteration
