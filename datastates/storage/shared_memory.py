"""The shared-memory backend: the node-local memory tier's storage (a /dev/shm-style directory). Data files are
mapped and the snapshot is copied straight into their pages; nothing is fsynced; a retired checkpoint's pages
are reused by the next one."""
from __future__ import annotations

import os
import shutil
import threading

import torch

from .. import _native
from .. import commit
from .. import format as fmt
from ..errors import CheckpointCorruptError
from ..plan import ALIGN, align_up
from ..staging import cuda_host_register
from . import Storage

SPARES = "spare" + commit.DELETING  # a memory tier's reusable pages, out of sight of every reader (clean_stale)


class MappedData:
    """A data file in shared memory and its pages, mapped for the life of the storage that made it: the engine
    copies into `buffer`, a storage level writes from it, replication sends it."""

    direct = False

    def __init__(self, path: str, nbytes: int, pinned: bool):
        self.path, self.nbytes, self.pinned = path, nbytes, pinned
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            os.posix_fallocate(fd, 0, nbytes)  # a full memory file system fails here, not as SIGBUS in a copy
        finally:
            os.close(fd)
        self.buffer = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
        if pinned:  # the snapshot's device copies land here asynchronously, as in a staging slot
            cuda_host_register(self.buffer.data_ptr(), nbytes)
        self.final: str | None = None  # the checkpoint it belongs to, by its published name

    def write(self, offset: int, data: bytes) -> None:
        """Bytes past the mapped pages (the pickled objects), written to the file."""
        fd = os.open(self.path, os.O_WRONLY | os.O_CLOEXEC)
        try:
            view = memoryview(data)
            while view:
                n = os.pwrite(fd, view, offset)
                view, offset = view[n:], offset + n
        finally:
            os.close(fd)

    def crc(self, start: int, nbytes: int) -> int:
        return _native.crc32c_ptr(self.buffer.data_ptr() + start, nbytes)

    def unmap(self) -> None:
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.buffer.data_ptr())
        self.buffer = None


class SharedMemoryStorage(Storage):
    """One rank's own checkpoints (world size 1) in a memory file system: mapped data files, no fsync.

    A published checkpoint's data stays mapped (`data_of`): a storage level writes from those pages. When
    retention retires it, its file moves aside as a spare, still mapped, and the next checkpoint that fits
    takes it over."""

    mapped = True
    fsync = False

    def __init__(self, pinned: bool | None = None):
        self.pinned = torch.cuda.is_available() if pinned is None else pinned
        self._lock = threading.Lock()  # the engine's stage threads and its deleter share the maps
        self._live: dict[str, MappedData] = {}  # checkpoint directory (partial or final) -> its data
        self._spares: list[MappedData] = []
        self._holds: dict[str, int] = {}  # checkpoint (final name) -> saves writing from its pages
        self._held_retired: dict[str, list[MappedData]] = {}  # retired while held: dropped at the last release

    def open_data(self, partial, rank, nbytes):
        path = os.path.join(partial, fmt.data_file(rank))
        nbytes = max(align_up(nbytes), ALIGN)
        with self._lock:
            spare = next((s for s in self._spares if s.nbytes >= nbytes), None)
            if spare is not None:
                self._spares.remove(spare)
        if spare is not None:
            os.rename(spare.path, path)
            spare.path = path
            data = spare
        else:
            data = MappedData(path, nbytes, self.pinned)
        data.final = partial[:-len(commit.PARTIAL)]
        with self._lock:
            self._live[partial] = data
        return data

    def close_data(self, data: MappedData, nbytes: int) -> None:
        os.truncate(data.path, max(nbytes, data.nbytes))  # objects past the pages, and never below the mapping

    def data_of(self, checkpoint: str) -> MappedData | None:
        """The mapped data of a checkpoint this storage wrote and still holds."""
        with self._lock:
            return self._live.get(os.path.normpath(checkpoint))

    def publish(self, partial, final, metadata, keep_last):
        with self._lock:
            data = self._live.pop(partial, None)
            if data is not None:
                self._live[final] = data
                data.path = os.path.join(final, os.path.basename(data.path))
        if metadata is not None:  # None: a received replica, whose index is in place
            fmt.write_file(os.path.join(partial, fmt.METADATA), fmt.encode_json(metadata), fsync=False)
        retired = []
        if os.path.isdir(final):  # re-saving an iteration: the new one wins
            retired.append(self._retire(final))
        os.rename(partial, final)
        root = os.path.dirname(final) or "."
        if keep_last is not None:
            doomed = commit.published_iterations(root)[:-keep_last]
            retired += [self._retire(commit.checkpoint_dir(root, it)) for it in doomed]
        return retired

    def receive(self, final: str, index: bytes, data: torch.Tensor, keep: int) -> None:
        """Publish a checkpoint another rank sent (a replica): its data file and its index, refused unless the
        index verifies and describes that data; then keep the newest `keep` of its save root."""
        partial = commit.partial_dir(final)
        shutil.rmtree(partial, ignore_errors=True)
        os.makedirs(partial)
        try:
            fmt.write_file(os.path.join(partial, fmt.data_file(0)), data.numpy(), fsync=False)
            fmt.write_file(os.path.join(partial, fmt.METADATA), index, fsync=False)
            part = fmt.read_index(os.path.join(partial, fmt.METADATA)).part(0)
            if part.data_bytes != data.numel():
                raise CheckpointCorruptError(f"replica {final!r}: the index says {part.data_bytes} data bytes, "
                                             f"{data.numel()} came")
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise
        self.delete(self.publish(partial, final, None, keep), 0, 1)

    def _retire(self, path: str) -> str:
        doomed = commit.retire(path)
        with self._lock:
            data = self._live.pop(path, None)
            if data is not None:
                data.path = os.path.join(doomed, os.path.basename(data.path))
                self._live[doomed] = data
        return doomed

    def abandon(self, partial):
        with self._lock:
            data = self._live.pop(partial, None)
        if data is not None:
            self._drop(data)
        super().abandon(partial)

    def delete(self, retired, rank, world_size):
        for path in retired:
            with self._lock:
                data = self._live.pop(path, None)
            if data is not None:
                self._spare(data, os.path.dirname(path))
            shutil.rmtree(path, ignore_errors=True)

    def _spare(self, data: MappedData, root: str) -> None:
        """Keep a retired checkpoint's pages for the next one, unless a save still writes from them (then they
        go when it lets go)."""
        with self._lock:
            if self._holds.get(data.final):
                self._held_retired.setdefault(data.final, []).append(data)
                return
        spares = os.path.join(root, SPARES)  # a crash leaves it to commit.clean_stale
        spare = os.path.join(spares, str(id(data)))
        try:
            os.makedirs(spares, exist_ok=True)
            os.rename(data.path, spare)
        except OSError:
            self._drop(data)
            return
        data.path = spare
        with self._lock:
            self._spares.append(data)

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

    def _drop(self, data: MappedData) -> None:
        try:
            os.unlink(data.path)
        except OSError:
            pass
        data.unmap()

    def sweep(self):
        with self._lock:
            spares, self._spares = self._spares, []
        for data in spares:
            self._drop(data)

    def close(self):
        self.sweep()
        with self._lock:
            live, self._live = list(self._live.values()), {}
        for data in live:  # the files stay: they are the tier
            data.unmap()
