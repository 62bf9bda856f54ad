"""The tracker: which checkpoint a load of a save root resumes from, read through the storage that holds it.

Ranks write into the unpublished place of a checkpoint; rank 0 publishes it under its final name and then
replaces `latest_checkpointed_iteration.txt` (`save_root.SaveRoot.publish`). `find_latest` resolves the tracker
(read by `SaveRoot.read_pointer`, the one reader of a root's pointer): a crash at any point leaves either the old
state or the new one, and the tracker may name a checkpoint that retention retired since; both are resolved here.
"""
from __future__ import annotations

import dataclasses

from . import paths
from .save_root import ITERATION_TEXT, SaveRoot
from .storage import Storage, storage_for


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
        if self.tracker != paths.RELEASE and ITERATION_TEXT.read(self.tracker) is None:
            return (f"{paths.TRACKER} in {self.root!r} holds {self.tracker!r}, not an iteration, and no "
                    f"published iter_XXXXXXX directory is there")
        named = paths.join(self.root, paths.RELEASE) if self.tracker == paths.RELEASE else \
            paths.checkpoint_dir(self.root, int(self.tracker))
        return (f"{paths.TRACKER} in {self.root!r} names {self.tracker} but {named} is missing or not a "
                f"complete checkpoint, and no other published checkpoint is there")


def find_latest(path: str, storage: Storage | None = None) -> Latest:
    """The checkpoint a load of the save root `path` resumes from. That is the one the tracker names (an
    iteration, or Megatron's "release") if it holds a checkpoint (`SaveRoot.holds_checkpoint`); else the newest
    iteration that does: after a crash between publication and the tracker update, or when the tracker names a
    retired checkpoint. An iteration directory is itself."""
    storage = storage or storage_for(path)
    path = paths.normalize(path)
    iteration = paths.iteration_of(path)
    if iteration is not None:
        found = SaveRoot(storage, paths.parent(path)).holds_checkpoint(path)
        return Latest(paths.parent(path), None, iteration if found else None, path if found else None)
    root = SaveRoot(storage, path)
    text = root.read_pointer()
    tracked = paths.RELEASE if text == paths.RELEASE else None if text is None else ITERATION_TEXT.read(text)
    if tracked is not None:
        named = paths.join(path, paths.RELEASE) if tracked == paths.RELEASE else root.path(tracked)
        if root.holds_checkpoint(named):
            return Latest(path, text, tracked, named)
    its = sorted((i for i in map(paths.iteration_of, storage.list(path)) if i is not None), reverse=True)
    newest = next((i for i in its if root.holds_checkpoint(root.path(i))), None)
    return Latest(path, text, newest, None if newest is None else root.path(newest))


def read_latest(root: str, storage: Storage | None = None) -> int | None:
    """The iteration a load of `root` resumes from (`find_latest`); None when there is none."""
    iteration = find_latest(root, storage).iteration
    return iteration if isinstance(iteration, int) else None


def published_iterations(root: str, storage: Storage | None = None) -> list[int]:
    """The iterations of the checkpoint root `root` with a published checkpoint, oldest first."""
    return SaveRoot(storage or storage_for(root), root).published()


def is_published(path: str, storage: Storage | None = None) -> bool:
    """Whether `path` is a published checkpoint (`SaveRoot.is_published` of a checkpoint root)."""
    return SaveRoot(storage or storage_for(path), paths.parent(path)).is_published(path)


def write_latest(root: str, iteration: int, fsync: bool = True) -> None:
    """Point the tracker of `root` at `iteration` (for checkpoints written outside the engine: the other formats)."""
    storage = storage_for(root, fsync=fsync) if paths.scheme(root) is None else storage_for(root)
    try:
        SaveRoot(storage, root).point(iteration)
    finally:
        storage.close()


def clean_leftovers(root: str, storage: Storage | None = None) -> list[str]:
    """What saves killed before publication left under the checkpoint root `root`, removed
    (`SaveRoot.clean_leftovers`), through `storage` if given, else one made here and closed after."""
    owned = storage is None
    storage = storage_for(root) if owned else storage
    try:
        return SaveRoot(storage, root).clean_leftovers()
    finally:
        if owned:
            storage.close()
