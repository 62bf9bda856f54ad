"""--profile over iterations [--profile-step-start, --profile-step-end) on --profile-ranks, as upstream: with
--use-pytorch-profiler, torch.profiler traced into --tensorboard-dir (TensorBoard's profiler plugin reads it);
without it, CUDA's profiler API is started and stopped for an enclosing `nsys profile --capture-range=cudaProfilerApi`
(CUDA ranks only: argument_checks refuses it on CPU ranks)."""
from __future__ import annotations

import torch


class Profiler:
    def __init__(self, args, rank: int):
        self.profiler, self.nsys = None, None
        if not (args.profile and rank in args.profile_ranks):
            return
        start, end = args.profile_step_start, args.profile_step_end
        if not args.use_pytorch_profiler:
            self.nsys = (start, end)
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if args.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.profiler = torch.profiler.profile(
            activities=activities, schedule=torch.profiler.schedule(wait=max(0, start - 1), warmup=1 if start else 0,
                                                                    active=end - start, repeat=1),
            on_trace_ready=torch.profiler.tensorboard_trace_handler(args.tensorboard_dir), record_shapes=True)
        self.profiler.start()

    def step(self, iteration: int) -> None:
        """After each iteration (torch.profiler's schedule counts them from the first of this run)."""
        if self.profiler is not None:
            self.profiler.step()
        elif self.nsys is not None:
            if iteration == self.nsys[0]:
                torch.cuda.cudart().cudaProfilerStart()
            elif iteration == self.nsys[1]:
                torch.cuda.cudart().cudaProfilerStop()

    def close(self) -> None:
        if self.profiler is not None:
            self.profiler.stop()
            self.profiler = None
