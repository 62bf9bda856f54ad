"""Leases on published weight versions, so that a version is freed only when no reader holds it and the trainer
never waits for a reader.

A reader holds a shared flock on the version's directory for as long as it reads it; the publisher retires a
version only while it holds the exclusive flock, taken without waiting (a held version stays, and is tried again at
the next publication). The kernel drops the lock of a reader that dies, so a killed reader holds nothing."""
from __future__ import annotations

import fcntl
import os


def _locked(path: str, how: int) -> int | None:
    """An fd of the directory `path` holding the flock `how` (taken without waiting), or None: the directory is
    gone, or the lock is held the other way. The lock is on the directory now at `path` (checked after locking:
    a version retired between the open and the lock is not taken)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except (FileNotFoundError, NotADirectoryError):
        return None
    try:
        fcntl.flock(fd, how | fcntl.LOCK_NB)
        if os.stat(path).st_ino == os.fstat(fd).st_ino:
            return fd
    except (BlockingIOError, FileNotFoundError):
        pass
    os.close(fd)
    return None


def lease(path: str) -> int | None:
    """A reader's lease on the version directory `path` (an fd; `os.close` gives it back), or None when the
    version is gone or being retired."""
    return _locked(path, fcntl.LOCK_SH)


def unleased(path: str) -> int | None:
    """The publisher's exclusive hold on the version `path` when no reader leases it (an fd: retire the version,
    then close it), else None."""
    return _locked(path, fcntl.LOCK_EX)
