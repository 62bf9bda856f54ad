"""failures.stage, in-process, with the errors the engine and torch.distributed really raise: a checkpoint wait that
ran out (the engine's agreement, rank 1 never reporting), a collective that timed out (a store wait past its
bound) and a lost peer (the store's server gone) each become a RankFailure naming this rank, the stage and the
bound; any other error passes through unchanged (the same object)."""
import datetime
import re

import pytest
import torch.distributed as dist

from datastates import CheckpointTimeoutError
from datastates.coordination import Coordinator
from megatron.training.failures import RankFailure, stage

WHAT = "iteration 7"


def _checkpoint_wait_ran_out():
    rank0 = Coordinator(dist.HashStore(), rank=0, world_size=2)
    rank0.report(1, {}, None)  # its own part written; rank 1's never comes
    rank0.await_reports(1, "the checkpoint of iteration 6", 0.05)


def _collective_timed_out():
    dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False).wait(
        ["peer"], datetime.timedelta(milliseconds=50))


def _peer_lost():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=datetime.timedelta(seconds=30))
    del server  # the rank that hosted it is gone: its connections close
    client.get("peer")


@pytest.mark.parametrize("fail, cause, message", [
    (_checkpoint_wait_ran_out, CheckpointTimeoutError,
     r"rank 0: iteration 7 did not finish: a checkpoint wait ran out \(--ckpt-publish-timeout-s\): the checkpoint "
     r"of iteration 6 not published: rank\(s\) \[1\] did not finish within 0.05 s"),
    (_collective_timed_out, dist.DistStoreError,
     r"rank 0: iteration 7 did not finish: a collective waited longer than --distributed-timeout-minutes 0.5 "
     r"\(another rank is hung\): wait timeout after 50ms"),
    (_peer_lost, dist.DistNetworkError,
     r"rank 0: iteration 7 did not finish: another rank died or closed its connections: .*closed"),
], ids=["checkpoint wait ran out", "collective timed out", "peer lost"])
def test_a_failure_of_the_other_ranks_names_this_rank_the_stage_and_the_bound(gloo, fail, cause, message):
    with pytest.raises(RankFailure, match=f"^{message}") as failed:
        with stage(WHAT, 0.5, grace_s=0):
            fail()
    assert isinstance(failed.value.__cause__, cause)


@pytest.mark.parametrize("error", [ValueError("a bad value"), RuntimeError("a rank's own bug"),
                                   RankFailure("rank 1: iteration 3 did not finish: ...")],
                         ids=["ValueError", "RuntimeError", "RankFailure"])
def test_any_other_error_passes_through_unchanged(error):
    with pytest.raises(type(error), match=f"^{re.escape(str(error))}$") as raised:
        with stage(WHAT, 0.5, grace_s=0):
            raise error
    assert raised.value is error
