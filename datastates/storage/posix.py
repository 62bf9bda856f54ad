"""The POSIX backend (local disks, Lustre, NFS): aligned writes through the native pool with O_DIRECT where the
file system accepts it, and rename-atomic publication in the documented fsync order (`publish`)."""
from __future__ import annotations

import errno
import os
import shutil

from .. import _native
from .. import commit
from .. import format as fmt
from . import Storage

class PosixStorage(Storage):
    """A POSIX file system. Rank 0 keeps, per save root, the published iterations (for retention, scanned once)
    and an open descriptor (for its fsyncs)."""

    def __init__(self, fsync: bool = True, direct_io: str = "auto"):
        self.fsync, self.direct_io = fsync, direct_io
        self._published: dict[str, list[int]] = {}
        self._root_fds: dict[str, int] = {}
        self._emptying: list[list] = []  # rank 0: retired directories the ranks are emptying, [path, looks]

    def open_data(self, partial: str, rank: int, nbytes: int) -> _native.File:
        return _native.File(os.path.join(partial, fmt.data_file(rank)), "w", self.direct_io, nbytes)

    def close_data(self, data: _native.File, nbytes: int) -> None:
        data.truncate(nbytes)
        if self.fsync:
            data.fsync()
        data.close()

    def publish(self, partial, final, metadata, keep_last):
        root = os.path.dirname(final) or "."
        iteration = commit.iteration_of(final)
        published = None
        if keep_last is not None and iteration is not None:
            if root not in self._published:  # scanned once per save root, then kept up to date by retention
                self._published[root] = commit.published_iterations(root)
            published = self._published[root]
        if self.fsync and root not in self._root_fds:
            self._root_fds[root] = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
        return publish(partial, final, metadata, self.fsync, keep_last, published, self._root_fds.get(root))

    def delete(self, retired, rank, world_size):
        """Every rank deletes its share (`deletes`); rank 0 then removes the emptied directories, looking
        again at each publication, and after a few looks (a rank died, or the checkpoint came from a larger
        world) removes what is left itself."""
        for path in retired:
            for name in deletes(rank, world_size):
                try:
                    os.unlink(os.path.join(path, name))
                except FileNotFoundError:
                    pass
        if rank != 0:
            return
        still = []
        for entry in self._emptying:
            try:
                os.rmdir(entry[0])
            except FileNotFoundError:
                pass
            except OSError:
                entry[1] += 1
                if entry[1] < 3:
                    still.append(entry)
                else:
                    shutil.rmtree(entry[0], ignore_errors=True)
        self._emptying = still + [[path, 0] for path in retired]

    def sweep(self):
        for path, _ in self._emptying:
            shutil.rmtree(path, ignore_errors=True)
        self._emptying = []

    def close(self):
        for fd in self._root_fds.values():
            os.close(fd)
        self._root_fds = {}


def apply_retention(save_dir: str, keep_last: int, protect: int, published: list[int]) -> list[str]:
    """`protect` was just published: add it to `published` (sorted; kept up to date in place), then retire all
    but the newest `keep_last` of them, never `protect`; returns the retired directories, to be deleted off the
    critical path."""
    if protect not in published:
        published.append(protect)
        published.sort()
    keep = set(published[-keep_last:]) | {protect}
    doomed = [i for i in published if i not in keep]
    published[:] = [i for i in published if i in keep]
    return [commit.retire(commit.checkpoint_dir(save_dir, i)) for i in doomed]


def deletes(rank: int, world_size: int) -> list[str]:
    """The files of a retired checkpoint that `rank` deletes: its own; rank 1 also rank 0's and the index. Rank 0,
    which publishes, only renames the directory out of sight and removes it once it is empty, so no rank's
    share of a deletion grows with the world size. Alone, rank 0 deletes everything."""
    if world_size == 1:
        return [fmt.METADATA, fmt.data_file(0), fmt.manifest_file(0)]
    mine = [fmt.data_file(rank), fmt.manifest_file(rank)] if rank else []
    return mine + ([fmt.METADATA, fmt.data_file(0), fmt.manifest_file(0)] if rank == 1 else [])


def _sync_dir(path: str, fd: int | None) -> None:
    if fd is None:
        fmt.fsync_dir(path)
    else:
        os.fsync(fd)


def publish(partial: str, final: str, metadata: dict, fsync: bool = True, keep_last: int | None = None,
            published: list[int] | None = None, root_fd: int | None = None) -> list[str]:
    """Rank 0: make a checkpoint visible, retire old ones, point `latest` at it. Returns the retired directories
    (renamed out of sight, durably): those of retention and an earlier save of the same iteration, if any.

    Order, each step durable before the next depends on it:
      1. metadata.json is written into the unpublished directory and fsynced, then the directory is fsynced: the
         index and every rank's file entries are durable (no temporary name: the directory is not visible yet);
      2. the directory is renamed into place, the parent fsynced: the checkpoint is durable;
      3. old checkpoints are renamed out of sight (`keep_last`, `published` as in `apply_retention`) and the
         tracker is replaced; one fsync of the parent makes both durable.
    A crash leaves `latest` naming the new checkpoint or the previous one (`read_latest` skips a tracker that
    names a retired one), and no rank deletes from a retired directory before its rename is durable.
    `root_fd` is an open descriptor of the parent, to spare an open per publication."""
    fmt.write_file(os.path.join(partial, fmt.METADATA), fmt.encode_json(metadata), fsync)
    if fsync:
        fmt.fsync_dir(partial)
    parent = os.path.dirname(final) or "."
    retired = []
    try:
        os.rename(partial, final)
    except OSError as e:  # re-saving an iteration: the new one wins
        if e.errno not in (errno.EEXIST, errno.ENOTEMPTY):
            raise
        # No rename replaces a non-empty directory: a crash before the second rename leaves the old one under
        # `.deleting` and none under `final`; `clean_stale` gives the old one its name back.
        retired.append(commit.retire(final))
        os.rename(partial, final)
    if fsync:
        _sync_dir(parent, root_fd)
    iteration = commit.iteration_of(final)
    if iteration is not None:
        if keep_last is not None:
            retired += apply_retention(parent, keep_last, iteration, published)
        commit.write_latest(parent, iteration, fsync, sync_dir=False)
        if fsync:
            _sync_dir(parent, root_fd)
    return retired
