"""Record what a process tree does to the file system under one directory, as a log of inode-level operations.

The processes run under `strace -f -y -xx`: `-y` prints the path behind every descriptor argument (so no fd
table per process has to be rebuilt from clone flags), `-xx` prints every string as hex escapes, paths and the
bytes of each write included, so the written data is recorded exactly, from the native writer threads' pwrite
as well as from Python's write. This is the simplest correct source of the bytes: re-deriving them later is
not possible, as retention deletes the files and the tracker is overwritten.

Paths are turned into inodes by replaying the operations on a live `Tree` while parsing (the log's order is
strace's order of syscall completion): a rename moves an inode, so a later write through a descriptor of the
renamed file lands on the same inode. An operation's position is the line where its syscall completed; a
barrier (fsync) also keeps the line where it started, because only what completed before an fsync started is
made durable by it. strace orders the completions of concurrent processes only roughly: an unlink it reports
after the removal of its directory is moved before it (`_Parser.overtaken`).

close() is not traced: it guarantees nothing about durability, and `-y` names the descriptors without an fd
table. Limits, checked rather than assumed: write/pwrite64 only (a writev/pwritev/link/fallocate with a mode under
the root raises); the file position of write() is kept per path from its last open, which holds for the
writers traced here (a file written with write() is opened once, by one thread, and written to the end).
"""
from __future__ import annotations

import dataclasses
import os
import re
import subprocess

from crash_fs import ROOT_INO, Op, Tree

SYSCALLS = ("open,openat,creat,write,pwrite64,writev,pwritev,pwritev2,fsync,fdatasync,sync,syncfs,rename,"
            "renameat,renameat2,unlink,unlinkat,mkdir,mkdirat,rmdir,ftruncate,truncate,fallocate,link,linkat,"
            "symlink,symlinkat")
MAX_STRING = 1 << 22  # strace -s: longer than any single write of the traced job (checked when parsing)

_LINE = re.compile(r"^(\d+)\s+(.*)$")
_CALL = re.compile(r"^(\w+)\((.*)$")
_RESUMED = re.compile(r"^<\.\.\. (\w+) resumed>(.*)$")
_RESULT = re.compile(r"^(.*)\)\s+=\s+(-?\d+)(?:<([^>]*)>)?(?:\s.*)?$")
_HEX = re.compile(r"\\x([0-9a-f]{2})")


def record(cmd: list[str], log: str, **popen) -> None:
    """Run `cmd` to completion under strace, writing the trace to `log`."""
    strace = ["strace", "-f", "-qq", "--seccomp-bpf", "-y", "-xx", "-s", str(MAX_STRING), "-e", "signal=none",
              "-e", f"trace={SYSCALLS}", "-o", log]
    subprocess.run(strace + cmd, check=True, **popen)


def _unhex(text: str) -> bytes:
    return bytes.fromhex(_HEX.sub(r"\1", text))


def _split_args(text: str) -> list[str]:
    """Top-level arguments; quoted strings hold only hex escapes, so only brackets nest."""
    out, depth, start = [], 0, 0
    for m in re.finditer(r"[\[\]{},]", text):
        c = m.group()
        if c in "[{":
            depth += 1
        elif c in "]}":
            depth -= 1
        elif depth == 0:
            out.append(text[start:m.start()].strip())
            start = m.end()
    tail = text[start:].strip()
    return out + [tail] if tail else out


def _string(arg: str) -> tuple[bytes, bool]:
    """(bytes, complete) of a quoted argument; strace marks a cut-off string with a trailing `...`."""
    m = re.match(r'^"((?:\\x[0-9a-f]{2})*)"(\.\.\.)?$', arg)
    if not m:
        raise ValueError(f"not a hex string argument: {arg[:80]!r}")
    return _unhex(m.group(1)), m.group(2) is None


def _fd_path(arg: str) -> str | None:
    """The path `-y` printed for a descriptor argument (`5</a/b>`, `AT_FDCWD</a>`)."""
    m = re.match(r"^(?:-?\d+|AT_FDCWD)<(.*)>$", arg)
    if not m:
        return None
    path = _unhex(m.group(1)).decode("utf-8", "surrogateescape")
    return path[:-len(" (deleted)")] if path.endswith(" (deleted)") else path


def _flags(arg: str) -> set[str]:
    return set(arg.split("|"))


@dataclasses.dataclass
class _Call:
    name: str
    args: list[str]
    ret: int
    ret_path: str | None
    entry: int
    exit: int


def _calls(lines) -> list[_Call]:
    """Completed syscalls in order of completion, with the line numbers of their start and end."""
    pending: dict[str, tuple[str, str, int]] = {}
    calls = []
    for n, raw in enumerate(lines):
        m = _LINE.match(raw.rstrip("\n"))
        if not m:
            continue
        pid, rest = m.groups()
        if rest.endswith("<unfinished ...>"):
            c = _CALL.match(rest)
            if c:
                pending[pid] = (c.group(1), c.group(2)[:-len("<unfinished ...>")].rstrip(), n)
            continue
        r = _RESUMED.match(rest)
        if r:
            if pid not in pending:
                continue
            name, head, entry = pending.pop(pid)
            body = head + r.group(2)
        else:
            c = _CALL.match(rest)
            if not c:
                continue
            name, body, entry = c.group(1), c.group(2), n
        res = _RESULT.match(body)
        if not res:  # `= ?`: the process died inside the call
            continue
        ret_path = _unhex(res.group(3)).decode("utf-8", "surrogateescape") if res.group(3) else None
        calls.append(_Call(name, _split_args(res.group(1)), int(res.group(2)), ret_path, entry, n))
    return calls


class _Parser:
    def __init__(self, root: str, marks: str, cwd: str):
        self.root, self.marks, self.cwd = os.path.normpath(root), os.path.normpath(marks), cwd
        self.tree = Tree()
        self.pos: dict[str, int] = {}  # file position of write(), per open path
        self.ops: list[Op] = []

    def under(self, path: str) -> bool:
        return path == self.root or path.startswith(self.root + os.sep)

    def rel(self, path: str) -> str:
        return os.path.relpath(path, self.root)

    def resolve(self, dirfd: str | None, arg: str) -> str:
        name = _string(arg)[0].decode("utf-8", "surrogateescape")
        base = _fd_path(dirfd) if dirfd is not None else self.cwd  # the traced job never changes directory
        return os.path.normpath(os.path.join(base, name))

    def emit(self, call: _Call, kind: str, **fields) -> Op:
        op = Op(kind=kind, entry=call.entry, exit=call.exit, **fields)
        self.tree.apply(op)
        self.ops.append(op)
        return op

    def ino(self, path: str | None, call: _Call) -> int | None:
        """The inode of `path` if it is under the root (where everything was created in the trace)."""
        if path is None or not self.under(path):
            return None
        ino = self.tree.lookup(self.rel(path))
        if ino is None:
            raise ValueError(f"line {call.exit}: {call.name} on {path!r}, which the trace never created")
        return ino

    def fd_ino(self, arg: str, call: _Call) -> tuple[str | None, int | None]:
        path = _fd_path(arg)
        return path, self.ino(path, call)

    def handle(self, call: _Call) -> None:
        if call.ret < 0:
            return
        getattr(self, "_" + call.name, lambda c: None)(call)

    # ----- descriptors

    def _open_path(self, call: _Call, path: str, flags: set[str]) -> None:
        path = os.path.normpath(call.ret_path or path)
        if not self.under(path):
            return
        rel = self.rel(path)
        ino = self.tree.lookup(rel)
        if ino is None:
            if "O_CREAT" not in flags:
                raise ValueError(f"line {call.exit}: opened {path!r}, which the trace never created")
            parent, name = self.parent(rel)
            ino = self.emit(call, "create", dir=parent, name=name, ino=self.tree.new_ino(), path=rel).ino
        elif "O_TRUNC" in flags and flags & {"O_WRONLY", "O_RDWR"}:
            self.emit(call, "truncate", ino=ino, size=0, path=rel)
        self.pos[rel] = self.tree.size(ino) if "O_APPEND" in flags else 0

    def _open(self, call):
        self._open_path(call, self.resolve(None, call.args[0]), _flags(call.args[1]))

    def _openat(self, call):
        self._open_path(call, self.resolve(call.args[0], call.args[1]), _flags(call.args[2]))

    def _creat(self, call):
        self._open_path(call, self.resolve(None, call.args[0]), {"O_CREAT", "O_TRUNC", "O_WRONLY"})

    # ----- data

    def _data(self, call: _Call, offset: int | None) -> None:
        path, ino = self.fd_ino(call.args[0], call)
        if path == self.marks:
            for word in _string(call.args[1])[0].decode().split():
                self.emit(call, "mark", value=int(word))
            return
        if ino is None:
            return
        data, complete = _string(call.args[1])
        if not complete or len(data) < call.ret:
            raise ValueError(f"line {call.exit}: strace cut the data of a {call.ret}-byte write to {path!r} "
                             f"(raise fs_trace.MAX_STRING)")
        rel = self.rel(path)
        if offset is None:
            offset = self.pos.get(rel, 0)
            self.pos[rel] = offset + call.ret
        self.emit(call, "write", ino=ino, offset=offset, data=data[:call.ret], path=rel)

    def _write(self, call):
        self._data(call, None)

    def _pwrite64(self, call):
        self._data(call, int(call.args[3]))

    def _unsupported(self, call):
        for arg in call.args:
            path = _fd_path(arg)
            if path is not None and self.under(path):
                raise ValueError(f"line {call.exit}: {call.name} under the checkpoint root is not modelled")

    _writev = _pwritev = _pwritev2 = _link = _linkat = _symlink = _symlinkat = _unsupported

    def _ftruncate(self, call):
        path, ino = self.fd_ino(call.args[0], call)
        if ino is not None:
            self.emit(call, "truncate", ino=ino, size=int(call.args[1]), path=self.rel(path))

    def _truncate(self, call):
        path = self.resolve(None, call.args[0])
        ino = self.ino(path, call)
        if ino is not None:
            self.emit(call, "truncate", ino=ino, size=int(call.args[1]), path=self.rel(path))

    def _fallocate(self, call):
        path, ino = self.fd_ino(call.args[0], call)
        if ino is None:
            return
        if call.args[1] != "0":
            raise ValueError(f"line {call.exit}: fallocate mode {call.args[1]} under the checkpoint root")
        self.emit(call, "extend", ino=ino, size=int(call.args[2]) + int(call.args[3]), path=self.rel(path))

    # ----- barriers

    def _fsync(self, call):
        path, ino = self.fd_ino(call.args[0], call)
        if ino is not None:
            self.emit(call, "fsync", ino=ino, path=self.rel(path))

    _fdatasync = _fsync

    def _sync(self, call):
        self.emit(call, "sync")

    def _syncfs(self, call):
        path = _fd_path(call.args[0])
        if path is not None and self.under(path):
            self.emit(call, "sync")

    # ----- directory entries

    def parent(self, rel: str) -> tuple[int, str]:
        head, name = os.path.split(rel)
        ino = self.tree.lookup(head) if head else ROOT_INO
        if ino is None:
            raise ValueError(f"the parent of {rel!r} was never created in the trace")
        return ino, name

    def _mkdir_path(self, call, path):
        if self.under(path) and path != self.root:
            parent, name = self.parent(self.rel(path))
            self.emit(call, "create", dir=parent, name=name, ino=self.tree.new_ino(), is_dir=True,
                      path=self.rel(path))

    def _mkdir(self, call):
        self._mkdir_path(call, self.resolve(None, call.args[0]))

    def _mkdirat(self, call):
        self._mkdir_path(call, self.resolve(call.args[0], call.args[1]))

    def _unlink_path(self, call, path, is_dir):
        if not self.under(path):
            return
        rel = self.rel(path)
        parent, name = self.parent(rel)
        self.emit(call, "unlink", dir=parent, name=name, ino=self.tree.lookup(rel), is_dir=is_dir, path=rel)

    def overtaken(self, calls: list[_Call], i: int) -> list[int]:
        """Unlinks that strace reports after the successful removal `calls[i]` of their directory although they
        must have completed before it: strace orders the completions of concurrent processes only roughly (here:
        one rank still deleting its files of a retired checkpoint while rank 0 removes the directory)."""
        call = calls[i]
        if call.ret < 0:
            return []
        if call.name == "rmdir":
            path = self.resolve(None, call.args[0])
        elif call.name == "unlinkat" and "AT_REMOVEDIR" in call.args[2]:
            path = self.resolve(call.args[0], call.args[1])
        else:
            return []
        ino = self.tree.lookup(self.rel(path)) if self.under(path) else None
        if ino is None or not self.tree.dirs.get(ino):
            return []
        found = []
        for j in range(i + 1, len(calls)):
            c = calls[j]
            if c.entry > call.exit or c.ret < 0 or c.name not in ("unlink", "unlinkat") or (c.name == "unlinkat" and
                                                                       "AT_REMOVEDIR" in c.args[2]):
                continue
            target = self.resolve(None, c.args[0]) if c.name == "unlink" else self.resolve(c.args[0], c.args[1])
            if os.path.dirname(target) == path:
                found.append(j)
        return found

    def _unlink(self, call):
        self._unlink_path(call, self.resolve(None, call.args[0]), False)

    def _rmdir(self, call):
        self._unlink_path(call, self.resolve(None, call.args[0]), True)

    def _unlinkat(self, call):
        self._unlink_path(call, self.resolve(call.args[0], call.args[1]), "AT_REMOVEDIR" in call.args[2])

    def _rename_paths(self, call, src, dst, flags=frozenset()):
        if not (self.under(src) or self.under(dst)):
            return
        if not (self.under(src) and self.under(dst)) or flags - {"0", "RENAME_NOREPLACE"}:
            raise ValueError(f"line {call.exit}: {call.name} {src!r} -> {dst!r} {sorted(flags)} is not modelled")
        (sdir, sname), (ddir, dname) = self.parent(self.rel(src)), self.parent(self.rel(dst))
        self.emit(call, "rename", dir=sdir, name=sname, dst_dir=ddir, dst_name=dname,
                  ino=self.tree.lookup(self.rel(src)), path=f"{self.rel(src)} -> {self.rel(dst)}")

    def _rename(self, call):
        self._rename_paths(call, self.resolve(None, call.args[0]), self.resolve(None, call.args[1]))

    def _renameat(self, call):
        self._rename_paths(call, self.resolve(call.args[0], call.args[1]), self.resolve(call.args[2], call.args[3]))

    def _renameat2(self, call):
        self._rename_paths(call, self.resolve(call.args[0], call.args[1]), self.resolve(call.args[2], call.args[3]),
                           _flags(call.args[4]))


def parse(log: str, root: str, marks: str, cwd: str) -> list[Op]:
    """The operations under `root` (which existed, empty and durable, when the trace began), in order of
    completion, plus a `mark` op for each number written to the `marks` file; `cwd`: the job's directory."""
    p = _Parser(root, marks, cwd)
    with open(log, encoding="latin-1") as f:
        calls = _calls(f)
    moved: set[int] = set()
    for i, call in enumerate(calls):
        if i in moved:
            continue
        for j in p.overtaken(calls, i):
            p.handle(dataclasses.replace(calls[j], exit=call.exit))
            moved.add(j)
        p.handle(call)
    return p.ops
