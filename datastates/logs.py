"""Rank-aware logging for the engine, the trainer and the tools.

Everything logs through `logging` under the `datastates` and `megatron.training` loggers. An application (the
trainer, a tool) calls `setup_logging()` once; a library user who does not keeps full control of `logging`.
By default only rank 0 speaks; `all_ranks=True` (or `DATASTATES_LOG_ALL_RANKS=1`) lets every rank speak, each
line prefixed with its rank. Warnings and errors are never filtered: a failure on rank 3 must be seen.
"""
from __future__ import annotations

import logging
import os
import sys

FORMAT = "%(asctime)s [rank %(rank)s] %(levelname)s %(name)s: %(message)s"
DATEFMT = "%H:%M:%S"


def _env_rank() -> int:
    for var in ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 0


class _RankFilter(logging.Filter):
    """Stamps each record with the rank; drops INFO and below on ranks other than 0 unless all ranks speak, or
    the record says it is meant for whichever rank logs it (`extra={"any_rank": True}`, e.g. the loss line
    that only the last pipeline stage knows)."""

    def __init__(self, rank: int, all_ranks: bool):
        super().__init__()
        self.rank, self.all_ranks = rank, all_ranks

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = self.rank
        return (self.all_ranks or self.rank == 0 or record.levelno >= logging.WARNING
                or getattr(record, "any_rank", False))


def setup_logging(rank: int | None = None, all_ranks: bool | None = None, level: int | str = logging.INFO,
                  stream=None) -> None:
    """Send the project's loggers to `stream` (stderr) with the rank in every line; idempotent."""
    rank = _env_rank() if rank is None else rank
    if all_ranks is None:
        all_ranks = os.environ.get("DATASTATES_LOG_ALL_RANKS", "") not in ("", "0")
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(logging.Formatter(FORMAT, DATEFMT))
    handler.addFilter(_RankFilter(rank, all_ranks))
    for name in ("datastates", "megatron.training", "tools", "benchmarks"):
        logger = logging.getLogger(name)
        for old in [h for h in logger.handlers if getattr(h, "_datastates", False)]:
            logger.removeHandler(old)
        handler._datastates = True
        logger.addHandler(handler)
        logger.setLevel(level)
        logger.propagate = False
