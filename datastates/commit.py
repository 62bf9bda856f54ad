"""Names and the tracker: what a save root holds, and which checkpoint a load of it resumes from.

Ranks write into `iter_XXXXXXX.partial/`; a storage backend publishes it under its final name (`storage.posix`
gives the fsync order) and `write_latest` replaces `latest_checkpointed_iteration.txt`, whose one reader is
`find_latest`. A crash at any point leaves either the old state or the new one; stale `.partial` and
`.deleting` directories are removed by `clean_stale`; `retire` takes a checkpoint out of sight in one rename.
"""
from __future__ import annotations

import dataclasses
import os
import re
import shutil
import time

from . import format as fmt
from .errors import CheckpointError

TRACKER = "latest_checkpointed_iteration.txt"
ITER_RE = re.compile(r"^iter_(\d{7,})$")
PARTIAL = ".partial"
DELETING = ".deleting"
RELEASE = "release"  # what Megatron-LM's tracker says of a checkpoint in `release/`


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


def holds_checkpoint(path: str) -> bool:
    """Whether a load may resume from `path`: a published checkpoint (its metadata.json: this engine's format and
    megatron-core's torch_dist), or Megatron's legacy torch format (mp_rank_* directories, written without an
    index before the tracker names them)."""
    if is_published(path):
        return True
    try:
        return any(name.startswith("mp_rank_") for name in os.listdir(path))
    except OSError:
        return False


def _tracker_text(save_dir: str) -> str | None:
    """The tracker's text, stripped; None when there is no tracker."""
    path = os.path.join(save_dir, TRACKER)
    try:
        with open(path) as f:
            return f.read().strip()
    except (FileNotFoundError, NotADirectoryError):
        return None
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"cannot read {path!r}: {getattr(e, 'strerror', None) or e}") from None


def _tracked(text: str | None) -> int | None:
    return int(text) if text is not None and text.isdigit() else None


@dataclasses.dataclass(frozen=True)
class Latest:
    """What a save root's tracker says, and the checkpoint a load of the root resumes from."""

    root: str
    tracker: str | None  # the tracker's text, stripped; None without a tracker
    iteration: int | str | None  # the checkpoint's iteration, RELEASE, or None: nothing to load
    path: str | None  # the checkpoint's directory

    def why_none(self) -> str:
        """Why nothing is loadable here, naming the tracker and what it names."""
        if self.tracker is None:
            return f"{self.root!r} holds no checkpoint: neither {TRACKER} nor a published iter_XXXXXXX directory"
        if self.tracker != RELEASE and _tracked(self.tracker) is None:
            return (f"{TRACKER} in {self.root!r} holds {self.tracker!r}, not an iteration, and no published "
                    f"iter_XXXXXXX directory is there")
        named = os.path.join(self.root, RELEASE) if self.tracker == RELEASE else \
            checkpoint_dir(self.root, int(self.tracker))
        return (f"{TRACKER} in {self.root!r} names {self.tracker} but {named} is missing or not a complete "
                f"checkpoint, and no other published checkpoint is there")


def find_latest(path: str) -> Latest:
    """The one reader of `latest_checkpointed_iteration.txt`: the checkpoint a load of the save root `path`
    resumes from. That is the one the tracker names (an iteration, or Megatron's "release") if it holds a
    checkpoint (`holds_checkpoint`); else the newest iteration that does: after a crash between publication and
    the tracker update, or when the tracker names a retired checkpoint. An iteration directory is itself."""
    path = os.path.normpath(path)
    iteration = iteration_of(path)
    if iteration is not None:
        found = holds_checkpoint(path)
        return Latest(os.path.dirname(path), None, iteration if found else None, path if found else None)
    text = _tracker_text(path)
    tracked = RELEASE if text == RELEASE else _tracked(text)
    if tracked is not None:
        named = os.path.join(path, RELEASE) if tracked == RELEASE else checkpoint_dir(path, tracked)
        if holds_checkpoint(named):
            return Latest(path, text, tracked, named)
    try:
        its = sorted((i for i in map(iteration_of, os.listdir(path)) if i is not None), reverse=True)
    except (FileNotFoundError, NotADirectoryError):
        its = []
    newest = next((i for i in its if holds_checkpoint(checkpoint_dir(path, i))), None)
    return Latest(path, text, newest, None if newest is None else checkpoint_dir(path, newest))


def read_latest(save_dir: str) -> int | None:
    """The iteration a load of `save_dir` resumes from (`find_latest`); None when there is none."""
    iteration = find_latest(save_dir).iteration
    return iteration if isinstance(iteration, int) else None


def write_latest(save_dir: str, iteration: int, fsync: bool = True, sync_dir: bool = True) -> None:
    """Replace the tracker atomically (a reader never sees it empty); `sync_dir=False` leaves the fsync of
    `save_dir` to the caller."""
    tracker = os.path.join(save_dir, TRACKER)
    tmp = f"{tracker}.tmp.{os.getpid()}"
    fmt.write_file(tmp, str(iteration).encode(), fsync)
    os.replace(tmp, tracker)
    if fsync and sync_dir:
        fmt.fsync_dir(save_dir)


def clean_stale(save_dir: str) -> list[str]:
    """Remove leftovers of saves killed before publication (`.partial`, `.deleting`, temp files).

    A re-save of the tracker's iteration killed between moving the old directory aside and renaming the new one
    into place is rolled back first: the old one gets its name again (see `publish`).
    Call it on one rank before the first save of a run, while no other rank is saving."""
    removed = []
    try:
        names = os.listdir(save_dir)
    except FileNotFoundError:
        return removed
    tracked = _tracked(_tracker_text(save_dir))
    final = checkpoint_dir(save_dir, tracked) if tracked is not None else None
    if final is not None and not os.path.exists(final):
        prefix = os.path.basename(final) + DELETING + "."
        for name in sorted(n for n in names if n.startswith(prefix)):
            if is_published(os.path.join(save_dir, name)):
                os.rename(os.path.join(save_dir, name), final)
                names.remove(name)
                break
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
