"""The tracker: which checkpoint a load of a save root resumes from, read through the storage that holds it.

Ranks write into the unpublished place of a checkpoint; rank 0 publishes it under its final name and then
replaces `latest_checkpointed_iteration.txt` (`save_root.Publisher.publish`). `find_latest` is the one reader of
the tracker: a crash at any point leaves either the old state or the new one, and the tracker may name a
checkpoint that retention retired since; both are resolved here.
"""
from __future__ import annotations

import dataclasses

from . import paths
from . import save_root
from .errors import CheckpointError
from .storage import Storage, storage_for


def _tracker_text(root: str, storage: Storage) -> str | None:
    """The tracker's text, stripped; None when there is no tracker."""
    path = paths.join(root, paths.TRACKER)
    try:
        return storage.read_bytes(path).decode().strip()
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
            return (f"{self.root!r} holds no checkpoint: neither {paths.TRACKER} nor a published iter_XXXXXXX "
                    f"directory")
        if self.tracker != paths.RELEASE and _tracked(self.tracker) is None:
            return (f"{paths.TRACKER} in {self.root!r} holds {self.tracker!r}, not an iteration, and no "
                    f"published iter_XXXXXXX directory is there")
        named = paths.join(self.root, paths.RELEASE) if self.tracker == paths.RELEASE else \
            paths.checkpoint_dir(self.root, int(self.tracker))
        return (f"{paths.TRACKER} in {self.root!r} names {self.tracker} but {named} is missing or not a "
                f"complete checkpoint, and no other published checkpoint is there")


def find_latest(path: str, storage: Storage | None = None) -> Latest:
    """The checkpoint a load of the save root `path` resumes from. That is the one the tracker names (an
    iteration, or Megatron's "release") if it holds a checkpoint (`save_root.holds_checkpoint`); else the newest
    iteration that does: after a crash between publication and the tracker update, or when the tracker names a
    retired checkpoint. An iteration directory is itself."""
    storage = storage or storage_for(path)
    path = paths.normalize(path)
    iteration = paths.iteration_of(path)
    if iteration is not None:
        found = save_root.holds_checkpoint(storage, path)
        return Latest(paths.parent(path), None, iteration if found else None, path if found else None)
    text = _tracker_text(path, storage)
    tracked = paths.RELEASE if text == paths.RELEASE else _tracked(text)
    if tracked is not None:
        named = paths.join(path, paths.RELEASE) if tracked == paths.RELEASE else \
            paths.checkpoint_dir(path, tracked)
        if save_root.holds_checkpoint(storage, named):
            return Latest(path, text, tracked, named)
    its = sorted((i for i in map(paths.iteration_of, storage.list(path)) if i is not None), reverse=True)
    newest = next((i for i in its if save_root.holds_checkpoint(storage, paths.checkpoint_dir(path, i))), None)
    return Latest(path, text, newest, None if newest is None else paths.checkpoint_dir(path, newest))


def read_latest(root: str, storage: Storage | None = None) -> int | None:
    """The iteration a load of `root` resumes from (`find_latest`); None when there is none."""
    iteration = find_latest(root, storage).iteration
    return iteration if isinstance(iteration, int) else None


def published_iterations(root: str, storage: Storage | None = None) -> list[int]:
    return save_root.published(storage or storage_for(root), root)


def is_published(path: str, storage: Storage | None = None) -> bool:
    return save_root.is_published(storage or storage_for(path), path)


def write_latest(root: str, iteration: int, fsync: bool = True) -> None:
    """Point the tracker of `root` at `iteration` (for checkpoints written outside the engine: the other formats)."""
    storage = storage_for(root, fsync=fsync) if paths.scheme(root) is None else storage_for(root)
    try:
        save_root.write_tracker(storage, root, iteration)
    finally:
        storage.close()


def clean_leftovers(root: str, storage: Storage | None = None) -> list[str]:
    """What saves killed before publication left under `root`, removed (`save_root.clean_leftovers`)."""
    return save_root.clean_leftovers(storage or storage_for(root), root)
