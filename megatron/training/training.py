"""The training loop: the only place that knows *when* to checkpoint.

    for each iteration i+1:
        forward/backward of every micro-batch          (reads params; a pending lazy snapshot copies meanwhile)
        gradient all-reduce (DP), clipping
        checkpointer.fence()                            <- right before anything saved is mutated
        optimizer.step(); scheduler.step()
        if i+1 % save_interval == 0: save_checkpoint(i+1)   (returns at once with --async-ckpt)

On CPU (gloo) the step is this module's own: a plain torch AdamW, DP gradient averaging with one flat
all-reduce, and for PP>1 a GPipe schedule with gloo send/recv between stages (all forwards, then all
backwards). On CUDA the same loop uses megatron-core's DistributedDataParallel, `get_megatron_optimizer`
(`--use-distributed-optimizer` included) and `get_forward_backward_func` schedules.
"""
from __future__ import annotations

import datetime
import os
import time

import torch
import torch.distributed as dist

from megatron.core import parallel_state as ps

from .checkpointing import Checkpointer, print_rank_0, print_rank_last
from .data import MicroBatches, build_dataset
from .initialize import initialize_megatron


# ----- optimizer -----

def _param_groups(model):
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if (p.ndim == 1 or name.endswith(".bias")) else decay).append(p)
    groups = [{"params": decay, "wd_mult": 1.0}, {"params": no_decay, "wd_mult": 0.0}]
    return [g for g in groups if g["params"]]


def build_scheduler(args, optimizer):
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    gbs = args.global_batch_size
    return OptimizerParamScheduler(
        optimizer, init_lr=args.lr_warmup_init, max_lr=args.lr, min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_iters * gbs, lr_decay_steps=args.lr_decay_iters * gbs,
        lr_decay_style=args.lr_decay_style, start_wd=args.weight_decay, end_wd=args.weight_decay,
        wd_incr_steps=args.train_iters * gbs, wd_incr_style="constant")


def setup_model_and_optimizer(args, model_provider):
    model = model_provider(pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage())
    if args.device.type == "cuda":
        return _setup_cuda(args, model)
    optimizer = torch.optim.AdamW(_param_groups(model), lr=args.lr, betas=(args.adam_beta1, args.adam_beta2),
                                  eps=args.adam_eps, weight_decay=args.weight_decay, foreach=False)
    return model, optimizer, build_scheduler(args, optimizer)


def _setup_cuda(args, model):
    """megatron-core's DDP wrapper, optimizer (distributed optimizer included) and schedules."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    model.cuda(torch.cuda.current_device())
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=args.overlap_grad_reduce,
        overlap_param_gather=args.overlap_param_gather, use_distributed_optimizer=args.use_distributed_optimizer)
    model = DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)
    opt_config = OptimizerConfig(
        optimizer="adam", lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_eps=args.adam_eps,
        clip_grad=args.clip_grad, bf16=args.bf16, fp16=args.fp16, params_dtype=model.config.params_dtype,
        use_distributed_optimizer=args.use_distributed_optimizer)
    optimizer = get_megatron_optimizer(opt_config, [model])
    return model, optimizer, build_scheduler(args, optimizer)


# ----- CPU step -----

def _allreduce_grads(model, args):
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    if ps.get_pipeline_model_parallel_world_size() > 1 and ps.is_rank_in_embedding_group() and \
            getattr(model, "share_embeddings_and_output_weights", False) and \
            (ps.is_pipeline_first_stage() or ps.is_pipeline_last_stage()):
        w = model.shared_embedding_or_output_weight()
        dist.all_reduce(w.grad, group=ps.get_embedding_group())
    if args.data_parallel_size > 1:
        grads = [p.grad for p in params]
        flat = torch._utils._flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=ps.get_data_parallel_group())
        flat.div_(args.data_parallel_size)
        for g, f in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
            g.copy_(f)


def _clip_grads(model, max_norm: float) -> float:
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
    sq = torch.zeros((), dtype=torch.float64)
    params = [p for p in model.parameters() if p.grad is not None]
    for p in params:
        if getattr(p, "shared", False) or not param_is_not_tensor_parallel_duplicate(p):
            continue
        sq += p.grad.double().pow(2).sum()
    dist.all_reduce(sq, group=ps.get_model_parallel_group())
    norm = float(sq.sqrt())
    if max_norm > 0:
        coef = max_norm / (norm + 1e-6)
        if coef < 1.0:
            for p in params:
                p.grad.mul_(coef)
    return norm


def _forward_backward_cpu(args, model, forward_step_func, batches, consumed):
    """All micro-batches of one iteration; PP>1: GPipe over gloo send/recv. Returns the reported losses."""
    nmb = args.num_microbatches
    pp = ps.get_pipeline_model_parallel_world_size()
    first, last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
    shape = (args.seq_length, args.micro_batch_size, args.hidden_size)
    reported, saved = [], []
    for m in range(nmb):
        it = iter([batches.get(consumed, m)])
        inp = None
        if pp > 1 and not first:
            inp = torch.empty(shape, dtype=torch.float32)
            dist.recv(inp, src=ps.get_pipeline_model_parallel_prev_rank())
            inp.requires_grad_(True)
        if pp > 1:
            model.set_input_tensor(inp)
        out, loss_func = forward_step_func(it, model)
        if last:
            loss, rep = loss_func(out)
            out = loss / nmb
            reported.append(rep)
        elif pp > 1:
            dist.send(out.detach().contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
        if pp == 1:
            out.backward()
        else:
            saved.append((inp, out))
    for inp, out in reversed(saved) if pp > 1 else []:
        if last:
            out.backward()
        else:
            grad = torch.empty(shape, dtype=torch.float32)
            dist.recv(grad, src=ps.get_pipeline_model_parallel_next_rank())
            out.backward(grad)
        if not first:
            dist.send(inp.grad.contiguous(), dst=ps.get_pipeline_model_parallel_prev_rank())
    return reported


def _reduce_losses(args, reported):
    """Mean over micro-batches, then over DP ranks (last pipeline stage only)."""
    if not reported:
        return {}
    out = {}
    for key in reported[0]:
        v = torch.stack([r[key].detach().float().reshape(()) for r in reported]).mean()
        if args.data_parallel_size > 1:
            dist.all_reduce(v, group=ps.get_data_parallel_group())
            v = v / args.data_parallel_size
        out[key] = v.item()
    return out


def train_step_cpu(args, model, optimizer, scheduler, forward_step_func, batches, consumed, checkpointer):
    optimizer.zero_grad(set_to_none=True)  # gradients are not part of the checkpoint
    reported = _forward_backward_cpu(args, model, forward_step_func, batches, consumed)
    _allreduce_grads(model, args)
    grad_norm = _clip_grads(model, args.clip_grad)
    checkpointer.fence()  # the optimizer step below mutates params and optimizer state: snapshots must be done
    optimizer.step()
    scheduler.step(increment=args.global_batch_size)
    return _reduce_losses(args, reported), grad_norm


def train_step_cuda(args, model, optimizer, scheduler, forward_step_func, batches, consumed, checkpointer):
    from megatron.core.pipeline_parallel import get_forward_backward_func
    if args.overlap_param_gather:
        checkpointer.fence()  # the param all-gather of the forward pass overwrites params
    model.zero_grad_buffer()
    optimizer.zero_grad()
    data = iter([batches.get(consumed, m) for m in range(args.num_microbatches)])
    reported = get_forward_backward_func()(
        forward_step_func=forward_step_func, data_iterator=data, model=[model],
        num_microbatches=args.num_microbatches, seq_length=args.seq_length, micro_batch_size=args.micro_batch_size,
        forward_only=False)
    checkpointer.fence()
    ok, grad_norm, _ = optimizer.step()
    if ok:
        scheduler.step(increment=args.global_batch_size)
    return _reduce_losses(args, reported if ps.is_pipeline_last_stage() else []), grad_norm


# ----- loop -----

def train(args, model, optimizer, scheduler, forward_step_func, dataset, checkpointer, iteration, consumed):
    batches = MicroBatches(dataset, args.micro_batch_size, ps.get_data_parallel_rank(),
                           ps.get_data_parallel_world_size(), device=args.device)
    step = train_step_cuda if args.device.type == "cuda" else train_step_cpu
    model.train()
    saved_last = None
    start = iteration
    t_last = time.perf_counter()
    while iteration < args.train_iters:
        losses, grad_norm = step(args, model, optimizer, scheduler, forward_step_func, batches, consumed,
                                 checkpointer)
        iteration += 1
        consumed += args.global_batch_size
        if iteration % args.log_interval == 0:
            now = time.perf_counter()
            elapsed = (now - t_last) * 1e3 / args.log_interval
            t_last = now
            lr = optimizer.param_groups[0]["lr"]
            line = (f" [{datetime.datetime.now():%Y-%m-%d %H:%M:%S}] iteration {iteration:8d}/{args.train_iters:8d} |"
                    f" consumed samples: {consumed:12d} | elapsed time per iteration (ms): {elapsed:.1f} |"
                    f" learning rate: {lr:.6E} | global batch size: {args.global_batch_size:5d} |")
            for k, v in losses.items():
                line += f" {k}: {v!r} |"
            line += f" grad norm: {grad_norm:.6f} |"
            print_rank_last(line)
        if args.save and args.save_interval and iteration % args.save_interval == 0:
            checkpointer.save(iteration, consumed)
            saved_last = iteration
        elif args.non_persistent_save_interval and iteration % args.non_persistent_save_interval == 0:
            checkpointer.save_local(iteration, consumed)  # storage has this iteration already otherwise
        checkpointer.poll()
        if args.exit_interval and iteration % args.exit_interval == 0:
            if args.save and saved_last != iteration:
                checkpointer.save(iteration, consumed)
                saved_last = iteration
            print_rank_0(f"exiting program at iteration {iteration}")
            break
    else:
        # Megatron saves once more at the end of training when the last iteration was not a save point.
        if args.save and iteration > start and saved_last != iteration:
            checkpointer.save(iteration, consumed)
    return iteration


def pretrain(train_valid_test_dataset_provider, model_provider, model_type=None, forward_step_func=None,
             extra_args_provider=None, args_defaults=None, argv=None):
    """Megatron's entry point: initialize, build, load, train, finish every checkpoint."""
    args = initialize_megatron(extra_args_provider, argv)
    print_rank_0(f"> world size {args.world_size}: tensor-parallel {args.tensor_model_parallel_size}, "
                 f"pipeline-parallel {args.pipeline_model_parallel_size}, data-parallel {args.data_parallel_size}, "
                 f"{args.num_microbatches} micro-batch(es) per iteration, device {args.device}")
    model, optimizer, scheduler = setup_model_and_optimizer(args, model_provider)
    checkpointer = Checkpointer(args, model.module if hasattr(model, "module") else model, optimizer, scheduler)
    try:
        iteration, consumed = checkpointer.load()
        if args.save_after_load:
            if iteration > 0:
                checkpointer.save(iteration, consumed)
            else:
                print_rank_0("WARNING: --save-after-load: nothing was loaded at iteration > 0, nothing saved")
        dataset = (train_valid_test_dataset_provider(args) if train_valid_test_dataset_provider
                   else build_dataset(args))
        iteration = train(args, model, optimizer, scheduler, forward_step_func, dataset, checkpointer,
                          iteration, consumed)
        checkpointer.finalize()
    finally:
        checkpointer.close()
    dist.barrier()
    if iteration >= args.train_iters:
        checkpointer.remove_memory_tier()  # the job is finished: its restart point in memory is not needed
    print_rank_0(f"> training done at iteration {iteration}")
    return iteration
