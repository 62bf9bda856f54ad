"""--save-hf's publication: the root of the published transformers models, through the engine's one save-root
policy (`datastates.SaveRoot`: the marker is the safetensors index, the pointer `latest` holding `iter_0000100`).

    iter_0000100/           config.json, model-0000k-of-0000n.safetensors, model.safetensors.index.json, tokenizer
    latest                  `iter_0000100`: the newest complete model (replaced in one step, after the model)
    iter_0000200.partial/   an export under way, on a file system (renamed to iter_0000200/ when complete)

A model is complete when its index is there, and the index is written last: on a file system the directory is
written under `.partial`, fsynced and renamed (`SaveRoot.stage` / `commit`); an object store has no rename, so
the model is written in place and the index's PUT publishes it. `latest` names only complete models;
--save-hf-keep-last retires the oldest after the new one is named (out of sight in one step, then removed).
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
        the model), the commit (a file system's rename into place), then `latest` and retention."""
        write_index(self.storage, directory, shards)
        for retired in self.policy.commit(directory, self.path(iteration)):
            self.storage.remove(retired)
        self.name(iteration)

    def name(self, iteration: int) -> None:
        """Rank 0: `latest` names the model of `iteration`, then --save-hf-keep-last retires the oldest (never the
        one `latest` names)."""
        self.policy.point(iteration)
        self.named = iteration
        if self.keep_last:
            for retired in self.policy.retain(self.keep_last, iteration):
                self.storage.remove(retired)
                log.info("--save-hf-keep-last %d: removed %s", self.keep_last, retired)

    def discard(self, directory: str) -> None:
        """Rank 0, a failed export: what it wrote goes (else the next start removes it)."""
        try:
            self.storage.remove(directory)
        except OSError as e:
            log.warning("--save-hf: cannot remove %s now (%s): the next start does", directory, e)

    def close(self) -> None:
        self.storage.close()
