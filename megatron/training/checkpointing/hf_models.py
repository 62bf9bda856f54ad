"""--save-hf's publication: the root of the published transformers models, through the engine's one save-root
policy (`datastates.SaveRoot`: the marker is the safetensors index, the pointer `latest` holding `iter_0000100`).

    iter_0000100/           config.json, model-0000k-of-0000n.safetensors, model.safetensors.index.json, tokenizer
    latest                  `iter_0000100`: the newest complete model (replaced in one step, after the model)
    iter_0000200.partial/   an export under way, on a file system (renamed to iter_0000200/ when complete)

A model is complete when its index is there, and the index is written last: on a file system the directory is
written under `.partial`, fsynced and renamed (`SaveRoot.stage` / `commit`); an object store has no rename, so
the model is written in place and the index's PUT publishes it. `latest` names only complete models: the
publication order is the one of every root (`SaveRoot.publish`: commit, `latest`, then --save-hf-keep-last's
retention, each retired model out of sight in one step, then removed).
What a killed export leaves (a `.partial` directory, a model without its index, the pointer's temporary, open
multipart uploads) is removed at the next start (`SaveRoot.clean_leftovers`).
"""
from __future__ import annotations

import logging

from datastates import DIRECTORY_TEXT, SaveRoot, Storage
from datastates.hf.writer import INDEX, write_index

log = logging.getLogger(__name__)

POINTER = "latest"


class ModelRoot:
    """The published models under `root`: every rank stages its files there (`stage`); rank 0 cleans what a killed
    export left (`start`), publishes (`publish`: the index last, the commit, `latest`, retention) or discards."""

    def __init__(self, storage: Storage, root: str, keep_last: int | None):
        self.storage, self.root, self.keep_last = storage, root, keep_last
        self.policy = SaveRoot(storage, root, marker=INDEX, pointer=POINTER, pointer_text=DIRECTORY_TEXT)
        self.named: int | None = None  # the iteration `latest` names, as this job read or wrote it (rank 0)

    def start(self) -> None:
        """Rank 0, before any export of this job: a rank exports only a checkpoint published after this."""
        for path in self.policy.clean_leftovers():
            log.info("--save-hf: removed the leftovers of an unfinished export: %s", path)
        # a verdict then needs no answer from a store that may be down
        self.named = self.policy.pointed()

    def path(self, iteration: int) -> str:
        """Where the model of `iteration` is published."""
        return self.policy.path(iteration)

    def newest(self) -> str | None:
        """The model `latest` names (what an evaluation job takes now), on rank 0."""
        return None if self.named is None else self.path(self.named)

    def is_model(self, path: str) -> bool:
        return self.policy.is_published(path)

    def stage(self, final: str) -> str:
        """The place a model's files are written (every rank): a file system's `.partial` directory, or the final
        prefix."""
        return self.policy.stage(final)

    def publish(self, directory: str, iteration: int, shards: list) -> None:
        """Rank 0, every rank's files written into `directory`: the index (last: on an object store, what publishes
        the model), then `SaveRoot.publish` (the commit, `latest`, retention)."""
        write_index(self.storage, directory, shards)
        self._removed(self.policy.publish(directory, self.path(iteration), keep_last=self.keep_last))
        self.named = iteration

    def name(self, iteration: int) -> None:
        """Rank 0: the model of `iteration`, published already, is the newest (`SaveRoot.advance`: `latest` names
        it, then --save-hf-keep-last retires the oldest, never that one)."""
        self._removed(self.policy.advance(iteration, self.keep_last))
        self.named = iteration

    def _removed(self, retired: list[str]) -> None:
        for path in retired:
            self.storage.remove(path)
            log.info("--save-hf: removed %s (retired by --save-hf-keep-last %s, or replaced)", path, self.keep_last)

    def discard(self, directory: str) -> None:
        """Rank 0, a failed export: what it wrote goes (else the next start removes it)."""
        try:
            self.storage.remove(directory)
        except OSError as e:
            log.warning("--save-hf: cannot remove %s now (%s): the next start does", directory, e)

    def close(self) -> None:
        self.storage.close()
