"""Runs pretrain_gpt.py with faults injected from the test side, never from production code.

torchrun starts this script instead of pretrain_gpt.py; it wraps `CheckpointEngine.save` before the trainer
runs. Environment (iterations are checkpoint iterations, read from the checkpoint directory's name):

    FAULT_SLOW_SAVE=<it>:<seconds>   the save of <it> pickles an extra object that takes that long, on the
                                     engine's background pickler: it stays in flight
    FAULT_KILL_AFTER_SAVE=<it>       once the earlier saves are done, SIGKILL this process right after the save
                                     call of <it> returns (prints FAULT-KILL first)
    FAULT_FAIL_SAVE=<rank>:<it>      on that rank only, the save of <it> fails (an unpicklable object)
    FAULT_FAIL_PREPARE=<rank>:<it>,...  on those ranks only, the save of <it> is refused at its call: making its
                                     directory fails (an OSError, EACCES)
    FAULT_FAIL_CLOSE=<rank>:<it>:<s> on that rank only, the save of <it> fails when its data file is closed (every
                                     byte written), after <s> seconds: an OSError (EIO)
    FAULT_KILL_JOB_AFTER_LOCAL=<it>  once every rank's memory-tier checkpoint of <it> is saved and replicated,
                                     and every save to storage before it has ended, SIGKILL the whole job: the
                                     launcher (torchrun) and every worker
    FAULT_KILL_NODE_AFTER_LOCAL=<node>:<it>  as FAULT_KILL_JOB_AFTER_LOCAL, but only the ranks of torchrun node
                                     <node> (GROUP_RANK) SIGKILL their agent and themselves: a node lost, the
                                     other nodes' ranks go on into <it>+1 (tests/test_elastic.py)
    FAULT_WAIT_AFTER_LOCAL=<world>:<it>  in a world of that many ranks, once every rank's memory checkpoint of
                                     <it> is saved (and every earlier storage save ended), every rank waits (prints
                                     FAULT-WAIT first) until its agent restarts it, e.g. for a node that joins (at
                                     most 300 s, then it goes on)
    FAULT_KILL_JOB_IN_UPLOAD=<it>    (s3://) once the earlier saves are published (the tracker names the last)
                                     and the parts of a rank's data object of <it> are up, before the upload
                                     completes, that rank SIGKILLs itself (rank 0 the launcher first)
    FAULT_STORE_DOWN=<it>:<it2>      (s3://) once the earlier saves are published and rank 0's data parts of <it>
                                     are up, the test kills the store; the save of <it>+1 is called with it down;
                                     before the save of <it2>, when the saves in flight have ended, it starts it
                                     again; rank 0 asks through files in FAULT_CONTROL_DIR (tests/test_s3_trainer.py)

Faults in a training step, for restarts inside one torchrun job (tests/test_restarts.py); <attempt> is
torchrun's TORCHELASTIC_RESTART_COUNT, "*" any attempt. They fire right before the optimizer step of <it> (its
forward/backward done), where the memory save of <it>-1 may still be copying:

    FAULT_KILL_IN_STEP=<rank>:<it>:<attempt>   that rank SIGKILLs itself (prints FAULT-KILL-STEP first)
    FAULT_HANG_IN_STEP=<rank>:<it>:<attempt>   that rank stops making progress (sleeps; prints FAULT-HANG-STEP)
    FAULT_FAIL_IN_STEP=<rank>:<it>:<attempt>   that rank raises RuntimeError("injected failure ...")

A fault in a --save-hf export, at a named point of the export of <it>'s model (tests/test_hf_publish.py):

    FAULT_KILL_IN_EXPORT=<it>:<point>   the rank at <point> SIGKILLs itself (prints FAULT-KILL-EXPORT first):
                                        first-file (a safetensors file of the model written and closed),
                                        index (before the index is written), pointer (before `latest` names it),
                                        retention (`latest` names it, --save-hf-keep-last retires nothing yet)

With FAULT_LOG_SAMPLES=1 every rank prints the sample indices of each micro-batch it reads, as it reads it
(`FAULT-SAMPLES rank <r> attempt <a>: <i> <i> ...`), so that a test can check the data position across a restart.

An s3:// data object of an iteration these two name goes up in 256 KiB parts, so that a tiny model's upload is a
multipart upload with parts in flight (one that completes would break S3's 5 MiB minimum part).
"""
import errno
import os
import runpy
import signal
import sys
import time
from concurrent.futures import wait

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from datastates import CheckpointEngine, paths  # noqa: E402
from datastates.memory_tier import LocalTier  # noqa: E402
from datastates.storage.s3 import MultipartSink  # noqa: E402
from datastates.storage.posix import FileSink  # noqa: E402
from datastates.save_root import Publisher, SaveRoot  # noqa: E402
from megatron.training.checkpointing import CheckpointManager, hf_models  # noqa: E402
from datastates.hf import writer as hf_writer  # noqa: E402
from megatron.training.data import RankSampler  # noqa: E402


class _SlowPickle:
    def __init__(self, seconds: float):
        self.seconds = seconds

    def __reduce__(self):
        time.sleep(self.seconds)
        return (int, (0,))


def _spec(name):
    value = os.environ.get(name)
    return [float(x) if "." in x else int(x) for x in value.split(":")] if value else None


# torchrun's agent, read at start: once it is killed, getppid() names whichever process adopted this one
_AGENT = os.getppid()
_save = CheckpointEngine.save
_engines = []  # every engine that saved, in the order of their first saves


def _ask_test(request: str) -> None:
    """Rank 0 asks the test to do `request` (a file in FAULT_CONTROL_DIR) and waits until it says done."""
    directory = os.environ["FAULT_CONTROL_DIR"]
    open(os.path.join(directory, request), "w").close()
    while not os.path.exists(os.path.join(directory, request + ".done")):
        time.sleep(0.05)


def _until_saves_end(engine) -> None:
    """Wait for the saves in flight without taking their handles: they stay the trainer's to report."""
    while not all(h.done() for h in engine._pending):
        time.sleep(0.05)


def save(self, state, path, from_save=None, keep=None):
    if self not in _engines:
        _engines.append(self)
    it = paths.iteration_of(path)
    slow, kill, fail = _spec("FAULT_SLOW_SAVE"), _spec("FAULT_KILL_AFTER_SAVE"), _spec("FAULT_FAIL_SAVE")
    down, kill_up = _spec("FAULT_STORE_DOWN"), _spec("FAULT_KILL_JOB_IN_UPLOAD")
    if (down and down[0] == it) or (kill_up and kill_up[0] == it):
        _until_saves_end(self)  # the earlier saves are published before the store dies or the job is killed
    if down and down[0] + 1 == it:  # this save is called with the store down
        while not os.path.exists(os.path.join(os.environ["FAULT_CONTROL_DIR"], "store-down.done")):
            time.sleep(0.05)
    if down and down[1] == it:
        import torch.distributed as dist
        _until_saves_end(self)
        if self.rank == 0:
            _ask_test("store-up")
        dist.barrier()
    if slow and slow[0] == it:
        state = dict(state, _fault_slow=_SlowPickle(slow[1]))
    if fail and fail == [self.rank, it]:
        state = dict(state, _fault_fail=lambda: None)
    if kill and kill[0] == it:
        self.wait()  # exactly the save of <it> is in flight when the process dies
    handle = _save(self, state, path, from_save=from_save, keep=keep)
    if kill and kill[0] == it:
        print(f"FAULT-KILL rank {self.rank} after the save call of iteration {it}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    return handle


_replicate = LocalTier.replicate


def replicate(self, iteration, handle):
    _replicate(self, iteration, handle)
    kill, node = _spec("FAULT_KILL_JOB_AFTER_LOCAL"), _spec("FAULT_KILL_NODE_AFTER_LOCAL")
    pause = _spec("FAULT_WAIT_AFTER_LOCAL")
    if pause and pause == [int(os.environ["WORLD_SIZE"]), iteration]:
        _until_held_everywhere(self, handle, iteration)
        print(f"FAULT-WAIT rank {self.rank} after the memory checkpoint of iteration {iteration}", flush=True)
        time.sleep(300)
    if kill and kill[0] == iteration:
        _until_held_everywhere(self, handle, iteration)
        print(f"FAULT-KILL-JOB rank {self.rank} after the memory checkpoint of iteration {iteration}", flush=True)
        if self.rank == 0:
            os.kill(os.getppid(), signal.SIGKILL)  # the launcher: it must not restart or clean anything
        os.kill(os.getpid(), signal.SIGKILL)
    if node and node[1] == iteration and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
        _until_held_everywhere(self, handle, iteration)
        if int(os.environ["GROUP_RANK"]) == node[0]:
            print(f"FAULT-KILL-NODE {node[0]} rank {self.rank} after the memory checkpoint of iteration "
                  f"{iteration} at {time.time():.3f}", flush=True)  # the time: when the node was lost
            try:
                os.kill(_AGENT, signal.SIGKILL)  # the node's agent (its other rank may have killed it already)
            except ProcessLookupError:
                pass
            os.kill(os.getpid(), signal.SIGKILL)


def _until_held_everywhere(tier, handle, iteration) -> None:
    """Every rank's part of `iteration` is saved and in its clique's memory, and every earlier storage save
    has ended."""
    import torch.distributed as dist
    handle.wait()
    tier.drain()  # this rank's part is in its clique's memory
    for engine in _engines:  # the storage save of an earlier iteration has ended, however slow the disk is
        _until_saves_end(engine)
    dist.barrier()  # ... on every rank


def _faulted_upload(sink) -> str | None:
    """Which fault, if any, names the iteration of this data object."""
    it = paths.iteration_of(paths.parent(sink.path))
    kill, down = _spec("FAULT_KILL_JOB_IN_UPLOAD"), _spec("FAULT_STORE_DOWN")
    if kill and kill[0] == it:
        return "kill"
    if down and down[0] == it:
        return "down"
    return None


_sink_init, _sink_close = MultipartSink.__init__, MultipartSink.close


def sink_init(self, storage, url, nbytes):
    _sink_init(self, storage, url, nbytes)
    if _faulted_upload(self):
        self.part_bytes = 256 << 10


def sink_close(self, nbytes):
    fault, rank = _faulted_upload(self), int(os.environ["RANK"])
    if fault:
        wait([f for _, f in self.parts])  # the parts submitted so far are up
    if fault == "kill":
        print(f"FAULT-KILL-JOB rank {rank} with {len(self.parts)} parts of {self.path} up", flush=True)
        if rank == 0:
            os.kill(os.getppid(), signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)
    if fault == "down" and rank == 0:
        print(f"FAULT-STORE-DOWN with {len(self.parts)} parts of {self.path} up", flush=True)
        _ask_test("store-down")
    return _sink_close(self, nbytes)


_prepare = Publisher.prepare


def prepare(self, final):
    refused = {tuple(map(int, spec.split(":"))) for spec in os.environ.get("FAULT_FAIL_PREPARE", "").split(",") if spec}
    if (int(os.environ["RANK"]), paths.iteration_of(final)) in refused:
        raise OSError(errno.EACCES, "injected refusal", paths.partial_dir(final))
    return _prepare(self, final)


_file_close = FileSink.close


def file_close(self, nbytes):
    fail = _spec("FAULT_FAIL_CLOSE")
    if fail:
        checkpoint = os.path.dirname(self.path).removesuffix(paths.PARTIAL)
        if self.path.endswith(".data") and fail[:2] == [int(os.environ["RANK"]), paths.iteration_of(checkpoint)]:
            time.sleep(fail[2])
            raise OSError(errno.EIO, f"injected failure closing {self.path}")
    return _file_close(self, nbytes)


def _step_fault(name: str, rank: int, iteration: int) -> bool:
    value = os.environ.get(name)
    if not value:
        return False
    r, it, attempt = value.split(":")
    return (int(r), int(it)) == (rank, iteration) and attempt in ("*", os.environ.get("TORCHELASTIC_RESTART_COUNT"))


_load, _wait_for_snapshot = CheckpointManager.load, CheckpointManager.wait_for_snapshot


def load(self):
    loaded = _load(self)
    self._fault_iteration = loaded[0]
    return loaded


def wait_for_snapshot(self):
    self._fault_iteration += 1  # called once per iteration, right before its optimizer step
    it = self._fault_iteration
    if _step_fault("FAULT_KILL_IN_STEP", self.rank, it):
        print(f"FAULT-KILL-STEP rank {self.rank} in iteration {it}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    if _step_fault("FAULT_HANG_IN_STEP", self.rank, it):
        print(f"FAULT-HANG-STEP rank {self.rank} in iteration {it}", flush=True)
        while True:
            time.sleep(60)
    if _step_fault("FAULT_FAIL_IN_STEP", self.rank, it):
        raise RuntimeError(f"injected failure on rank {self.rank} in iteration {it}")
    return _wait_for_snapshot(self)


def _kill_in_export(point: str, path: str) -> None:
    """SIGKILL this process when FAULT_KILL_IN_EXPORT names `point` and `path` is in the model of its iteration."""
    spec = os.environ.get("FAULT_KILL_IN_EXPORT", "")
    it, _, at = spec.partition(":")
    if spec and at == point and f"iter_{int(it):07d}" in path:
        print(f"FAULT-KILL-EXPORT iteration {it} at {point}: {path}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


_close_after, _write_index, _point, _retain = (hf_writer._close_after, hf_models.write_index, SaveRoot.point,
                                               SaveRoot.retain)


def close_after(sink, writes, nbytes):
    _close_after(sink, writes, nbytes)
    _kill_in_export("first-file", getattr(sink, "path", ""))


def write_index(storage, directory, shards):
    _kill_in_export("index", directory)
    return _write_index(storage, directory, shards)


def point(self, iteration):
    if self.pointer == hf_models.POINTER:  # a Hugging Face models root's `latest`
        _kill_in_export("pointer", paths.checkpoint_name(iteration))
    return _point(self, iteration)


def retain(self, keep_last, protect):
    if self.pointer == hf_models.POINTER:
        _kill_in_export("retention", paths.checkpoint_name(protect))
    return _retain(self, keep_last, protect)


_sampler_iter = RankSampler.__iter__


def sampler_iter(self):
    rank, attempt = os.environ["RANK"], os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    for indices in _sampler_iter(self):
        sys.stdout.flush()  # then the line in one write: the node's other ranks write into the same log, and a line
        # a buffered print splits (its buffer full mid-line) took another rank's line inside it
        os.write(sys.stdout.fileno(), f"FAULT-SAMPLES rank {rank} attempt {attempt}: "
                                      f"{' '.join(map(str, indices))}\n".encode())
        yield indices


if __name__ == "__main__":
    CheckpointManager.load, CheckpointManager.wait_for_snapshot = load, wait_for_snapshot
    CheckpointEngine.save = save
    LocalTier.replicate = replicate
    MultipartSink.__init__, MultipartSink.close = sink_init, sink_close
    FileSink.close = file_close
    Publisher.prepare = prepare
    hf_writer._close_after, hf_models.write_index, SaveRoot.point, SaveRoot.retain = (close_after, write_index, point,
                                                                                       retain)
    if os.environ.get("FAULT_LOG_SAMPLES") == "1":
        RankSampler.__iter__ = sampler_iter

    script = os.path.join(os.path.dirname(HERE), "pretrain_gpt.py")
    sys.argv = [script] + sys.argv[1:]
    runpy.run_path(script, run_name="__main__")
