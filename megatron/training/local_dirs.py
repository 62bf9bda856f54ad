"""Local directories a flag names, probed before any work: what a directory still to be made lands in, and
whether it can be made and written (the file system's answer, nothing left behind)."""
from __future__ import annotations

import os
import tempfile


def nearest_existing(path: str) -> str:
    """The path itself or its nearest ancestor that exists (what a directory to be made lands in)."""
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path


def unwritable(flag: str, path: str) -> str | None:
    """Why a local directory a flag names cannot be created or written (None: it can): a directory is made and
    removed where it would go, so the answer is the file system's (permissions, read-only mounts, /proc) and
    nothing is left behind."""
    existing = nearest_existing(path)
    if not os.path.isdir(existing):
        return f"{flag} {path!r}: {existing!r} is a file, not a directory"
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".datastates-probe-", dir=existing))
    except OSError as e:
        return f"{flag} {path!r} cannot be created or written: making a directory in {existing!r} failed: {e.strerror}"
    return None
