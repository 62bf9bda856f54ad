"""When a run stops before --train-iters: --exit-signal-handler (SIGTERM) and --exit-duration-in-mins.

Slurm sends SIGTERM before a time limit or a preemption (torchrun forwards it to its workers). With
--exit-signal-handler the signal only raises a flag; at the end of the iteration the ranks agree (one MAX
all-reduce, also carrying the duration check) and, if any rank was signalled or the run is over its duration,
every rank stops at that same iteration: the loop saves it, waits until the checkpoint is published, and the
job exits 0. Agreeing matters: ranks receive the signal at different moments, and a rank that stopped alone
would leave the others waiting in a collective.
"""
from __future__ import annotations

import signal
import time

import torch


class ExitConditions:
    def __init__(self, args, start_time: float):
        self.args, self.start_time = args, start_time
        self.signalled = None
        if args.exit_signal_handler:
            signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        self.signalled = signal.Signals(signum).name

    def reason(self) -> str | None:
        """Why every rank stops after this iteration, or None; a collective when a condition is configured."""
        args = self.args
        if not (args.exit_signal_handler or args.exit_duration_in_mins):
            return None
        minutes = (time.time() - self.start_time) / 60.0
        over = bool(args.exit_duration_in_mins) and minutes > args.exit_duration_in_mins
        flags = torch.tensor([float(self.signalled is not None), float(over)], device=args.device)
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX)
        if flags[0].item():
            return f"{self.signalled or 'a signal'} received (--exit-signal-handler)"
        if flags[1].item():
            return f"the run is past --exit-duration-in-mins {args.exit_duration_in_mins:g}"
        return None

    def close(self) -> None:
        if self.args.exit_signal_handler:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
