"""The shared-memory backend: the node-local memory tier's storage (a /dev/shm-style directory). Data files are
mapped and the snapshot is copied straight into their pages; nothing is fsynced; a retired checkpoint's pages
are reused by the next one, and the pages of the first ones can be made ahead, in the background (`ahead`)."""
from __future__ import annotations

import errno
import itertools
import logging
import os
import threading

import torch

from .. import _native
from .. import paths
from ..save_plan import ALIGN, align_up
from ..slots import cuda_host_register
from .base import DataSink
from .posix import DEFAULT_READ_THREADS, PosixOptions, PosixStorage, retire, write_file

log = logging.getLogger(__name__)

SPARES = "spare" + paths.DELETING  # a memory tier's reusable pages, out of sight of every reader (clean_leftovers)
_NOTHING = torch.empty(0, dtype=torch.uint8)


class MappedSink(DataSink):
    """A data file in shared memory and its pages, mapped for the life of the storage that made it: the engine
    copies into `pages`, a storage level writes from them, replication sends them. What comes past the pages (the
    pickled objects) is written to the file."""

    def __init__(self, path: str, nbytes: int, pinned: bool, touch: bool = False):
        """`touch`: map every page now (a save into it then pays no page faults)."""
        self.path, self.nbytes, self.pinned = path, nbytes, pinned
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            os.posix_fallocate(fd, 0, nbytes)  # a full memory file system fails here, not as SIGBUS in a copy
        finally:
            os.close(fd)
        self.pages = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
        if pinned:  # the snapshot's device copies land here asynchronously, as in a staging slot
            cuda_host_register(self.pages.data_ptr(), nbytes)
        elif touch:
            self.pages[::ALIGN].zero_()
        self.final: str | None = None  # the checkpoint it belongs to, by its published name

    def submit(self, buffer, offset, segments):
        base = buffer.data_ptr()
        if base != self.pages.data_ptr() + offset:  # not the pages themselves: bytes for the file
            write_file(self.path, buffer.numpy(), fsync=False, offset=offset)
        crcs = [_native.crc32c_ptr(base + start, n) for start, n in segments]
        return lambda: crcs

    def close(self, nbytes):
        os.truncate(self.path, max(nbytes, self.nbytes))  # objects past the pages, and never below the mapping

    def unmap(self) -> None:
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.pages.data_ptr())
        self.pages = None


class SharedMemoryStorage(PosixStorage):
    """One rank's own checkpoints (world size 1) in a memory file system: mapped data files, no fsync; read like
    any file system (`PosixStorage`). It lends pages (`base.PageLending`).

    A published checkpoint's pages stay mapped: a storage level writes from them (`hold`, `release`). When
    retention retires it, its file moves aside as a spare, still mapped, and the next checkpoint that fits
    takes it over. The memory tier's own bookkeeping (its directories, the space left) goes through here too."""

    spreads_deletes = False  # a retired checkpoint is removed whole: its pages become a spare

    def __init__(self, pinned: bool | None = None, writer_threads: int = 4, read_threads: int = DEFAULT_READ_THREADS,
                 read_mode: str = "stream", ahead: int = 0):
        """`writer_threads` size the staging slots of a save's objects (its tensors are copied into the pages).
        `ahead`: when the first save finds no spare pages, this many more of its size are made in the background
        (mapped, faulted in, pinned with CUDA), so that the saves that follow it do not make theirs on their way."""
        super().__init__(PosixOptions(writer_threads=writer_threads, read_threads=read_threads, fsync=False,
                                      direct_io="off", read_mode=read_mode))
        self.pinned = torch.cuda.is_available() if pinned is None else pinned
        self._lock = threading.Lock()  # the engine's stage threads and its deleter share the maps
        self._live: dict[str, MappedSink] = {}  # checkpoint directory (partial, final or retired) -> its data
        self._spares: list[MappedSink] = []
        self._holds: dict[str, int] = {}  # checkpoint (final name) -> saves writing from its pages
        self._held_retired: dict[str, list[MappedSink]] = {}  # retired while held: dropped at the last release
        self.ahead = ahead
        self._making = 0  # spares being made ahead: a save that finds none waits for them instead
        self._made = threading.Condition(self._lock)
        self._names = itertools.count()
        self._closed = False

    def open_data(self, path, nbytes):
        partial = paths.parent(path)
        nbytes = max(align_up(nbytes), ALIGN)
        with self._lock:
            while (spare := next((s for s in self._spares if s.nbytes >= nbytes), None)) is None and self._making:
                self._made.wait()
            if spare is not None:
                self._spares.remove(spare)
            elif self.ahead and not self._closed:  # once: later saves take retired pages (at most keep + 2 files)
                self._making, self.ahead = self.ahead, 0
                threading.Thread(target=self._make_ahead, args=(paths.parent(partial), nbytes, self._making,
                                                                torch.cuda.current_device() if self.pinned else None),
                                 name="ds-pages-ahead", daemon=True).start()
        if spare is not None:
            os.rename(spare.path, path)
            spare.path = path
            data = spare
        else:
            data = MappedSink(path, nbytes, self.pinned)
        data.final = partial[:-len(paths.PARTIAL)] if partial.endswith(paths.PARTIAL) else partial
        with self._lock:
            self._live[partial] = data
        return data

    def open_file(self, path, nbytes):
        """A plain file of the memory file system (`PageLending.open_file`)."""
        return super().open_data(path, nbytes)

    def data_of(self, checkpoint: str) -> MappedSink | None:
        """The mapped data of a checkpoint this storage wrote and still holds."""
        with self._lock:
            return self._live.get(paths.normalize(checkpoint))

    def _move(self, old: str, new: str) -> None:
        """The mapped data of the checkpoint `old` follows it to `new`."""
        with self._lock:
            data = self._live.pop(old, None)
            if data is not None:
                data.path = paths.join(new, paths.name(data.path))
                self._live[new] = data

    def commit(self, partial, final, replace=True):
        if not replace and os.path.isdir(final) and os.listdir(final):
            raise FileExistsError(errno.ENOTEMPTY, "not empty", final)
        retired = [self._retire(final)] if os.path.isdir(final) else []  # re-saving an iteration: the new one wins
        self._move(partial, final)
        os.rename(partial, final)
        return retired

    def retire(self, path, marker):
        return self._retire(path)

    def _retire(self, path: str) -> str:
        doomed = retire(path)
        self._move(path, doomed)
        return doomed

    def remove(self, path):
        """A failed save's pages go; a retired checkpoint's are kept for the next one."""
        with self._lock:
            data = self._live.pop(path, None)
        if data is not None:
            if path.endswith(paths.PARTIAL):
                self._drop(data)
            else:
                self._spare(data, paths.parent(path))
        super().remove(path)

    def _spare(self, data: MappedSink, root: str) -> None:
        """Keep a retired checkpoint's pages for the next one, unless a save still writes from them (then they
        go when it lets go)."""
        with self._lock:
            if self._holds.get(data.final):
                self._held_retired.setdefault(data.final, []).append(data)
                return
        spares = paths.join(root, SPARES)  # a crash leaves it to clean_leftovers
        spare = paths.join(spares, str(id(data)))
        try:
            os.makedirs(spares, exist_ok=True)
            os.rename(data.path, spare)
        except OSError:
            self._drop(data)
            return
        data.path = spare
        with self._lock:
            self._spares.append(data)

    def _make_ahead(self, root: str, nbytes: int, count: int, device: int | None) -> None:
        """Make `count` spares of `nbytes` under `root` (where retention puts them), one after the other, each
        offered to the saves as soon as it is made."""
        if device is not None:
            torch.cuda.set_device(device)
        spares = paths.join(root, SPARES)
        try:
            for _ in range(count):
                with self._lock:
                    if self._closed:
                        return
                os.makedirs(spares, exist_ok=True)
                data = MappedSink(paths.join(spares, f"ahead_{next(self._names)}"), nbytes, self.pinned, touch=True)
                with self._lock:
                    self._spares.append(data)
                    self._making -= 1
                    self._made.notify_all()
        except OSError as e:  # e.g. the memory file system is full: saves make their pages as they go
            log.warning("memory tier: cannot make pages ahead under %s: %s", spares, e)
        finally:
            with self._lock:
                self._making = 0
                self._made.notify_all()

    def _drop(self, data: MappedSink) -> None:
        try:
            os.unlink(data.path)
        except OSError:
            pass
        data.unmap()

    def close(self):
        with self._lock:
            self._closed = True
            self._made.wait_for(lambda: not self._making)  # a spare being made is dropped with the others
            spares, self._spares = self._spares, []
            live, self._live = list(self._live.values()), {}
        for data in spares:
            self._drop(data)
        for data in live:  # the files stay: they are the tier
            data.unmap()
        super().close()

    # ----- lending pages (base.PageLending) -----

    def hold(self, checkpoint: str) -> None:
        """A save writes from the pages of `checkpoint` (its final name): they are not reused until `release`."""
        with self._lock:
            self._holds[checkpoint] = self._holds.get(checkpoint, 0) + 1

    def release(self, checkpoint: str) -> None:
        with self._lock:
            self._holds[checkpoint] -= 1
            gone = [] if self._holds[checkpoint] else self._held_retired.pop(checkpoint, [])
            if not self._holds[checkpoint]:
                del self._holds[checkpoint]
        for data in gone:
            self._drop(data)

    def mapped(self, path: str, nbytes: int, writable: bool = False) -> torch.Tensor:
        """The first `nbytes` of the data file `path`, mapped from the tier's pages (never copied here; a reused
        file may be longer than its data). `writable`: a new file of `nbytes`, whose pages are what is written
        into the tensor (a replica received in pieces straight into them)."""
        if writable:
            with open(path, "wb") as f:
                f.truncate(nbytes)
        return torch.from_file(path, shared=writable, size=nbytes, dtype=torch.uint8) if nbytes else _NOTHING

    def move(self, src: str, dst: str) -> None:
        """Pages this process maps follow the checkpoint they belong to."""
        self._move(paths.normalize(src), paths.normalize(dst))
        os.rename(src, dst)

    def link(self, src: str, dst: str) -> None:
        os.link(src, dst)

    def make_dirs(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)

    def remove_empty(self, path: str) -> None:
        """`path` goes if it is a file or an empty directory; else (another rank's files are there) it stays."""
        try:
            (os.rmdir if os.path.isdir(path) else os.unlink)(path)
        except OSError:
            pass

    def free_bytes(self, path: str) -> int:
        """The space left in the memory file system holding `path` (made if missing)."""
        os.makedirs(path, exist_ok=True)
        st = os.statvfs(path)
        return st.f_bavail * st.f_frsize
