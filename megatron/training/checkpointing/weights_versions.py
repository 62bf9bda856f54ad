"""The root of the published weight versions (`--publish-weights-dir`): --save-hf's model root (the index written
last, the directory renamed into place, `latest` replaced after it), with one difference: an old version is
retired only when no reader leases it (`datastates.weights.leases`), tried without waiting at each publication.
With deltas on, each version's changes against the one before are written (`datastates.weights.deltas`) before
`latest` names it, on rank 0's export thread (off the training thread), while both versions are still there.

Versions only go forward, also across restarts: a restarted trainer reads `latest` at start and chains its first
delta from that version; one resumed from before it (a checkpoint older than its newest version) publishes no
version numbered at or below it, so an iteration never names two different sets of weights and a reader's copy is
never brought through a delta that starts from other bytes than its own.

    iter_0000007/           config.json, model-0000k-of-0000n.safetensors, model.safetensors.index.json
    latest                  `iter_0000007`: the newest whole version
    iter_0000008.partial/   a version being written (a reader never looks there)
    deltas/iter_0000007.safetensors   what changed from the version before to 7 (--publish-weights-deltas)
"""
from __future__ import annotations

import logging
import os

from datastates.hf.writer import write_index
from datastates.weights import retire_deltas, unleased, write_delta

from .hf_models import ModelRoot

log = logging.getLogger(__name__)


class NotNewer(ValueError):
    """A version at or below the one `latest` names: never published (versions only go forward)."""


class VersionRoot(ModelRoot):
    """Rank 0 publishes (`publish`, `name`); `keep_last`: the newest versions always kept, older ones retired
    once no reader holds them; `deltas`: the deltas to the newest `deltas` versions kept (0: none written)."""

    def __init__(self, storage, root: str, keep_last: int, deltas: int = 0):
        super().__init__(storage, root, keep_last)
        self.deltas = deltas

    def publish(self, directory: str, iteration: int, shards: list) -> None:
        if self.named is not None and iteration <= self.named:  # the export discards what it wrote
            raise NotNewer(f"version {iteration} is not newer than version {self.named}, which {self.root}/latest "
                           f"names (a trainer resumed from before it): versions go on after it")
        write_index(self.storage, directory, shards)
        final = self.path(iteration)
        self._remove(self.policy.commit(directory, final))  # no SaveRoot retention: leases first
        previous = self.named
        if self.deltas and previous is not None and self.is_model(self.path(previous)):
            try:
                write_delta(self.root, previous, iteration)
            except (OSError, ValueError) as e:  # a reader then loads the full version: said, never fatal
                log.warning("%s: no delta from version %d to %d: %s", "--publish-weights-deltas", previous,
                            iteration, e)
        self.policy.advance(iteration, None)
        self.named = iteration
        self.retire_unleased()
        if self.deltas:
            retire_deltas(self.root, self.deltas)

    def name(self, iteration: int) -> None:
        if self.named is not None and iteration <= self.named:  # published by an earlier run: `latest` stays
            return
        self.policy.advance(iteration, None)
        self.named = iteration
        self.retire_unleased()

    def retire_unleased(self) -> None:
        """Retire every version older than the newest `keep_last` that no reader leases now (a leased one stays
        until a later publication finds it free)."""
        for iteration in self.policy.published()[:-self.keep_last]:
            if iteration == self.named:
                continue
            path = self.path(iteration)
            fd = unleased(path)
            if fd is None:  # a reader holds it (or it is gone): never waited for
                continue
            try:
                gone = self.policy.retire(path)  # out of sight while no reader can take it
            finally:
                os.close(fd)
            self._remove([gone])

    def _remove(self, paths: list[str]) -> None:
        for path in paths:
            self.storage.remove(path)
            log.debug("--publish-weights-dir: removed %s", path)
