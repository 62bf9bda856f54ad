"""The publication policy of a save root, once for every kind of root (checkpoints, the memory tier, published
Hugging Face models, the tools' outputs) and every backend (`storage.base.Storage` is bytes only and knows no file
name): where a checkpoint is written unseen, the order of publication, the pointer to the newest, retention, who
deletes a retired checkpoint, the clean-up of what killed saves left, and which directories hold a checkpoint a
load may resume from. A root's marker (the object whose presence makes a directory published) and its pointer
(its name, and how its text names a checkpoint) are `SaveRoot`'s parameters: a checkpoint root's are
`metadata.json` and `latest_checkpointed_iteration.txt` holding `100`; a Hugging Face models root's are
`model.safetensors.index.json` and `latest` holding `iter_0000100`.

Publication (`SaveRoot.publish`; `Publisher.publish` on rank 0 once every rank reported its manifest), each step
durable before the next depends on it:
  1. the marker (a checkpoint's index) is written into the unpublished place (`Storage.write_bytes`, durable where
     the storage syncs), or was written there by the caller, last;
  2. the place is committed under its final name in one step (`Storage.commit`: on a file system an fsync of the
     directory, the rename, an fsync of the parent; on an object store the marker's PUT was the step);
  3. the pointer is replaced in one step (`write_bytes(replace=True)`, durable), then retention retires the old
     checkpoints (`Storage.retire`: renamed aside, or their marker deleted; durable when it returns).
The pointer only ever names a published checkpoint: a crash leaves it naming the new one or the one before,
which retention had not touched yet (a reader of the pointer alone, as a Hugging Face user reads `latest`, needs
nothing else); no rank removes a retired checkpoint's bytes before its retirement is durable.
"""
from __future__ import annotations

import dataclasses
import os
import uuid
from typing import Callable

from . import paths
from .errors import CheckpointError
from .storage.base import DataSink, PageLending, Storage

LOOKS = 3  # rank 0 removes a retired directory the ranks are emptying after this many publications, whatever is left


@dataclasses.dataclass(frozen=True)
class PointerText:
    """How a root's pointer names its newest checkpoint: `write` gives the pointer's text for an iteration,
    `read` the iteration a stripped text names (None: it names none)."""

    write: Callable[[int], str]
    read: Callable[[str], int | None]


# the checkpoints' tracker: the iteration itself (`100`; Megatron's "release" names no iteration)
ITERATION_TEXT = PointerText(str, lambda text: int(text) if text.isdigit() else None)
# a Hugging Face models root's `latest`: the directory's name and a newline (`iter_0000100\n`)
DIRECTORY_TEXT = PointerText(lambda iteration: paths.checkpoint_name(iteration) + "\n",
                             lambda text: int(m.group(1)) if (m := paths.ITER_RE.match(text)) else None)


class SaveRoot:
    """The policy of one save root `root` on `storage` (see the module docstring). `marker`: the object, inside a
    checkpoint's directory, whose presence makes it published (written last); `pointer`: the object, in the root,
    naming the newest checkpoint (None: the root keeps none, e.g. the memory tier, whose restart lists every
    rank's parts), its text as `pointer_text` says. Retention scans the root once, then keeps its list up to date:
    keep one SaveRoot per root for as long as one process publishes there."""

    def __init__(self, storage: Storage, root: str, marker: str = paths.METADATA, pointer: str | None = paths.TRACKER,
                 pointer_text: PointerText = ITERATION_TEXT):
        self.storage, self.root = storage, root
        self.marker, self.pointer, self.pointer_text = marker, pointer, pointer_text
        self._published: list[int] | None = None

    def path(self, iteration: int) -> str:
        """The final directory of `iteration`'s checkpoint."""
        return paths.checkpoint_dir(self.root, iteration)

    # ----- publication -----

    def stage(self, final: str, private: bool = False) -> str:
        """Every writer: the unpublished place of `final`, ready (no reader looks there). `private`: a name no
        other process can take (`<final>.<pid>-<random>.partial` where the storage stages aside), for one
        process writing `final` alone (a conversion), so two writers of one output never share their files."""
        if private and not self.storage.in_place:
            return self.storage.stage(f"{paths.normalize(final)}.{os.getpid()}-{uuid.uuid4().hex}", self.marker)
        return self.storage.stage(final, self.marker)

    def commit(self, partial: str, final: str, marker: bytes | None = None, replace: bool = True) -> list[str]:
        """Make `partial` visible as `final` in one step: `marker` written into it first (None: the caller wrote
        the marker there, last). Returns what a checkpoint displaced (a re-save of `final`) was retired to.
        `replace=False`: a non-empty `final` is never displaced (FileExistsError), in the same step."""
        if marker is not None:
            self.storage.write_bytes(paths.join(partial, self.marker), marker)
        return self.storage.commit(partial, final, replace)

    def publish(self, partial: str, final: str, marker: bytes | None = None, keep_last: int | None = None,
                replace: bool = True) -> list[str]:
        """`commit` (`replace` as there), then `advance` to `final` when it is an iteration (the module
        docstring). Returns what was retired: out of every reader's sight, its bytes left for `Storage.remove`
        (or `Publisher.delete`)."""
        retired = self.commit(partial, final, marker, replace)
        iteration = paths.iteration_of(final)
        return retired if iteration is None else retired + self.advance(iteration, keep_last)

    def advance(self, iteration: int, keep_last: int | None) -> list[str]:
        """The published `iteration` becomes the newest: the pointer names it (when the root keeps one), then the
        newest `keep_last` checkpoints are kept (None: all), in that order; returns what was retired."""
        if self.pointer is not None:
            self.point(iteration)
        return [] if keep_last is None else self.retain(keep_last, iteration)

    def retain(self, keep_last: int, protect: int) -> list[str]:
        """Retire all but the newest `keep_last` published checkpoints, never `protect` (just published);
        returns where their bytes are now."""
        if self._published is None:
            self._published = self.published()
        return [self.retire(self.path(i)) for i in retention(self._published, keep_last, protect)]

    def retire(self, path: str) -> str:
        """The checkpoint `path` out of every reader's sight in one step; returns where its bytes are now."""
        return self.storage.retire(path, self.marker)

    # ----- the pointer -----

    def point(self, iteration: int) -> None:
        """The pointer names `iteration`, replaced in one step (a reader never sees it empty)."""
        self.storage.write_bytes(self._pointer_path(), self.pointer_text.write(iteration).encode(), replace=True)

    def read_pointer(self) -> str | None:
        """The pointer's text, stripped; None when there is none. The one reader of a root's pointer."""
        path = self._pointer_path()
        try:
            return self.storage.read_bytes(path).decode().strip()
        except (FileNotFoundError, NotADirectoryError):
            return None
        except (OSError, UnicodeDecodeError) as e:
            raise CheckpointError(f"cannot read {path!r}: {getattr(e, 'strerror', None) or e}") from None

    def pointed(self) -> int | None:
        """The iteration the pointer names; None when there is no pointer or it names no iteration."""
        text = self.read_pointer()
        return None if text is None else self.pointer_text.read(text)

    def _pointer_path(self) -> str:
        if self.pointer is None:
            raise CheckpointError(f"save root {self.root!r} keeps no pointer")
        return paths.join(self.root, self.pointer)

    # ----- what is there -----

    def is_published(self, path: str) -> bool:
        """Whether `path` is a published checkpoint: its marker is there (written last, so a reader never sees
        half of one)."""
        return self.storage.stat(paths.join(path, self.marker)) is not None

    def holds_checkpoint(self, path: str) -> bool:
        """Whether a load may resume from `path`: a published checkpoint (a checkpoint root's metadata.json: this
        engine's format and megatron-core's torch_dist), Megatron's legacy torch format (`holds_legacy`) or
        upstream's torch_dcp (`holds_dcp`)."""
        return self.is_published(path) or holds_legacy(self.storage, path) or holds_dcp(self.storage, path)

    def published(self) -> list[int]:
        """The iterations of the root with a published checkpoint, oldest first."""
        its = (paths.iteration_of(name) for name in self.storage.list(self.root))
        return sorted(i for i in its if i is not None and self.is_published(self.path(i)))

    # ----- leftovers -----

    def clean_leftovers(self) -> list[str]:
        """What saves killed before publication left in the root, removed; returns what went. On one process,
        before the first save of a run, while none saves: unpublished places (`.partial`), retired checkpoints
        (`.deleting`), the pointer's temporaries (as the storage names them), and on a storage that writes in
        place the iterations without a marker that the pointer does not name; then every upload still open in
        the root. A re-save of the pointer's iteration killed between retiring the old checkpoint and committing
        the new one is rolled back first: the old one gets its name back."""
        storage, root = self.storage, self.root
        try:
            pointed = None if self.pointer is None else self.pointed()
        except CheckpointError:  # unreadable: nothing is rolled back, and `find_latest` will say why
            pointed = None
        names = storage.list(root)
        if pointed is not None and not storage.in_place and storage.stat(self.path(pointed)) is None:
            prefix = paths.name(self.path(pointed)) + paths.DELETING + "."
            for name in sorted(n for n in names if n.startswith(prefix)):
                if self.is_published(paths.join(root, name)):
                    storage.commit(paths.join(root, name), self.path(pointed))
                    names.remove(name)
                    break
        removed = []
        for name in names:
            path = paths.join(root, name)
            iteration = paths.iteration_of(name)
            unfinished = name.endswith(paths.PARTIAL) or paths.DELETING in name
            temporary = self.pointer is not None and storage.temporary_of(name) == self.pointer
            unindexed = (storage.in_place and iteration is not None and iteration != pointed
                         and not self.is_published(path))
            if (unfinished or temporary or unindexed) and storage.exists(path):  # an emptied prefix may be listed
                storage.remove(path)
                removed.append(path)
        return removed + storage.abort_uploads(root)


class Publisher:
    """One engine's saves through `storage`: every root it publishes to is a checkpoint root (`SaveRoot` with the
    index as marker), kept per root by rank 0 (retention scans a root once), and rank 0 keeps the retired
    directories the ranks are emptying. `tracker`: whether publication points the tracker at the new checkpoint
    (the memory tier keeps none: its restart lists every rank's parts)."""

    def __init__(self, storage: Storage, tracker: bool = True):
        self.storage, self.tracker = storage, tracker
        self._roots: dict[str, SaveRoot] = {}
        self._emptying: list[list] = []  # rank 0: [retired path, looks]

    def root(self, root: str) -> SaveRoot:
        """The checkpoint root `root`, as this engine publishes there."""
        root = paths.normalize(root)
        if root not in self._roots:
            self._roots[root] = SaveRoot(self.storage, root, pointer=paths.TRACKER if self.tracker else None)
        return self._roots[root]

    def prepare(self, final: str) -> str:
        """Every rank: the unpublished place of `final`, ready."""
        return self.root(paths.parent(final)).stage(final)

    def open_data(self, partial: str, rank: int, nbytes: int, lent: bool = True) -> DataSink:
        """`rank`'s data of the checkpoint being written at `partial`. `lent`: on the memory tier, pages the
        snapshot lands in and a storage save writes from (a save laid out as planned); else a plain file written
        through the writers (an encoded save: its stored bytes are not the planned layout)."""
        path = paths.join(partial, paths.data_file(rank))
        if not lent and isinstance(self.storage, PageLending):
            return self.storage.open_file(path, nbytes)
        return self.storage.open_data(path, nbytes)

    def write_manifest(self, partial: str, rank: int, doc: bytes) -> None:
        self.storage.write_bytes(paths.join(partial, paths.manifest_file(rank)), doc)

    def publish(self, partial: str, final: str, index: bytes | None, keep_last: int | None) -> list[str]:
        """Rank 0: make `partial` visible as `final` (`index`: its index, or None when it is in place already),
        keep the newest `keep_last` checkpoints of the save root, point the tracker at `final`
        (`SaveRoot.publish`). Returns what was retired, for `delete`."""
        return self.root(paths.parent(final)).publish(partial, final, index, keep_last)

    def abandon(self, partial: str) -> None:
        """Rank 0, on a failed save: what it wrote goes."""
        self.storage.remove(partial)

    def delete(self, retired: list[str], rank: int, world_size: int) -> None:
        """Every rank, off the save path: its share of the retired checkpoints. Where deleting costs time (a file
        system) each rank deletes its own files (`deletes`) and rank 0 removes the emptied directories, looking
        again at each publication, and after `LOOKS` looks (a rank died, or the checkpoint came from a larger
        world) removes what is left itself. Elsewhere rank 0 removes each retired checkpoint whole."""
        storage = self.storage
        if not storage.spreads_deletes:
            if rank == 0:
                for path in retired:
                    storage.remove(path)
            return
        for path in retired:
            for name in deletes(rank, world_size):
                storage.remove(paths.join(path, name))
        if rank != 0:
            return
        still = []
        for entry in self._emptying:
            entry[1] += 1
            if not storage.list(entry[0]) or entry[1] >= LOOKS:
                storage.remove(entry[0])
            else:
                still.append(entry)
        self._emptying = still + [[path, 0] for path in retired]

    def sweep(self) -> None:
        """At close, off the save path: what retirement left behind goes."""
        for path, _ in self._emptying:
            self.storage.remove(path)
        self._emptying = []


def deletes(rank: int, world_size: int) -> list[str]:
    """The files of a retired checkpoint that `rank` deletes: its own; rank 1 also rank 0's and the index. Rank 0,
    which publishes, only retires the checkpoint and removes it once it is empty, so no rank's share of a deletion
    grows with the world size. Alone, rank 0 deletes everything."""
    if world_size == 1:
        return [paths.METADATA, paths.data_file(0), paths.manifest_file(0)]
    mine = [paths.data_file(rank), paths.manifest_file(rank)] if rank else []
    return mine + ([paths.METADATA, paths.data_file(0), paths.manifest_file(0)] if rank == 1 else [])


def retention(published: list[int], keep_last: int, protect: int) -> list[int]:
    """The one retention rule: `protect` was just published; add it to `published` (sorted, kept up to date in
    place) and return the iterations to retire: all but the newest `keep_last`, never `protect`."""
    if protect not in published:
        published.append(protect)
        published.sort()
    keep = set(published[-keep_last:]) | {protect}
    doomed = [i for i in published if i not in keep]
    published[:] = [i for i in published if i in keep]
    return doomed


def holds_legacy(storage: Storage, path: str) -> bool:
    """Whether `path` is in Megatron's legacy torch format: mp_rank_* directories, written without an index before
    the tracker names them."""
    return any(name.startswith("mp_rank_") for name in storage.list(path))


def holds_dcp(storage: Storage, path: str) -> bool:
    """Whether `path` is a plain PyTorch DCP checkpoint (upstream Megatron-LM's torch_dcp): DCP's `.metadata`, which
    its save writes after every rank's files, and no metadata.json (megatron-core's torch_dist has both)."""
    return storage.stat(paths.join(path, paths.DCP_METADATA)) is not None and \
        storage.stat(paths.join(path, paths.METADATA)) is None
