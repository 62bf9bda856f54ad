"""The POSIX backend (local disks, Lustre, NFS): aligned writes through the native pool with O_DIRECT where the
file system accepts it, reads as one sequential stream or several O_DIRECT reads in flight, and rename-atomic
commits in the documented fsync order (`PosixStorage.commit`; the order of publication is `save_root`'s)."""
from __future__ import annotations

import dataclasses
import errno
import functools
import os
import shutil
import threading
import time

from .. import _native
from .. import paths
from ..priority import added_from_here, background_nice
from .base import DataSink, DataSource, Options, Stat, Storage

# How a load reads the data files. "stream" (the default): each file as one sequential stream through the page
# cache. "parallel": as many reads of a file in flight as the read pool has threads, with O_DIRECT as `direct_io`
# says. Why stream is the default, measured: docs/architecture.md, "A load".
READ_MODES = ("stream", "parallel")

# A load's native read threads: in read mode "parallel", the 8 MiB reads in flight per rank (a read waits on the
# device's latency, not the CPU; measured in docs/architecture.md, "A load"); in "stream", how many data files
# are read at once.
DEFAULT_READ_THREADS = 8

TEMPORARY = ".tmp."  # a replacing write_bytes writes `<name>.tmp.<pid>`, then renames it over `<name>`


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


@dataclasses.dataclass(frozen=True)
class PosixOptions(Options):
    """How a file system is written and read: the native `writer_threads` and `read_threads`, `fsync` (data
    files, small files and directories made durable), `direct_io` ("auto", "on", "off": O_DIRECT where the file
    system accepts it; True and False read as "on" and "off"), and `read_mode` (READ_MODES)."""

    read_threads: int = DEFAULT_READ_THREADS
    fsync: bool = True
    direct_io: str = "auto"
    read_mode: str = "stream"

    def __post_init__(self):
        super().__post_init__()
        check_read_mode(self.read_mode)
        direct_io = {True: "on", False: "off"}.get(self.direct_io, self.direct_io)
        if direct_io not in ("auto", "on", "off"):
            raise ValueError(f"direct_io must be 'auto', 'on' or 'off', not {self.direct_io!r}")
        object.__setattr__(self, "direct_io", direct_io)


class PosixStorage(Storage):
    """A POSIX file system: a checkpoint is written into `iter_X.partial` and renamed into place; an open
    descriptor of each save root is kept for its fsyncs. The native pools are made at first use: a reader never
    starts writer threads."""

    def __init__(self, options: PosixOptions = PosixOptions()):
        self.options = options
        self.fsync, self.direct_io, self.read_mode = options.fsync, options.direct_io, options.read_mode
        self._threads = {"write": options.writer_threads, "read": options.read_threads}
        self._pools: dict[str, _native.IOPool] = {}
        self._pools_lock = threading.Lock()
        self._root_fds: dict[str, int] = {}
        self._nice = background_nice()  # the writers', taken here: a pool is started by whichever stage needs it

    def _pool(self, kind: str) -> _native.IOPool:
        """The writers (below training's priority) or the readers (a restart waits on them: normal priority)."""
        with self._pools_lock:
            if kind not in self._pools:
                added = added_from_here(self._nice) if kind == "write" else 0
                self._pools[kind] = _native.IOPool(self._threads[kind], added)
            return self._pools[kind]

    # ----- data objects -----

    def open_data(self, path, nbytes):
        return FileSink(path, self.direct_io, nbytes, self._pool("write"), self.fsync)

    def open_source(self, path):
        return FileSource(path, self._pool("read"), self.read_mode, self.direct_io)

    # ----- small objects -----

    def read_bytes(self, path):
        with open(path, "rb") as f:
            return f.read()

    def write_bytes(self, path, data, replace=False):
        if not replace:  # its directory entry is made durable by the commit's fsync of the directory
            write_file(path, data, self.fsync)
            return
        tmp = f"{path}{TEMPORARY}{os.getpid()}"
        write_file(tmp, data, self.fsync)
        os.replace(tmp, path)
        self._sync_dir(paths.parent(path))

    # ----- names -----

    def list(self, path):
        try:
            return os.listdir(path)
        except (FileNotFoundError, NotADirectoryError):
            return []

    def stat(self, path):
        try:
            st = os.stat(path)
        except OSError:
            return None
        return Stat(st.st_size, (st.st_ino, st.st_mtime_ns, st.st_size))

    def exists(self, path):
        return os.path.exists(path)

    def remove(self, path):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except IsADirectoryError:
            shutil.rmtree(path, ignore_errors=True)

    # ----- publication -----

    def temporary_of(self, name):
        head, sep, pid = name.rpartition(TEMPORARY)
        return head if sep and pid.isdigit() else None

    def stage(self, final, marker):
        partial = paths.partial_dir(final)
        make_dir(partial)
        return partial

    def commit(self, partial, final, replace=True):
        """The directory is fsynced (every file entry in it durable; no temporary name: it is not visible yet),
        renamed into place, its parent fsynced."""
        if self.fsync:
            fsync_dir(partial)
        retired = []
        try:
            os.rename(partial, final)
        except OSError as e:  # re-saving an iteration: the new one wins
            if e.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
            if not replace:  # the rename itself refused: no other writer's output is displaced
                raise FileExistsError(e.errno, "not empty", final) from None
            # No rename replaces a non-empty directory: a crash before the second rename leaves the old one under
            # `.deleting` and none under `final`; `SaveRoot.clean_leftovers` gives the old one its name back.
            retired.append(retire(final))
            os.rename(partial, final)
        self._sync_dir(paths.parent(final))
        return retired

    def retire(self, path, marker):
        retired = retire(path)
        self._sync_dir(paths.parent(path))  # durable before any rank removes a byte of it
        return retired

    def abort_uploads(self, root):
        return []

    def _sync_dir(self, root: str) -> None:
        """fsync a save root, through a descriptor kept open for the next publication."""
        if not self.fsync:
            return
        if root not in self._root_fds:
            self._root_fds[root] = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
        os.fsync(self._root_fds[root])

    def close(self):
        for fd in self._root_fds.values():
            os.close(fd)
        self._root_fds = {}
        with self._pools_lock:
            pools, self._pools = list(self._pools.values()), {}
        for pool in pools:
            pool.close()


def retire(path: str) -> str:
    """Take a checkpoint out of sight in one atomic rename; returns the new name, for the caller to delete
    (deleting large files can take long, e.g. on file systems mounted with discard). A crash before the
    deletion leaves a `.deleting` leftover that `SaveRoot.clean_leftovers` removes."""
    doomed = f"{path}{paths.DELETING}.{os.getpid()}.{time.monotonic_ns()}"
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
    except OSError as e:  # a write's error names no file by itself (e.g. EFBIG, ENOSPC)
        raise OSError(e.errno, e.strerror, path) from e
    finally:
        os.close(fd)

