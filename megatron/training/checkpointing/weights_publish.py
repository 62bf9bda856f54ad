"""--publish-weights-dir: a policy version every --publish-weights-interval iterations, for rollout processes that
read it while training goes on (docs/rl-weights.md; readers: `datastates.weights`).

A version is --save-hf's export of a save's kept weights (`CheckpointEngine.save(keep=)`: the snapshot the save took
anyway, no second device-to-host copy) written into node-local shared memory instead of storage: the same plan,
pieces passed between the ranks on the export's own gloo group, the same safetensors bytes, on the export thread.
Its root (`weights_versions.VersionRoot`) renames it into place whole and replaces `latest` after it, and frees an
old version only when no reader leases it. A version is published as soon as every rank's weights are kept: it
does not wait for its checkpoint to be durable (the weights are whole then; a checkpoint that fails later does not
unmake them). A version whose weights were not kept (the staging budget held by versions still being written) is
dropped with a warning: training never waits for a version, nor for a reader.
"""
from __future__ import annotations

import argparse
import logging
import os
import threading

import torch

from datastates import default_store, storage_for

from .hf_job import ExportDropped
from .hf_publish import HFPublisher, check_save_hf
from .weights_versions import VersionRoot

log = logging.getLogger(__name__)

FLAG = "--publish-weights-dir"


def export_args(args) -> argparse.Namespace:
    """The run's flags as --save-hf's export takes them, aimed at the versions' root."""
    return argparse.Namespace(**{**vars(args), "save_hf": args.publish_weights_dir, "save_hf_tokenizer": None,
                                 "save_hf_interval": args.publish_weights_interval, "save_hf_keep_last": None,
                                 "save": args.save or args.publish_weights_dir})


class WeightsPublication:
    """One rank's publication of versions (collective at construction, as --save-hf's export queue is)."""

    def __init__(self, args, rank: int):
        world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        root = os.path.abspath(args.publish_weights_dir)
        self.versions = VersionRoot(storage_for(root), root, args.publish_weights_keep_last,
                                    args.publish_weights_deltas)
        self.queue = HFPublisher(export_args(args), rank, world, default_store() if world > 1 else None,
                                 models=self.versions, flag=FLAG)

    def keep(self, iteration: int):
        """What the save of `iteration` keeps for its version (None: no version is due, or it has one already: the
        run's final storage save of an iteration the memory tier saved and published)."""
        if self.queue.submitted is not None and iteration <= self.queue.submitted:
            return None
        return self.queue.keep(iteration, last=False)

    def submit(self, iteration: int, path: str, kept) -> None:
        """Publish the weights the save of `iteration` keeps (`kept`: None when it kept none, e.g. refused at its
        call: the version is dropped on every rank). Every rank submits the same iterations in the same order."""
        self.queue.submit(iteration, path, kept, last=False, saved=None)

    def report(self, drain: bool = False) -> None:
        """Log the versions that ended (rank 0); `drain`: wait for every queued one first."""
        for done in self.queue.drain() if drain else self.queue.finished():
            if done.error is None:
                log.info("published weights version %d: %s | ms from its weights kept: %.2f", done.iteration,
                         done.path, done.seconds * 1e3)
            else:  # a version is a by-product of the save: never a failed save, training goes on
                log.warning("the weights version of iteration %d was %s, training goes on; the newest version is "
                            "still %s: %s", done.iteration,
                            "dropped" if isinstance(done.error, ExportDropped) else "not published",
                            done.newest, done.error)

    def close(self) -> None:
        self.queue.close()


def shared(kept, consumers: int) -> list:
    """One save's kept weights for several consumers (--save-hf's export and a version): a handle each, the bytes
    given back once every handle is released."""
    if kept is None:
        return [None] * consumers
    left, lock = [consumers], threading.Lock()
    return [_Handle(kept, left, lock) for _ in range(consumers)]


class _Handle:
    """A consumer's view of shared kept weights (`shared`): reads go to them, `release` counts once."""

    def __init__(self, kept, left: list, lock):
        self._kept, self._left, self._lock, self._released = kept, left, lock, False

    def __getattr__(self, name):
        return getattr(self._kept, name)

    def release(self) -> None:
        with self._lock:
            if self._released:
                return
            self._released = True
            self._left[0] -= 1
            last = not self._left[0]
        if last:
            self._kept.release()


def check_publish_weights(args) -> str | None:
    """Why --publish-weights-dir cannot run with these flags (None: it can), said at start-up."""
    interval = args.publish_weights_interval
    if interval is None or interval < 1:
        return f"{FLAG} needs --publish-weights-interval N (at least 1), got {interval}"
    if args.publish_weights_keep_last < 1:
        return f"--publish-weights-keep-last must be at least 1, got {args.publish_weights_keep_last}"
    if args.publish_weights_deltas < 0:
        return f"--publish-weights-deltas must be at least 0, got {args.publish_weights_deltas}"
    saves = [s for s in (args.save_interval if args.save else None, args.non_persistent_save_interval) if s]
    if not any(interval % s == 0 for s in saves):
        return (f"--publish-weights-interval {interval} is a multiple of neither --save-interval "
                f"({args.save_interval if args.save else 'no --save'}) nor --non-persistent-save-interval "
                f"({args.non_persistent_save_interval}): a version is published from the save of its iteration "
                f"(with the memory tier every iteration, --non-persistent-save-interval 1, a version every step)")
    # --save-hf's own refusals (the model's family, a destination that cannot be written), said for this flag
    probe = export_args(args)
    probe.save_hf_interval = None
    why = check_save_hf(probe)
    return None if why is None else why.replace("--save-hf", FLAG)
