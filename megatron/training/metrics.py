"""Training metrics to TensorBoard (--tensorboard-dir) and Weights & Biases (--wandb-project), as upstream logs them.

Written by the last rank, where the loss is known with pipeline parallelism (upstream's choice too). Scalars
keep upstream's names (`lm loss`, `learning-rate`, `grad-norm`, `iteration-time`, `batch-size`, `lm loss
validation`); each checkpoint adds its training stall and its time to durable (`checkpoint/stall-ms`,
`checkpoint/durable-ms`, the memory tier's under `memory-checkpoint/`) at the checkpoint's iteration.

W&B runs offline unless the environment says otherwise (`WANDB_MODE`, or an API key to log in with): a job on
nodes without network must never wait for a login. The offline run directory syncs later with `wandb sync`.
"""
from __future__ import annotations

import os

import torch

from datastates.paths import scheme as url_scheme


class Metrics:
    """Scalars of the run, by iteration; a no-op on every rank but the last, and when no sink is configured."""

    def __init__(self, args):
        self.tensorboard = self.wandb = None
        self.interval = args.tensorboard_log_interval
        self.wanted = bool(args.tensorboard_dir or args.wandb_project)  # the same on every rank
        self.unagreed: list[tuple[str, int, float]] = []  # (prefix, iteration, stall ms) of this rank's checkpoints
        if torch.distributed.is_initialized() and \
                torch.distributed.get_rank() != torch.distributed.get_world_size() - 1:
            return
        if args.tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter
            self.tensorboard = SummaryWriter(log_dir=args.tensorboard_dir, max_queue=args.tensorboard_queue_size)
        if args.wandb_project:
            self.wandb = _wandb_run(args)

    def log(self, iteration: int, scalars: dict, every_iteration: bool = False) -> None:
        """Write `scalars` at `iteration` (training scalars only every --tensorboard-log-interval)."""
        if not every_iteration and iteration % self.interval:
            return
        if self.tensorboard is not None:
            for name, value in scalars.items():
                self.tensorboard.add_scalar(name, value, iteration)
        if self.wandb is not None:
            self.wandb.log(scalars, step=iteration)

    def log_checkpoint(self, iteration: int, record: dict) -> None:
        """One finished checkpoint of this rank (a record of the checkpoint manager), at the run's `iteration`."""
        prefix = _prefix(record)
        if self.wanted:
            self.unagreed.append((prefix, record["iteration"], record["stall_ms"]))
        self.log(iteration, {f"{prefix}/stall-ms": record["stall_ms"], f"{prefix}/durable-ms": record["durable_ms"],
                             f"{prefix}/iteration": record["iteration"]}, every_iteration=True)

    def log_slowest(self, iteration: int) -> None:
        """The slowest rank's stall of each checkpoint every rank has finished, at the run's `iteration`. A
        collective: every rank calls it at the same points (a save, the end of training)."""
        if not self.wanted or not torch.distributed.is_initialized():
            return
        ranks = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(ranks, self.unagreed)
        everywhere = set.intersection(*({(p, i) for p, i, _ in r} for r in ranks))
        for prefix, it in sorted(everywhere, key=lambda k: k[1]):
            slowest = max(ms for r in ranks for p, i, ms in r if (p, i) == (prefix, it))
            self.log(iteration, {f"{prefix}/slowest-stall-ms": slowest, f"{prefix}/iteration": it},
                     every_iteration=True)
        self.unagreed = [u for u in self.unagreed if u[:2] not in everywhere]

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish()


def _prefix(record: dict) -> str:
    return "memory-checkpoint" if record["tier"] == "memory" else "checkpoint"


def _wandb_run(args):
    import wandb
    mode = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
    local_save = args.save is not None and url_scheme(args.save) is None
    save_dir = args.wandb_save_dir or (os.path.join(args.save, "wandb") if local_save else "wandb")
    os.makedirs(save_dir, exist_ok=True)
    return wandb.init(project=args.wandb_project, name=args.wandb_exp_name or None, dir=save_dir, mode=mode,
                      config={k: v for k, v in vars(args).items() if isinstance(v, (str, int, float, bool))})
