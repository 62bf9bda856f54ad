"""Names: what a save root and a checkpoint hold, for every storage backend.

    save_root/
        latest_checkpointed_iteration.txt   the tracker: the iteration a load resumes from
        iter_0000010/                       a published checkpoint (its metadata.json makes it one)
            rank_00000.data                 rank 0's items: tensors 4 KiB aligned, pickled objects after them
            rank_00000.manifest.json        rank 0's written proof of its part (schema, items, checksums)
            metadata.json                   the global index, written last at publication
        iter_0000020.partial/               a save in progress (or killed): invisible to every reader
        iter_0000005.deleting.<id>/         a retired checkpoint being deleted

Paths are strings: a file system path, or a URL (`scheme://bucket/prefix`) whose scheme names the backend.
"""
from __future__ import annotations

import os
import re

__all__ = ["METADATA", "DCP_METADATA", "TRACKER", "PARTIAL", "DELETING", "RANK_FILE_RE", "data_file", "manifest_file",
           "scheme", "normalize", "parent", "name", "join", "checkpoint_dir", "iteration_of", "partial_dir"]

METADATA = "metadata.json"
DCP_METADATA = ".metadata"  # PyTorch DCP's global metadata, written last by its coordinator (upstream's torch_dcp)
TRACKER = "latest_checkpointed_iteration.txt"
ITER_RE = re.compile(r"^iter_(\d{7,})$")
RANK_FILE_RE = re.compile(r"^rank_(\d{5,})\.(data|manifest\.json)$")
PARTIAL = ".partial"
DELETING = ".deleting"
RELEASE = "release"  # what Megatron-LM's tracker says of a checkpoint in `release/`


def data_file(rank: int) -> str:
    return f"rank_{rank:05d}.data"


def manifest_file(rank: int) -> str:
    return f"rank_{rank:05d}.manifest.json"


def scheme(path: str) -> str | None:
    """The URL scheme of `path` ("s3", "msc"), None for a file system path."""
    head, sep, _ = path.partition("://")
    return head if sep and head.isalnum() else None


def normalize(path: str) -> str:
    """`path` without a trailing slash or `.` and `..` steps; a URL keeps its scheme."""
    s = scheme(path)
    if s is None:
        return os.path.normpath(path)
    return f"{s}://" + os.path.normpath(path[len(s) + 3:]).lstrip("/")


def parent(path: str) -> str:
    """The directory (or prefix) holding `path`."""
    return os.path.dirname(normalize(path)) or "."


def name(path: str) -> str:
    return os.path.basename(normalize(path))


def join(path: str, *names: str) -> str:
    return os.path.join(path, *names)


def checkpoint_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def checkpoint_dir(save_dir: str, iteration: int) -> str:
    return join(save_dir, checkpoint_name(iteration))


def iteration_of(path: str) -> int | None:
    m = ITER_RE.match(name(path))
    return int(m.group(1)) if m else None


def partial_dir(path: str) -> str:
    return normalize(path) + PARTIAL
