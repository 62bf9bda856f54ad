"""The root of the published weight versions (`--publish-weights-dir`): --save-hf's model root (the index written
last, the directory renamed into place, `latest` replaced after it), with one difference: an old version is
retired only when no reader leases it (`datastates.weights.leases`), tried without waiting at each publication.

    iter_0000007/           config.json, model-0000k-of-0000n.safetensors, model.safetensors.index.json
    latest                  `iter_0000007`: the newest whole version
    iter_0000008.partial/   a version being written (a reader never looks there)
"""
from __future__ import annotations

import logging
import os

from datastates.hf.writer import write_index
from datastates.weights import unleased

from .hf_models import ModelRoot

log = logging.getLogger(__name__)


class VersionRoot(ModelRoot):
    """Rank 0 publishes (`publish`, `name`); `keep_last`: the newest versions always kept, older ones retired
    once no reader holds them."""

    def publish(self, directory: str, iteration: int, shards: list) -> None:
        write_index(self.storage, directory, shards)
        self._remove(self.policy.publish(directory, self.path(iteration)))  # no SaveRoot retention: leases first
        self.named = iteration
        self.retire_unleased()

    def name(self, iteration: int) -> None:
        self.policy.advance(iteration, None)
        self.named = iteration
        self.retire_unleased()

    def retire_unleased(self) -> list[int]:
        """Retire every version older than the newest `keep_last` that no reader leases now (a leased one stays
        until a later publication finds it free); the iterations retired."""
        retired = []
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
            retired.append(iteration)
        return retired

    def _remove(self, paths: list[str]) -> None:
        for path in paths:
            self.storage.remove(path)
            log.debug("--publish-weights-dir: removed %s", path)
