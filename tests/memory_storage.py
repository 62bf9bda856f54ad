"""A fifth backend, written here to prove that a backend is one module: checkpoints in this process's memory
(mem://...), every operation of the storage contract (datastates/storage/base.py) and nothing else. A store that
renames: a checkpoint is written under `.partial` and committed by moving its keys under one lock. `capacity`
makes it a full disk: a write past it fails with ENOSPC."""
import errno
import threading

from datastates import _native, paths
from datastates.storage import DataSink, DataSource, Options, Stat, Storage


class MemoryStorage(Storage):
    spreads_deletes = False

    def __init__(self, capacity: int | None = None):
        self.options, self.capacity = Options(), capacity
        self.objects: dict[str, bytes | bytearray] = {}
        self.lock = threading.Lock()
        self.versions = 0

    def _put(self, path: str, data) -> None:
        with self.lock:
            used = sum(len(v) for k, v in self.objects.items() if k != path)
            if self.capacity is not None and used + len(data) > self.capacity:
                raise OSError(errno.ENOSPC, "no space left", path)
            self.versions += 1
            self.objects[paths.normalize(path)] = data

    def open_data(self, path, nbytes):
        self._put(path, bytearray())
        return MemorySink(self, paths.normalize(path))

    def open_source(self, path):
        return MemorySource(self.read_bytes(path), path)

    def read_bytes(self, path):
        with self.lock:
            data = self.objects.get(paths.normalize(path))
        if data is None:
            raise FileNotFoundError(errno.ENOENT, "no such object", path)
        return bytes(data)

    def write_bytes(self, path, data, replace=False):
        self._put(path, bytes(data))

    def list(self, path):
        prefix = paths.normalize(path) + "/"
        with self.lock:
            return sorted({k[len(prefix):].split("/")[0] for k in self.objects if k.startswith(prefix)})

    def stat(self, path):
        with self.lock:
            data = self.objects.get(paths.normalize(path))
            return None if data is None else Stat(len(data), (id(data), len(data)))

    def remove(self, path):
        path = paths.normalize(path)
        with self.lock:
            for k in [k for k in self.objects if k == path or k.startswith(path + "/")]:
                del self.objects[k]

    def stage(self, final, marker):
        return paths.partial_dir(final)

    def _move(self, src: str, dst: str) -> None:
        with self.lock:
            for k in [k for k in self.objects if k.startswith(src + "/")]:
                self.objects[dst + k[len(src):]] = self.objects.pop(k)

    def commit(self, partial, final, replace=True):
        if self.list(final) and not replace:
            raise FileExistsError(final)
        retired = [self._retire(final)] if self.list(final) else []
        self._move(paths.normalize(partial), paths.normalize(final))
        return retired

    def retire(self, path, marker):
        return self._retire(path)

    def _retire(self, path):
        self.versions += 1
        doomed = f"{paths.normalize(path)}{paths.DELETING}.{self.versions}"
        self._move(paths.normalize(path), doomed)
        return doomed

    def abort_uploads(self, root):
        return []


class MemorySink(DataSink):
    def __init__(self, storage: MemoryStorage, path: str):
        self.storage, self.path = storage, path

    def submit(self, buffer, offset, segments):
        data = bytes(buffer.numpy())
        with self.storage.lock:
            current = bytes(self.storage.objects.get(self.path, b""))
        grown = bytearray(current.ljust(offset + len(data), b"\0"))
        grown[offset:offset + len(data)] = data
        self.storage._put(self.path, grown)
        crcs = [_native.crc32c(data[start:start + n]) for start, n in segments]
        return lambda: crcs

    def close(self, nbytes):
        with self.storage.lock:
            self.storage.objects[self.path] = bytes(self.storage.objects[self.path][:nbytes])


class MemorySource(DataSource):
    def __init__(self, data: bytes, path: str):
        self.data, self.path = data, path

    def size(self):
        return len(self.data)

    def submit(self, buffer, nbytes, offset, segments):
        if offset + nbytes > len(self.data):
            raise OSError(errno.EIO, f"short read: the object ends before byte {len(self.data)}", self.path)
        view = buffer.numpy()
        view[:nbytes] = memoryview(self.data)[offset:offset + nbytes]
        crcs = [_native.crc32c(self.data[offset + start:offset + start + n]) for start, n in segments]
        return lambda: crcs
