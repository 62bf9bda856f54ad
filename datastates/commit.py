"""Publication: a checkpoint becomes visible in one atomic step, only once every rank has finished.

Ranks write into `iter_XXXXXXX.partial/`. A rank is done when its manifest exists there (written to a temp
name, fsynced, renamed); a rank that failed leaves `rank_XXXXX.failed` with the cause. Rank 0 waits on these
files (no collective, so training never blocks on one), writes `metadata.json`, renames the directory to its
final name, and replaces `latest_checkpointed_iteration.txt` atomically. A crash at any point leaves either the
old state or the new one; stale `.partial` directories are removed by `clean_stale`.
"""
from __future__ import annotations

import os
import re
import shutil
import time

from . import format as fmt
from .errors import CheckpointError, CheckpointTimeoutError

TRACKER = "latest_checkpointed_iteration.txt"
ITER_RE = re.compile(r"^iter_(\d{7,})$")
PARTIAL = ".partial"
DELETING = ".deleting"


def checkpoint_dir(save_dir: str, iteration: int) -> str:
    return os.path.join(save_dir, f"iter_{iteration:07d}")


def iteration_of(path: str) -> int | None:
    m = ITER_RE.match(os.path.basename(os.path.normpath(path)))
    return int(m.group(1)) if m else None


def partial_dir(path: str) -> str:
    return os.path.normpath(path) + PARTIAL


def is_published(path: str) -> bool:
    return os.path.isfile(os.path.join(path, fmt.METADATA))


def published_iterations(save_dir: str) -> list[int]:
    try:
        names = os.listdir(save_dir)
    except FileNotFoundError:
        return []
    its = [iteration_of(n) for n in names]
    return sorted(i for i in its if i is not None and is_published(checkpoint_dir(save_dir, i)))


def read_latest(save_dir: str) -> int | None:
    """The iteration `latest_checkpointed_iteration.txt` names, if that checkpoint is published; else the newest
    published one (a crash between publication and the tracker update); None when there is none."""
    try:
        with open(os.path.join(save_dir, TRACKER)) as f:
            text = f.read().strip()
        if text.isdigit() and is_published(checkpoint_dir(save_dir, int(text))):
            return int(text)
    except FileNotFoundError:
        pass
    its = published_iterations(save_dir)
    return its[-1] if its else None


def write_latest(save_dir: str, iteration: int, fsync: bool = True) -> None:
    tracker = os.path.join(save_dir, TRACKER)
    tmp = f"{tracker}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(str(iteration))
        f.flush()
        if fsync:
            os.fsync(f.fileno())
    os.replace(tmp, tracker)
    if fsync:
        fmt.fsync_dir(save_dir)


def clean_stale(save_dir: str) -> list[str]:
    """Remove leftovers of saves killed before publication (`.partial`, `.deleting`, temp files).

    Call it on one rank before the first save of a run, while no other rank is saving."""
    removed = []
    try:
        names = os.listdir(save_dir)
    except FileNotFoundError:
        return removed
    for name in names:
        path = os.path.join(save_dir, name)
        if name.endswith(PARTIAL) or DELETING in name:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
        elif ".tmp." in name and name.startswith(TRACKER):
            os.unlink(path)
            removed.append(path)
    return removed


def retire(path: str) -> str:
    """Take a checkpoint out of sight in one atomic rename; returns the new name, for the caller to delete
    (deleting large files can take long, e.g. on file systems mounted with discard). A crash before the
    deletion leaves a `.deleting` leftover that `clean_stale` removes."""
    doomed = f"{path}{DELETING}.{os.getpid()}.{time.monotonic_ns()}"
    os.rename(path, doomed)
    return doomed


def apply_retention(save_dir: str, keep_last: int, protect: int) -> list[str]:
    """Retire all but the newest `keep_last` published checkpoints, never `protect` (the one just published);
    returns the retired directories, to be deleted off the critical path."""
    its = published_iterations(save_dir)
    keep = set(its[-keep_last:]) | {protect}
    return [retire(checkpoint_dir(save_dir, i)) for i in its if i not in keep]


def _rank_status(partial: str, world_size: int) -> tuple[list[int], dict[int, str]]:
    missing, failed = [], {}
    for r in range(world_size):
        failed_path = os.path.join(partial, fmt.failed_file(r))
        if os.path.exists(failed_path):
            try:
                with open(failed_path) as f:
                    failed[r] = f.read().strip()
            except OSError as e:
                failed[r] = f"(cannot read {failed_path}: {e.strerror})"
        elif not os.path.exists(os.path.join(partial, fmt.manifest_file(r))):
            missing.append(r)
    return missing, failed


def _poll(condition, timeout_s: float, on_timeout):
    deadline = time.monotonic() + timeout_s
    delay = 0.002
    while True:
        result = condition()
        if result is not None:
            return result
        if time.monotonic() > deadline:
            on_timeout()
        time.sleep(delay)
        delay = min(delay * 2, 0.1)


def wait_for_ranks(partial: str, world_size: int, timeout_s: float) -> None:
    """Rank 0: wait until every rank's manifest is in `partial`; raise naming the ranks that failed or are late."""
    def check():
        missing, failed = _rank_status(partial, world_size)
        if failed:
            causes = "; ".join(f"rank {r}: {why}" for r, why in sorted(failed.items()))
            raise CheckpointError(f"checkpoint {partial!r} not published: {causes}")
        return True if not missing else None

    def timed_out():
        missing, _ = _rank_status(partial, world_size)
        raise CheckpointTimeoutError(f"checkpoint {partial!r} not published: rank(s) {missing} did not finish "
                                     f"within {timeout_s:.0f} s")
    _poll(check, timeout_s, timed_out)


def publish(partial: str, final: str, metadata: dict, fsync: bool = True) -> list[str]:
    """Rank 0: write metadata.json, move the directory to its final name, update the tracker. Returns the
    retired directory of an earlier save of the same iteration, if any, for the caller to delete."""
    fmt.write_json_atomic(os.path.join(partial, fmt.METADATA), metadata, fsync)
    parent = os.path.dirname(final) or "."
    retired = [retire(final)] if os.path.exists(final) else []  # re-saving an iteration: the new one wins
    os.rename(partial, final)
    if fsync:
        fmt.fsync_dir(parent)
    iteration = iteration_of(final)
    if iteration is not None:
        write_latest(parent, iteration, fsync)
    return retired


def wait_published(partial: str, final: str, rank: int, manifest_crc: int, world_size: int,
                   timeout_s: float) -> None:
    """Ranks other than 0: wait until rank 0 published this save (its metadata lists our manifest's crc)."""
    def check():
        meta_path = os.path.join(final, fmt.METADATA)
        if os.path.exists(meta_path):
            try:
                manifests = fmt.read_json(meta_path, "metadata").get("manifests", {})
                if manifests.get(str(rank)) == manifest_crc:
                    return True
            except CheckpointError:
                pass
        _, failed = _rank_status(partial, world_size)
        if failed:
            causes = "; ".join(f"rank {r}: {why}" for r, why in sorted(failed.items()))
            raise CheckpointError(f"checkpoint {final!r} not published: {causes}")
        return None

    def timed_out():
        missing, _ = _rank_status(partial, world_size)
        who = f"rank(s) {missing} did not finish" if missing else "rank 0 did not publish it"
        raise CheckpointTimeoutError(f"checkpoint {final!r} not published within {timeout_s:.0f} s: {who}")
    _poll(check, timeout_s, timed_out)
