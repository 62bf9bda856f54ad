"""The save root's policy, once for every backend (`storage.base.Storage` is bytes only): the order of
publication, the tracker, retention, who deletes a retired checkpoint, the clean-up of what killed saves left,
and which directories hold a checkpoint a load may resume from.

Publication (`Publisher.publish`, rank 0, once every rank reported its manifest), each step durable before the
next depends on it:
  1. the index is written into the unpublished place (`Storage.write_bytes`, durable where the storage syncs);
  2. the place is committed under its final name in one step (`Storage.commit`: on a file system an fsync of the
     directory, the rename, an fsync of the parent; on an object store the index's PUT was the step);
  3. retention retires the old checkpoints (`Storage.retire`: renamed aside, or their index deleted), then the
     tracker is replaced in one step (`write_bytes(replace=True)`, which makes both durable).
A crash leaves the tracker naming the new checkpoint or an older one (`tracker.find_latest` skips a tracker that
names a retired one); no rank removes a retired checkpoint's bytes before its retirement is durable.
"""
from __future__ import annotations

from . import paths
from .storage.base import DataSink, PageLending, Storage

LOOKS = 3  # rank 0 removes a retired directory the ranks are emptying after this many publications, whatever is left


class Publisher:
    """One engine's saves through `storage`. Rank 0 keeps, per save root, the published iterations (retention
    scans a root once, then keeps it up to date) and the retired directories the ranks are emptying. `tracker`:
    whether publication points the tracker at the new checkpoint (the memory tier keeps none: its restart lists
    every rank's parts)."""

    def __init__(self, storage: Storage, tracker: bool = True):
        self.storage, self.tracker = storage, tracker
        self._published: dict[str, list[int]] = {}
        self._emptying: list[list] = []  # rank 0: [retired path, looks]

    def prepare(self, final: str) -> str:
        """Every rank: the unpublished place of `final`, ready."""
        return self.storage.stage(final)

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
        keep the newest `keep_last` checkpoints of the save root, point the tracker at `final` (see the module
        docstring for the order). Returns what was retired, for `delete`."""
        storage = self.storage
        if index is not None:
            storage.write_bytes(paths.join(partial, paths.METADATA), index)
        retired = storage.commit(partial, final)
        root, iteration = paths.parent(final), paths.iteration_of(final)
        if iteration is None:
            return retired
        if keep_last is not None:
            if root not in self._published:
                self._published[root] = published(storage, root)
            doomed = retention(self._published[root], keep_last, iteration)
            retired += [storage.retire(paths.checkpoint_dir(root, i)) for i in doomed]
        if self.tracker:
            write_tracker(storage, root, iteration)
        return retired

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


def write_tracker(storage: Storage, root: str, iteration: int) -> None:
    """Point the tracker of `root` at `iteration`, replaced in one step (a reader never sees it empty)."""
    storage.write_bytes(paths.join(root, paths.TRACKER), str(iteration).encode(), replace=True)


def is_published(storage: Storage, path: str) -> bool:
    """Whether `path` is a checkpoint: its index is there (written last, so a reader never sees half of one)."""
    return storage.stat(paths.join(path, paths.METADATA)) is not None


def published(storage: Storage, root: str) -> list[int]:
    """The iterations of `root` with a published checkpoint, oldest first."""
    its = (paths.iteration_of(name) for name in storage.list(root))
    return sorted(i for i in its if i is not None and is_published(storage, paths.checkpoint_dir(root, i)))


def holds_legacy(storage: Storage, path: str) -> bool:
    """Whether `path` is in Megatron's legacy torch format: mp_rank_* directories, written without an index before
    the tracker names them."""
    return any(name.startswith("mp_rank_") for name in storage.list(path))


def holds_checkpoint(storage: Storage, path: str) -> bool:
    """Whether a load may resume from `path`: a published checkpoint (its metadata.json: this engine's format and
    megatron-core's torch_dist), or Megatron's legacy torch format (`holds_legacy`)."""
    return is_published(storage, path) or holds_legacy(storage, path)


def _tracked(storage: Storage, root: str) -> str:
    try:
        return storage.read_bytes(paths.join(root, paths.TRACKER)).decode().strip()
    except (OSError, UnicodeDecodeError):
        return ""


def clean_leftovers(storage: Storage, root: str) -> list[str]:
    """What saves killed before publication left under `root`, removed; returns what went. On one rank, before
    the first save of a run, while no rank saves: unpublished places (`.partial`), retired checkpoints
    (`.deleting`), temporary trackers, and on a storage that writes in place the iterations without an index that
    the tracker does not name; then every upload still open under `root`. A re-save of the tracker's iteration
    killed between retiring the old checkpoint and committing the new one is rolled back first: the old one gets
    its name again."""
    tracked = _tracked(storage, root)
    names = storage.list(root)
    final = paths.checkpoint_dir(root, int(tracked)) if tracked.isdigit() else None
    if final is not None and not storage.in_place and storage.stat(final) is None:
        prefix = paths.name(final) + paths.DELETING + "."
        for name in sorted(n for n in names if n.startswith(prefix)):
            if is_published(storage, paths.join(root, name)):
                storage.commit(paths.join(root, name), final)
                names.remove(name)
                break
    removed = []
    for name in names:
        path = paths.join(root, name)
        iteration = paths.iteration_of(name)
        unfinished = name.endswith(paths.PARTIAL) or paths.DELETING in name
        temporary = name.startswith(paths.TRACKER) and ".tmp." in name
        unindexed = (storage.in_place and iteration is not None and str(iteration) != tracked
                     and not is_published(storage, path))
        if (unfinished or temporary or unindexed) and storage.exists(path):  # an emptied prefix may be listed
            storage.remove(path)
            removed.append(path)
    return removed + storage.abort_uploads(root)
