"""Megatron's logging helpers (`datastates.logs` decides which ranks' lines are shown)."""
import logging

import torch

log = logging.getLogger(__name__)


def print_rank_0(msg: str) -> None:
    """Megatron's name for an INFO line of rank 0 (`datastates.logs` shows rank 0's INFO by default)."""
    log.info(msg)


def print_rank_last(msg: str) -> None:
    """An INFO line of the last rank (where the loss is known with PP), shown whatever rank it is."""
    if not torch.distributed.is_initialized() or \
            torch.distributed.get_rank() == torch.distributed.get_world_size() - 1:
        log.info(msg, extra={"any_rank": True})
