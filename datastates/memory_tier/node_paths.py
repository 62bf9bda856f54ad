"""Where the memory tier keeps its files, named in one place so that set-up, replication and restart agree:

    <base>/<job id>/job.json                                 the owner record (identity.py)
    <base>/<job id>/node_00001/rank_00005/iter_0000007/      rank 5's part, held by node 1 (its own or a replica)

One directory per node, so that nodes simulated on one machine (DATASTATES_RANKS_PER_NODE) hold their parts
apart, as real nodes do.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..paths import checkpoint_dir, join

_RANK = "rank_"


@dataclass(frozen=True)
class NodePaths:
    """One node's share of one job's tier."""
    root: str  # <base>/<job id>
    node: int

    @property
    def job_file(self) -> str:
        return join(self.root, "job.json")

    @property
    def node_dir(self) -> str:
        return join(self.root, f"node_{self.node:05d}")

    def rank_dir(self, rank: int) -> str:
        """Where this node holds the parts of `rank`."""
        return join(self.node_dir, f"{_RANK}{rank:05d}")

    def part(self, rank: int, iteration: int) -> str:
        """Where this node holds `rank`'s part of `iteration`."""
        return checkpoint_dir(self.rank_dir(rank), iteration)


def rank_of(name: str) -> int | None:
    """The rank whose parts a directory of a node holds (`rank_00005` -> 5); None for any other name."""
    if name.startswith(_RANK) and name[len(_RANK):].isdigit():
        return int(name[len(_RANK):])
    return None
