"""Runs pretrain_gpt.py with faults injected from the test side, never from production code.

torchrun starts this script instead of pretrain_gpt.py; it wraps `CheckpointEngine.save` before the trainer
runs. Environment (iterations are checkpoint iterations, read from the checkpoint directory's name):

    FAULT_SLOW_SAVE=<it>:<seconds>   the save of <it> pickles an extra object that takes that long, on the
                                     engine's background pickler: it stays in flight
    FAULT_KILL_AFTER_SAVE=<it>       once the earlier saves are done, SIGKILL this process right after the save
                                     call of <it> returns (prints FAULT-KILL first)
    FAULT_FAIL_SAVE=<rank>:<it>      on that rank only, the save of <it> fails (an unpicklable object)
    FAULT_KILL_JOB_AFTER_LOCAL=<it>  once every rank's memory-tier checkpoint of <it> is saved and replicated,
                                     SIGKILL the whole job: the launcher (torchrun) and every worker
"""
import os
import runpy
import signal
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from datastates import CheckpointEngine, layout  # noqa: E402
from datastates.memory_tier import LocalTier  # noqa: E402


class _SlowPickle:
    def __init__(self, seconds: float):
        self.seconds = seconds

    def __reduce__(self):
        time.sleep(self.seconds)
        return (int, (0,))


def _spec(name):
    value = os.environ.get(name)
    return [float(x) if "." in x else int(x) for x in value.split(":")] if value else None


_save = CheckpointEngine.save


def save(self, state, path, from_save=None):
    it = layout.iteration_of(path)
    slow, kill, fail = _spec("FAULT_SLOW_SAVE"), _spec("FAULT_KILL_AFTER_SAVE"), _spec("FAULT_FAIL_SAVE")
    if slow and slow[0] == it:
        state = dict(state, _fault_slow=_SlowPickle(slow[1]))
    if fail and fail == [self.rank, it]:
        state = dict(state, _fault_fail=lambda: None)
    if kill and kill[0] == it:
        self.wait()  # exactly the save of <it> is in flight when the process dies
    handle = _save(self, state, path, from_save=from_save)
    if kill and kill[0] == it:
        print(f"FAULT-KILL rank {self.rank} after the save call of iteration {it}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    return handle


_replicate = LocalTier.replicate


def replicate(self, iteration, handle):
    _replicate(self, iteration, handle)
    kill = _spec("FAULT_KILL_JOB_AFTER_LOCAL")
    if kill and kill[0] == iteration:
        import torch.distributed as dist
        handle.wait()
        self.drain()  # this rank's part is in its clique's memory
        dist.barrier()  # ... on every rank
        print(f"FAULT-KILL-JOB rank {self.rank} after the memory checkpoint of iteration {iteration}", flush=True)
        if self.rank == 0:
            os.kill(os.getppid(), signal.SIGKILL)  # the launcher: it must not restart or clean anything
        os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    CheckpointEngine.save = save
    LocalTier.replicate = replicate
    script = os.path.join(os.path.dirname(HERE), "pretrain_gpt.py")
    sys.argv = [script] + sys.argv[1:]
    runpy.run_path(script, run_name="__main__")
