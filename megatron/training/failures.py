"""A rank whose peers failed ends with an error naming itself and its stage, so torchrun restarts the job.

A dead rank closes its connections: the others' collectives fail at once. A hung rank (alive, stuck in a
collective of its own or in I/O) makes the others' collectives wait until --distributed-timeout-minutes, and a
checkpoint wait until the checkpoint timeouts (--ckpt-publish-timeout-s); `stage` turns either into a
RankFailure that names the rank, the stage and the bound, and the worker exits with it. torchrun then stops the
rest of the group (the hung rank too) and restarts it when --max-restarts allows.
"""
from __future__ import annotations

import contextlib
import time

import torch.distributed as dist

from datastates import CheckpointTimeoutError

# A rank that lost a peer waits this long before it fails: the peer that died first has exited by then and
# torchrun, which polls its workers every --monitor-interval (0.1 s), stops this rank and reports the peer's
# failure as the job's first one rather than this consequence of it.
LOST_PEER_GRACE_S = 2.0


class RankFailure(RuntimeError):
    """This rank cannot go on: another rank died, hung, or did not finish its part of a checkpoint in time."""


def _rank() -> int | str:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else "?"


def _is_communication(error: BaseException) -> bool:
    """A collective or a connection between ranks failed (NCCL raises DistError; gloo a RuntimeError of its own)."""
    return isinstance(error, dist.DistError) or (isinstance(error, RuntimeError) and "gloo" in str(error))


@contextlib.contextmanager
def stage(what: str, timeout_minutes: float, grace_s: float = LOST_PEER_GRACE_S):
    """Re-raise a failure of the other ranks during `what` as a RankFailure naming this rank, `what` and the
    bound that ended the wait; any other error passes through unchanged. A lost peer is reported `grace_s` later
    (LOST_PEER_GRACE_S: torchrun has seen the peer's own failure first; a test that owns no torchrun passes 0)."""
    try:
        yield
    except CheckpointTimeoutError as e:
        raise RankFailure(f"rank {_rank()}: {what} did not finish: a checkpoint wait ran out "
                          f"(--ckpt-publish-timeout-s): {e}") from e
    except RuntimeError as e:
        if isinstance(e, RankFailure) or not _is_communication(e):
            raise
        cause = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if "timed out" in cause.lower() or "timeout" in cause.lower():
            raise RankFailure(f"rank {_rank()}: {what} did not finish: a collective waited longer than "
                              f"--distributed-timeout-minutes {timeout_minutes:g} (another rank is hung): "
                              f"{cause}") from e
        time.sleep(grace_s)
        raise RankFailure(f"rank {_rank()}: {what} did not finish: another rank died or closed its connections: "
                          f"{cause}") from e
