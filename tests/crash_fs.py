"""The on-disk states a power loss or kernel crash can leave, built from a log of file-system operations.

Persistence model (what POSIX fsync and directory fsync guarantee, nothing more, as in ALICE's and
CrashMonkey's weakest model): at a crash after the first k operations of the log,

  - a file's data operations (write, truncate, fallocate extension) are durable if an fsync/fdatasync of that
    file *started* after they completed and finished within the k operations;
  - a directory-entry operation (create, mkdir, unlink, rmdir, rename) is durable if an fsync of its parent
    directory (both parents for a rename) started after it completed and finished within the k operations;
  - every other operation of the prefix may or may not have reached the disk, independently of the others: an
    unsynced write may be lost, reordered with other writes or torn at 4096-byte block granularity; an unsynced
    directory operation may be lost. Operations are still applied in log order, and a rename is atomic.

A directory entry and the inode it names are separate: a file whose create was lost but whose writes reached
the disk is an orphan (unreachable), a rename that reached the disk carries its inode even when the create of
the source name did not. A state is the reachable tree from the checkpoint root.
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
import random

ROOT_INO = 0
BLOCK = 4096
DENTRY = {"create", "unlink", "rename"}
DATA = {"write", "truncate", "extend"}


@dataclasses.dataclass
class Op:
    """One operation of the log: where its syscall started and completed (trace line numbers) and its effect."""
    kind: str  # create | unlink | rename | write | truncate | extend | fsync | sync | mark
    entry: int
    exit: int
    ino: int | None = None  # the file or directory written, fsynced, created, unlinked or renamed
    dir: int | None = None  # parent directory of `name` (a rename's source)
    name: str | None = None
    dst_dir: int | None = None  # a rename's target
    dst_name: str | None = None
    is_dir: bool = False
    offset: int = 0
    data: bytes = b""
    size: int = 0
    value: int = 0  # a mark's number
    path: str = ""  # for messages

    def describe(self) -> str:
        if self.kind == "write":
            return f"write {self.path} [{self.offset}, {self.offset + len(self.data)})"
        if self.kind in ("truncate", "extend"):
            return f"{self.kind} {self.path} to {self.size}"
        if self.kind == "mark":
            return f"mark {self.value}"
        if self.kind == "create" and self.is_dir:
            return f"mkdir {self.path}"
        if self.kind == "unlink" and self.is_dir:
            return f"rmdir {self.path}"
        return f"{self.kind} {self.path}".rstrip()

    def blocks(self) -> range:
        """The 4096-byte blocks of the file a write touches."""
        return range(self.offset // BLOCK, -(-(self.offset + len(self.data)) // BLOCK))


class Tree:
    """Inodes (directories: name -> inode; files: bytes) and the tree reachable from the root."""

    def __init__(self):
        self.dirs: dict[int, dict[str, int]] = {ROOT_INO: {}}
        self.files: dict[int, bytearray] = {}
        self._next = ROOT_INO + 1

    def new_ino(self) -> int:
        self._next += 1
        return self._next - 1

    def lookup(self, rel: str) -> int | None:
        ino = ROOT_INO
        for part in [p for p in rel.split(os.sep) if p not in ("", ".")]:
            entries = self.dirs.get(ino)
            if entries is None or part not in entries:
                return None
            ino = entries[part]
        return ino

    def size(self, ino: int) -> int:
        return len(self.files.get(ino, b""))

    def _file(self, ino: int) -> bytearray:
        return self.files.setdefault(ino, bytearray())

    def apply(self, op: Op, blocks: frozenset[int] | None = None) -> None:
        """Apply one operation; a write keeps only `blocks` of its blocks when given (a torn write)."""
        if op.kind == "create":
            (self.dirs.setdefault(op.ino, {}) if op.is_dir else self._file(op.ino))
            self.dirs.setdefault(op.dir, {})[op.name] = op.ino
        elif op.kind == "unlink":
            entries = self.dirs.setdefault(op.dir, {})
            if entries.get(op.name) == op.ino:
                del entries[op.name]
        elif op.kind == "rename":
            src = self.dirs.setdefault(op.dir, {})
            if src.get(op.name) == op.ino:
                del src[op.name]
            self.dirs.setdefault(op.dst_dir, {})[op.dst_name] = op.ino
        elif op.kind == "write":
            f = self._file(op.ino)
            end = op.offset + len(op.data)
            for b in op.blocks():
                if blocks is None or b in blocks:
                    lo, hi = max(op.offset, b * BLOCK), min(end, (b + 1) * BLOCK)
                    if len(f) < hi:
                        f.extend(bytes(hi - len(f)))
                    f[lo:hi] = op.data[lo - op.offset:hi - op.offset]
        elif op.kind == "truncate":
            f = self._file(op.ino)
            del f[op.size:]
            f.extend(bytes(op.size - len(f)))
        elif op.kind == "extend":
            f = self._file(op.ino)
            f.extend(bytes(max(0, op.size - len(f))))

    def walk(self, ino: int = ROOT_INO, prefix: str = ""):
        """(relative path, inode, is directory) of everything reachable, parents first."""
        for name in sorted(self.dirs.get(ino, {})):
            child = self.dirs[ino][name]
            path = os.path.join(prefix, name)
            is_dir = child in self.dirs
            yield path, child, is_dir
            if is_dir:
                yield from self.walk(child, path)

    def fingerprint(self) -> str:
        h = hashlib.sha256()
        for path, ino, is_dir in self.walk():
            h.update(f"{path}\0{'d' if is_dir else hashlib.sha256(self.files.get(ino, b'')).hexdigest()}\0"
                     .encode())
        return h.hexdigest()

    def materialise(self, dest: str) -> None:
        os.makedirs(dest)
        for path, ino, is_dir in self.walk():
            if is_dir:
                os.mkdir(os.path.join(dest, path))
            else:
                with open(os.path.join(dest, path), "wb") as f:
                    f.write(self.files.get(ino, b""))


def durable_at(ops: list[Op]) -> list[float]:
    """For each operation, the index of the barrier that makes it durable (inf if none does); crash points
    after that index keep it for sure."""
    barriers: dict[int | None, list[tuple[int, Op]]] = {}
    for j, op in enumerate(ops):
        if op.kind in ("fsync", "sync"):
            barriers.setdefault(op.ino if op.kind == "fsync" else None, []).append((j, op))

    def first(target: int, after: int) -> float:
        hits = [j for j, b in barriers.get(target, []) + barriers.get(None, []) if b.entry > after]
        return min(hits, default=float("inf"))

    out = []
    for op in ops:
        if op.kind in DATA:
            out.append(first(op.ino, op.exit))
        elif op.kind == "rename":
            out.append(max(first(op.dir, op.exit), first(op.dst_dir, op.exit)))
        elif op.kind in DENTRY:
            out.append(first(op.dir, op.exit))
        else:
            out.append(-1)  # barriers and marks change nothing on disk
    return out


@dataclasses.dataclass
class CrashState:
    """The ops[:k] prefix with the durable operations, the `kept` optional ones (`torn` writes: their kept
    blocks)."""
    k: int
    label: str
    kept: frozenset[int]
    torn: dict[int, frozenset[int]]

    def build(self, ops: list[Op], durable: list[float]) -> Tree:
        tree = Tree()
        for i in range(self.k):
            op = ops[i]
            if op.kind in DENTRY or op.kind in DATA:
                if durable[i] < self.k or i in self.kept:
                    tree.apply(op, self.torn.get(i))
        return tree


def crash_states(ops: list[Op], durable: list[float], k: int, samples: int, seed: int):
    """The systematic states of crash point k, then `samples` seeded random ones."""
    optional = [i for i in range(k) if (ops[i].kind in DENTRY or ops[i].kind in DATA) and durable[i] >= k]
    dentry = [i for i in optional if ops[i].kind in DENTRY]
    data = [i for i in optional if ops[i].kind in DATA]
    every = frozenset(optional)
    yield CrashState(k, "keep all (what SIGKILL leaves)", every, {})
    yield CrashState(k, "drop all unsynced", frozenset(), {})
    yield CrashState(k, "unsynced directory operations only", frozenset(dentry), {})
    yield CrashState(k, "unsynced data only", frozenset(data), {})
    for i in dentry:
        yield CrashState(k, f"drop only op {i} ({ops[i].describe()})", every - {i}, {})
    writes = [i for i in data if ops[i].kind == "write"]
    if writes:  # the newest unsynced write torn: its first block only
        last = writes[-1]
        yield CrashState(k, f"op {last} torn after its first block ({ops[last].describe()})", every,
                         {last: frozenset(ops[last].blocks()[:1])})
    rng = random.Random(f"{seed}:{k}")
    for n in range(samples):
        p = rng.uniform(0.1, 0.9)
        kept = frozenset(i for i in optional if rng.random() < p)
        torn = {i: frozenset(b for b in ops[i].blocks() if rng.random() < 0.5)
                for i in kept if ops[i].kind == "write" and len(ops[i].blocks()) > 1 and rng.random() < 0.25}
        yield CrashState(k, f"random #{n} (seed {seed}, keep p={p:.2f}, {len(torn)} torn)", kept, torn)
