"""--profile --use-pytorch-profiler: torch.profiler over iterations [--profile-step-start, --profile-step-end) on
--profile-ranks, traced into --tensorboard-dir (TensorBoard's profiler plugin reads it), as upstream does."""
from __future__ import annotations

import torch


class Profiler:
    def __init__(self, args, rank: int):
        self.profiler = None
        if not (args.profile and args.use_pytorch_profiler and rank in args.profile_ranks):
            return
        start, end = args.profile_step_start, args.profile_step_end
        activities = [torch.profiler.ProfilerActivity.CPU]
        if args.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.profiler = torch.profiler.profile(
            activities=activities, schedule=torch.profiler.schedule(wait=max(0, start - 1), warmup=1 if start else 0,
                                                                    active=end - start, repeat=1),
            on_trace_ready=torch.profiler.tensorboard_trace_handler(args.tensorboard_dir), record_shapes=True)
        self.profiler.start()

    def step(self) -> None:
        """After each iteration (the schedule counts them from the first of this run)."""
        if self.profiler is not None:
            self.profiler.step()

    def close(self) -> None:
        if self.profiler is not None:
            self.profiler.stop()
            self.profiler = None
