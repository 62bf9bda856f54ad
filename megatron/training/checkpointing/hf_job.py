"""--save-hf's export job: one rank's part of the export of one model (the plan and the write of its share), and
the ranks' agreement on it before rank 0 publishes (`hf_models`).

Every rank writes its share of the safetensors files (`StagedSource.owners`: those whose bytes it mostly keeps
already), through the library's own plan and writer (`datastates.hf.export`: the same architecture registry,
mapping and safetensors writer as `convert_checkpoint.py --to hf`), built from the pieces the ranks kept, passed
over a gloo group of the export's own (`hf_staged`); rank 0 also writes config.json and the tokenizer. Each rank
reports its share to rank 0 through the engine's `Coordinator` (the store, as a save's manifests are); rank 0,
once every rank reported and the checkpoint is published, publishes the model. A failed save's files are removed.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

import torch

from datastates import CheckpointError, Coordinator
from datastates.paths import scheme as url_scheme
from datastates.hf.export import plan_export, plan_source, write_metadata, write_tensors

from ..local_dirs import nearest_existing
from .hf_models import ModelRoot
from .hf_staged import StagedSource, layout
from .state import saveable_args

log = logging.getLogger(__name__)

# the bytes of the export's writes in flight at once when it writes from the weights kept: their units stay valid
# until the export ends, so their writes need not wait for each other (each O_DIRECT write waits for the device)
IN_FLIGHT_BYTES = 64 << 20

REFUSED = object()  # `Submitted.saved`: the save was refused at its call on this rank


class SaveFailed(Exception):
    """The save an export was writing from failed: the export is left out unreported (the save is reported)."""


class ExportDropped(CheckpointError):
    """An export left out because the save kept no weights for it (on at least one rank): not a failed save."""


@dataclass(frozen=True)
class Submitted:
    """A checkpoint to export: `saved` its save (a `SaveHandle`; None: published already; REFUSED), `kept` the
    weights it kept (`SaveHandle.kept`, or None), `last` the run's last (read back from storage if need be)."""
    iteration: int
    ckpt_dir: str
    kept: object = None
    last: bool = False
    saved: object = None


class ExportJob:
    """One rank's exports (`run`, one model at a time). `group`: the export's own gloo group (None for one rank).
    Collective at construction (`behind`)."""

    def __init__(self, models: ModelRoot, args, rank: int, world_size: int, coordinator: Coordinator, group):
        self.models, self.args, self.rank, self.world_size = models, args, rank, world_size
        self.coordinator, self.group = coordinator, group
        self.timeout_s = args.ckpt_publish_timeout_s
        # on the checkpoints' own storage (as any rank sees it), each export starts once its save has ended (the
        # storage's bandwidth goes to the checkpoint first); on another, at once
        self.behind = any(self.gather(shares_storage(models.root, args.save)))

    def run(self, job: Submitted, filled: bool) -> tuple:
        """Export `job` (`filled`: every weight it keeps is kept, on this rank). It starts once the save has ended
        (and only if it held) when `behind`, else at once; its files are written as soon as every rank's kept
        weights are complete; the model is published once the checkpoint is. On rank 0: (when the export
        started, when every rank's files were written) (None: it wrote none), and the bytes the ranks passed each
        other (None: read back from storage)."""
        if self.behind:  # its work would slow the checkpoint's writes: it comes after them
            self.outcome(job.saved)
        began = time.perf_counter()
        final = self.models.path(job.iteration)
        why = None if filled else ("its save was not due for an export" if job.kept is None else
                                   job.kept.why or "its save ended before all its weights were kept")
        reports = self.gather((why, layout(job.kept, self.rank) if why is None else None,
                               self.models.is_model(final) if self.rank == 0 else None))
        if reports[0][2]:  # published by an earlier run of this job: kept, named again once the checkpoint is
            self.outcome(job.saved)
            if self.rank == 0:
                log.info("--save-hf: %s is already published (an earlier run of this job): kept", final)
                self.models.name(job.iteration)
            return None, None
        plan, shards = self._plan(job, self._pieces(job, reports))
        return self._write(job, final, plan, shards, began)

    def _pieces(self, job: Submitted, reports: list) -> list | None:
        """Every rank's kept pieces, or None: the checkpoint is read back from storage (the run's last, when a rank
        kept none; any other is then dropped: `ExportDropped`)."""
        missing = {r: w for r, (w, _, _) in enumerate(reports) if w is not None}
        if not missing:  # a replica kept by more than one rank (a memory-tier save, self-contained: every rank
            # writes its replicated weights) is taken from the lowest of them
            return list({(p.name, p.box): p for _, pieces, _ in reversed(reports) for p in pieces}.values())
        self.outcome(job.saved)  # nothing to write from before the checkpoint is published: its outcome first
        said = "; ".join(f"rank {r}: {w}" for r, w in missing.items())
        if not job.last:
            raise ExportDropped(f"no weights were kept for it ({said})")
        log.info("--save-hf: the run's last checkpoint is exported from storage (%s)", said)
        return None

    def _write(self, job: Submitted, final: str, plan, shards: list, began: float) -> tuple:
        """Every rank writes its share and reports it; rank 0 publishes once every rank's is written and the
        checkpoint is published (a failed export leaves nothing)."""
        directory, error = None, None
        try:
            if isinstance(plan.source, StagedSource):
                plan.source.start(plan, shards)  # every rank's sends, before anything that may fail on one rank
            directory = self.models.stage(final)
            self._write_share(plan, shards, directory)
        except Exception as e:  # noqa: BLE001 (reported to rank 0, which fails the export with it)
            error = e
        finally:
            plan.close()  # takes what was sent to this rank and not read: no rank waits on a failed one
        received = plan.source.received if isinstance(plan.source, StagedSource) else None
        try:  # rank 0: every rank's share written (else raises), the bytes passed; others: reported
            passed = self._agree(job.iteration, error, received)
            if self.rank != 0:
                return None, None
            written = (began, time.perf_counter())
            self._publish(job, directory, shards)
        except BaseException:
            if directory is not None and self.rank == 0:  # a failed export leaves nothing
                self.models.discard(directory)
            raise
        return written, passed

    def _publish(self, job: Submitted, directory: str, shards: list) -> None:
        """Rank 0: once the checkpoint is published (its save's outcome; SaveFailed when it failed)."""
        if job.saved is not None and job.saved.join() and job.saved.error is not None:
            log.info("--save-hf: the checkpoint of iteration %d failed: the model files written beside it are "
                     "removed", job.iteration)
            raise SaveFailed()
        self.models.publish(directory, job.iteration, shards)

    def outcome(self, saved) -> None:
        """Wait for the save (None: published already); SaveFailed on every rank when it failed on any."""
        ok = saved is None or (saved is not REFUSED and saved.join() and saved.error is None)
        if not all(self.gather(ok)):
            raise SaveFailed()

    def _plan(self, job: Submitted, pieces: list | None) -> tuple:
        """The export's plan (`datastates.hf.export`'s) and its safetensors files: over the weights the ranks kept
        (`pieces`: every rank's `layout`), or None: over the checkpoint read back from storage (the run's last,
        published). Every rank reaches the same outcome (a gather on the export's group): the plan, or an error
        naming the ranks whose planning failed. The staged plan reads no file of the checkpoint."""
        plan, shards, error = None, None, None
        tokenizer = self.args.save_hf_tokenizer
        try:
            if pieces is None:
                plan = plan_export("datastates", job.ckpt_dir, tokenizer=tokenizer, drop_mtp=True)
            else:
                plan = plan_source(StagedSource(job.ckpt_dir, job.kept, pieces, saveable_args(self.args), self.rank,
                                                self.world_size, self.group), tokenizer=tokenizer, drop_mtp=True)
            shards = plan.shards(self.args.save_hf_max_shard_size)
        except Exception as e:  # noqa: BLE001 (every rank learns it below)
            error = e
        failed = {r: e for r, e in enumerate(self.gather(None if error is None else f"{type(error).__name__}: "
                                                         f"{error}")) if e is not None}
        if failed and plan is not None:
            plan.close()
        if error is not None:
            raise error
        if failed:
            raise CheckpointError("--save-hf: planning the export failed on rank(s) " + "; ".join(
                f"{r}: {e}" for r, e in failed.items()))
        return plan, shards

    def gather(self, report) -> list:
        """Every rank's `report`, on every rank (the export's group)."""
        if self.world_size == 1:
            return [report]
        out = [None] * self.world_size
        torch.distributed.all_gather_object(out, report, group=self.group)
        return out

    def _write_share(self, plan, shards: list, directory: str) -> None:
        """This rank's safetensors files (and rank 0's config.json and tokenizer), through the library's writer:
        one mapping, the same bytes as the offline tool's (rank 0 indexes them once all are written)."""
        staged = isinstance(plan.source, StagedSource)
        owners = plan.source.owners if staged else [
            k % self.world_size for k in range(len(shards))]  # read back from storage: any rank reads any unit
        mine = {k for k, r in enumerate(owners) if r == self.rank}
        storage = self.models.storage
        if mine:  # a unit read back from storage is valid only until the next read: its writes are waited for
            write_tensors(plan, storage, directory, shards, mine, in_flight_bytes=IN_FLIGHT_BYTES if staged else 0)
        if self.rank == 0:
            write_metadata(plan, storage, directory)

    def _agree(self, iteration: int, error: BaseException | None, received: int | None) -> int | None:
        """Every rank reports its share (and the bytes it `received`) through the engine's `Coordinator`; rank 0
        waits for all of them (at most --ckpt-publish-timeout-s) and raises, naming the ranks, if any failed or
        did not report; else the bytes received by all (None: read back from storage)."""
        coordinator = self.coordinator
        coordinator.report(iteration, {"received": received},
                           None if error is None else f"{type(error).__name__}: {error}")
        if self.rank != 0:
            return None
        try:
            coordinator.await_reports(iteration, f"--save-hf: the model of iteration {iteration}", self.timeout_s)
            counts = [m["received"] for m in coordinator.manifests(iteration).values()]
        finally:
            coordinator.forget(iteration)
        return None if None in counts else sum(counts)


def shares_storage(a: str, b: str) -> bool:
    """Whether two roots share one storage's bandwidth: a file system (the device of their nearest existing
    directories), or a bucket (an MSC profile) of one kind of object store."""
    if url_scheme(a) or url_scheme(b):
        return url_scheme(a) == url_scheme(b) and urlsplit(a).netloc == urlsplit(b).netloc
    return os.stat(nearest_existing(a)).st_dev == os.stat(nearest_existing(b)).st_dev
