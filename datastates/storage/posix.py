"""The POSIX backend (local disks, Lustre, NFS): aligned writes through the native pool with O_DIRECT where the
file system accepts it, reads as one sequential stream or several O_DIRECT reads in flight, and rename-atomic
publication in the documented fsync order (`PosixStorage.publish`)."""
from __future__ import annotations

import errno
import functools
import os
import shutil
import threading
import time

from .. import _native
from .. import layout
from .base import DataSink, DataSource, Storage, retention

# Writers run at a lower priority than training and the snapshot copies: a flush may take a little longer,
# the copies the fence waits for and the next step do not.
WRITER_NICE = 5

# How a load reads the data files. "stream" (the default): each file as one sequential stream through the page
# cache. "parallel": as many reads of a file in flight as the read pool has threads, with O_DIRECT as `direct_io`
# says. Why stream is the default, measured: docs/architecture.md, "A load".
READ_MODES = ("stream", "parallel")

# A load's native read threads: in read mode "parallel", the 8 MiB reads in flight per rank (a read waits on the
# device's latency, not the CPU; measured in docs/architecture.md, "A load"); in "stream", how many data files
# are read at once.
DEFAULT_READ_THREADS = 8


def check_read_mode(read_mode: str) -> None:
    if read_mode not in READ_MODES:
        raise ValueError(f"read_mode must be one of {READ_MODES}, not {read_mode!r}")


class FileSink(DataSink):
    """A data file written by the native pool: pwrite and crc32c on its threads."""

    def __init__(self, path: str, direct_io: str, nbytes: int, writers: _native.IOPool, fsync: bool):
        self.file = _native.File(path, "w", direct_io, nbytes)
        self.path, self.writers, self.fsync = path, writers, fsync
        self.direct = self.file.direct

    def submit(self, buffer, offset, segments):
        ticket = self.writers.submit_write(self.file, buffer.data_ptr(), buffer.numel(), offset, segments)
        return functools.partial(self.writers.wait, ticket)

    def close(self, nbytes):
        self.direct = self.file.direct  # whether O_DIRECT stayed in use: closing the file clears it
        self.file.truncate(nbytes)
        if self.fsync:
            self.file.fsync()
        self.file.close()

    def discard(self):
        self.file.close()


class FileSource(DataSource):
    def __init__(self, path: str, readers: _native.IOPool, read_mode: str, direct_io: str):
        self.path, self.readers = path, readers
        self.streams = read_mode == "stream"
        self.file = (_native.File(path, "r", "off", stream=True) if self.streams
                     else _native.File(path, "r", direct_io))

    def size(self):
        return self.file.size()

    def submit(self, buffer, nbytes, offset, segments):
        ticket = self.readers.submit_read(self.file, buffer.data_ptr(), nbytes, offset, segments)
        return functools.partial(self.readers.wait, ticket)

    def close(self):
        self.file.close()


class PosixStorage(Storage):
    """A POSIX file system. Rank 0 keeps, per save root, the published iterations (for retention, scanned once)
    and an open descriptor (for its fsyncs). The native pools are made at first use: a reader never starts
    writer threads."""

    def __init__(self, fsync: bool = True, direct_io: str = "auto", writer_threads: int = 4,
                 read_threads: int = DEFAULT_READ_THREADS, read_mode: str = "stream"):
        check_read_mode(read_mode)
        if read_threads < 1:
            raise ValueError(f"read_threads must be >= 1, got {read_threads}")
        self.fsync, self.direct_io, self.read_mode = fsync, direct_io, read_mode
        self._threads = {"write": writer_threads, "read": read_threads}
        self._pools: dict[str, _native.IOPool] = {}
        self._pools_lock = threading.Lock()
        self._published: dict[str, list[int]] = {}
        self._root_fds: dict[str, int] = {}
        self._emptying: list[list] = []  # rank 0: retired directories the ranks are emptying, [path, looks]

    def _pool(self, kind: str) -> _native.IOPool:
        """The writers (below training's priority) or the readers (a restart waits on them: normal priority)."""
        with self._pools_lock:
            if kind not in self._pools:
                self._pools[kind] = _native.IOPool(self._threads[kind], WRITER_NICE if kind == "write" else 0)
            return self._pools[kind]

    # ----- saving -----

    def prepare(self, final):
        partial = layout.partial_dir(final)
        make_dir(partial)
        return partial

    def open_data(self, partial, rank, nbytes):
        return FileSink(layout.join(partial, layout.data_file(rank)), self.direct_io, nbytes, self._pool("write"),
                        self.fsync)

    def write_manifest(self, partial, rank, doc):
        # the directory entry is made durable by rank 0's fsync of the directory at publication
        write_file(layout.join(partial, layout.manifest_file(rank)), doc, self.fsync)

    def publish(self, partial, final, index, keep_last):
        """Rank 0: make a checkpoint visible, retire old ones, point the tracker at it. Returns the retired
        directories (renamed out of sight, durably): those of retention and an earlier save of the same
        iteration, if any.

        Order, each step durable before the next depends on it:
          1. metadata.json is written into the unpublished directory and fsynced, then the directory is fsynced:
             the index and every rank's file entries are durable (no temporary name: the directory is not
             visible yet);
          2. the directory is renamed into place, the parent fsynced: the checkpoint is durable;
          3. old checkpoints are renamed out of sight and the tracker is replaced; one fsync of the parent makes
             both durable.
        A crash leaves the tracker naming the new checkpoint or the previous one (`tracker.find_latest` skips a
        tracker that names a retired one), and no rank deletes from a retired directory before its rename is
        durable."""
        write_file(layout.join(partial, layout.METADATA), index, self.fsync)
        if self.fsync:
            fsync_dir(partial)
        root = layout.parent(final)
        retired = []
        try:
            os.rename(partial, final)
        except OSError as e:  # re-saving an iteration: the new one wins
            if e.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
            # No rename replaces a non-empty directory: a crash before the second rename leaves the old one under
            # `.deleting` and none under `final`; `clean_leftovers` gives the old one its name back.
            retired.append(retire(final))
            os.rename(partial, final)
        self._sync_root(root)
        iteration = layout.iteration_of(final)
        if iteration is not None:
            if keep_last is not None:
                if root not in self._published:  # scanned once per save root, then kept up to date here
                    self._published[root] = self.published(root)
                doomed = retention(self._published[root], keep_last, iteration)
                retired += [retire(layout.checkpoint_dir(root, i)) for i in doomed]
            self._replace_tracker(root, iteration)
            self._sync_root(root)
        return retired

    def _sync_root(self, root: str) -> None:
        if not self.fsync:
            return
        if root not in self._root_fds:
            self._root_fds[root] = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
        os.fsync(self._root_fds[root])

    def _replace_tracker(self, root: str, iteration: int) -> None:
        """Replace the tracker atomically (a reader never sees it empty); its directory entry is the caller's
        to sync."""
        tracker = layout.join(root, layout.TRACKER)
        tmp = f"{tracker}.tmp.{os.getpid()}"
        write_file(tmp, str(iteration).encode(), self.fsync)
        os.replace(tmp, tracker)

    def write_tracker(self, root, iteration):
        self._replace_tracker(root, iteration)
        if self.fsync:
            fsync_dir(root)

    def abandon(self, partial):
        shutil.rmtree(partial, ignore_errors=True)

    def delete(self, retired, rank, world_size):
        """Every rank deletes its share (`deletes`); rank 0 then removes the emptied directories, looking
        again at each publication, and after a few looks (a rank died, or the checkpoint came from a larger
        world) removes what is left itself."""
        for path in retired:
            for name in deletes(rank, world_size):
                try:
                    os.unlink(layout.join(path, name))
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
        with self._pools_lock:
            pools, self._pools = list(self._pools.values()), {}
        for pool in pools:
            pool.close()

    # ----- reading -----

    def open_source(self, path):
        return FileSource(path, self._pool("read"), self.read_mode, self.direct_io)

    def read_bytes(self, path):
        with open(path, "rb") as f:
            return f.read()

    def version(self, path):
        try:
            st = os.stat(path)
        except OSError:
            return None
        return st.st_ino, st.st_mtime_ns, st.st_size

    # ----- the save root -----

    def list(self, path):
        try:
            return os.listdir(path)
        except (FileNotFoundError, NotADirectoryError):
            return []

    def exists(self, path):
        return os.path.exists(path)

    def size(self, path):
        return os.path.getsize(path)

    def clean_leftovers(self, root):
        """`.partial` and `.deleting` directories and temporary trackers go. A re-save of the tracker's iteration
        killed between moving the old directory aside and renaming the new one into place is rolled back first:
        the old one gets its name again (see `publish`)."""
        removed = []
        names = self.list(root)
        try:
            text = self.read_bytes(layout.join(root, layout.TRACKER)).decode().strip()
        except (OSError, UnicodeDecodeError):
            text = ""
        final = layout.checkpoint_dir(root, int(text)) if text.isdigit() else None
        if final is not None and not os.path.exists(final):
            prefix = layout.name(final) + layout.DELETING + "."
            for name in sorted(n for n in names if n.startswith(prefix)):
                if self.is_published(layout.join(root, name)):
                    os.rename(layout.join(root, name), final)
                    names.remove(name)
                    break
        for name in names:
            path = layout.join(root, name)
            if name.endswith(layout.PARTIAL) or layout.DELETING in name:
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
            elif ".tmp." in name and name.startswith(layout.TRACKER):
                os.unlink(path)
                removed.append(path)
        return removed


def deletes(rank: int, world_size: int) -> list[str]:
    """The files of a retired checkpoint that `rank` deletes: its own; rank 1 also rank 0's and the index. Rank 0,
    which publishes, only renames the directory out of sight and removes it once it is empty, so no rank's
    share of a deletion grows with the world size. Alone, rank 0 deletes everything."""
    if world_size == 1:
        return [layout.METADATA, layout.data_file(0), layout.manifest_file(0)]
    mine = [layout.data_file(rank), layout.manifest_file(rank)] if rank else []
    return mine + ([layout.METADATA, layout.data_file(0), layout.manifest_file(0)] if rank == 1 else [])


def retire(path: str) -> str:
    """Take a checkpoint out of sight in one atomic rename; returns the new name, for the caller to delete
    (deleting large files can take long, e.g. on file systems mounted with discard). A crash before the
    deletion leaves a `.deleting` leftover that `clean_leftovers` removes."""
    doomed = f"{path}{layout.DELETING}.{os.getpid()}.{time.monotonic_ns()}"
    os.rename(path, doomed)
    return doomed


def make_dir(path: str) -> None:
    """One mkdir where the save root exists (the other ranks' mkdir of the same directory may come first)."""
    try:
        os.mkdir(path)
    except FileExistsError:
        pass
    except FileNotFoundError:
        os.makedirs(path, exist_ok=True)


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file(path: str, data, fsync: bool, offset: int | None = None) -> None:
    """Create or truncate `path` with `data` (bytes-like), or with `offset` write `data` there into the existing
    file; fsynced as asked: plain system calls, no stat of a buffered file object."""
    flags = os.O_WRONLY | os.O_CLOEXEC | (os.O_CREAT | os.O_TRUNC if offset is None else 0)
    fd = os.open(path, flags, 0o644)
    try:
        view, at = memoryview(data).cast("B"), offset or 0
        while view:
            n = os.pwrite(fd, view, at)
            view, at = view[n:], at + n
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)

