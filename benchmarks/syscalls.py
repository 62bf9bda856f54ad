"""Reading strace logs: which calls touch file-system metadata (what a parallel file system's metadata server
serves), as opposed to moving data."""
from __future__ import annotations

import re

SYSCALL = re.compile(r"^\d+\s+(\w+)\((.*)")
METADATA_CALLS = {"open", "openat", "openat2", "creat", "stat", "lstat", "fstat", "newfstatat", "statx", "access",
                  "faccessat", "faccessat2", "rename", "renameat", "renameat2", "unlink", "unlinkat", "mkdir",
                  "mkdirat", "rmdir", "getdents64", "fsync", "fdatasync", "readlink", "readlinkat", "chdir",
                  "truncate", "ftruncate", "fallocate"}


def metadata_call(line: str) -> tuple[str, str] | None:
    """(name, arguments) when an strace line is a file-metadata call, else None."""
    m = SYSCALL.match(line)
    return (m.group(1), m.group(2)) if m and m.group(1) in METADATA_CALLS else None


def opens_json(call: tuple[str, str]) -> bool:
    name, args = call
    return name.startswith("open") and '.json"' in args and "O_RDONLY" in args
