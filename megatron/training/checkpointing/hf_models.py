"""--save-hf's publication: the root of the published transformers models, on rank 0.

    iter_0000100/           config.json, model-0000k-of-0000n.safetensors, model.safetensors.index.json, tokenizer
    latest                  `iter_0000100`: the newest complete model (replaced in one step, after the model)
    iter_0000200.partial/   an export under way, on a file system (renamed to iter_0000200/ when complete)

A model is complete when its index is there, and the index is written last: on a file system the directory is
written under `.partial`, fsynced and renamed (`Storage.stage` / `commit`); an object store has no rename, so
the model is written in place and the index's PUT publishes it. `latest` names only complete models;
--save-hf-keep-last retires the oldest after the new one is named (its index removed first: out of sight in one
step, then the rest). What a killed export leaves (a `.partial` directory, a model without its index, open
multipart uploads) is removed at the next start (`clean_leftovers`).
"""
from __future__ import annotations

import logging
import os
import re

from datastates import DELETING, PARTIAL, Storage, checkpoint_dir, iteration_of, join_path
from datastates.hf.writer import INDEX, write_index

log = logging.getLogger(__name__)

POINTER = "latest"
# a model being written on a file system (under the checkpoints' own PARTIAL suffix) or retired (DELETING, with the
# storage's own suffix after it), and the pointer's temporary
LEFTOVER_RE = re.compile(rf"^(iter_\d{{7,}}({re.escape(PARTIAL)}|{re.escape(DELETING)})(\.[\d.]+)?|{POINTER}\.tmp\.\d+)$")


def read_pointer(storage: Storage, root: str) -> str | None:
    """The directory name `latest` gives (None when there is none yet)."""
    try:
        return storage.read_bytes(join_path(root, POINTER)).decode().strip() or None
    except FileNotFoundError:
        return None


def write_pointer(storage: Storage, root: str, name: str) -> None:
    """`latest` replaced in one step, after the model it names is durable."""
    storage.write_bytes(join_path(root, POINTER), f"{name}\n".encode(), replace=True)


def is_model(storage: Storage, path: str) -> bool:
    """Whether the model `path` is complete: its index is written last."""
    return storage.stat(join_path(path, INDEX)) is not None


def published_models(storage: Storage, root: str) -> list[int]:
    """The iterations of the complete models under `root`, oldest first."""
    found = [iteration_of(name) for name in storage.list(root)]
    return sorted(it for it in found if it is not None and is_model(storage, checkpoint_dir(root, it)))


def clean_leftovers(storage: Storage, root: str) -> list[str]:
    """Remove what a killed export or retention left: a `.partial` or `.deleting` directory and the pointer's
    temporary on a file system; on an object store a model without its index and the multipart uploads left open.
    Call before any export of this job starts. What was removed."""
    removed = storage.abort_uploads(root)
    for name in sorted(storage.list(root)):
        path = join_path(root, name)
        unfinished = iteration_of(name) is not None and storage.list(path) and not is_model(storage, path)
        if LEFTOVER_RE.match(name) or unfinished:
            storage.remove(path)
            removed.append(path)
    return removed


class ModelRoot:
    """The published models under `root`: every rank stages its files there (`stage`); rank 0 cleans what a killed
    export left (`start`), publishes (`publish`: the index last, the commit, `latest`, retention) or discards."""

    def __init__(self, storage: Storage, root: str, keep_last: int | None):
        self.storage, self.root, self.keep_last = storage, root, keep_last
        self.named: str | None = None  # what `latest` names, as this job read or wrote it (rank 0)

    def start(self) -> None:
        """Rank 0, before any export of this job: a rank exports only a checkpoint published after this."""
        for path in clean_leftovers(self.storage, self.root):
            log.info("--save-hf: removed the leftovers of an unfinished export: %s", path)
        # a verdict then needs no answer from a store that may be down
        self.named = read_pointer(self.storage, self.root)

    def path(self, iteration: int) -> str:
        """Where the model of `iteration` is published."""
        return checkpoint_dir(self.root, iteration)

    def newest(self) -> str | None:
        """The model `latest` names (what an evaluation job takes now), on rank 0."""
        return join_path(self.root, self.named) if self.named else None

    def is_model(self, path: str) -> bool:
        return is_model(self.storage, path)

    def stage(self, final: str) -> str:
        """The place a model's files are written (every rank): a file system's `.partial` directory, or the final
        prefix."""
        return self.storage.stage(final)

    def publish(self, directory: str, final: str, shards: list) -> None:
        """Rank 0, every rank's files written into `directory`: the index (last: on an object store, what publishes
        the model), the commit (a file system's rename into place), then `latest` and retention."""
        write_index(self.storage, directory, shards)
        for retired in self.storage.commit(directory, final):
            self.storage.remove(retired)
        self.name(final)

    def name(self, final: str) -> None:
        """Rank 0: `latest` names the model, then --save-hf-keep-last retires the oldest."""
        write_pointer(self.storage, self.root, os.path.basename(final))
        self.named = os.path.basename(final)
        self._retire()

    def discard(self, directory: str) -> None:
        """Rank 0, a failed export: what it wrote goes (else the next start removes it)."""
        try:
            self.storage.remove(directory)
        except OSError as e:
            log.warning("--save-hf: cannot remove %s now (%s): the next start does", directory, e)

    def _retire(self) -> None:
        """--save-hf-keep-last K: the oldest models beyond the newest K go (never the one `latest` names): each
        index first (the model out of every reader's sight in one step), then the rest."""
        if not self.keep_last:
            return
        for it in published_models(self.storage, self.root)[:-self.keep_last]:
            path = checkpoint_dir(self.root, it)
            if os.path.basename(path) == self.named:
                continue
            self.storage.remove(join_path(path, INDEX))
            self.storage.remove(path)
            log.info("--save-hf-keep-last %d: removed %s", self.keep_last, path)

    def close(self) -> None:
        self.storage.close()
