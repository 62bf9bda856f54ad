"""Where the memory tier keeps its files, named in one place so that set-up, replication and restart agree:

    <base>/<job id>/job.json                                 the owner record (identity.py)
    <base>/<job id>/node_00001/rank_00005/iter_0000007/      rank 5's part, held by node 1 (its own or a replica)
    <base>/<job id>/before/...                               the same, of the layout before a change (kept for a
                                                             restart into the new one)
    <base>/<job id>/before/node_00001/merged/iter_0000007/   node 1's parts of iteration 7, as one checkpoint

One directory per node, so that nodes simulated on one machine (DATASTATES_RANKS_PER_NODE) hold their parts
apart, as real nodes do.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..paths import checkpoint_dir, join

_RANK = "rank_"
_NODE = "node_"
_BEFORE = "before"


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
        return join(self.root, f"{_NODE}{self.node:05d}")

    def rank_dir(self, rank: int) -> str:
        """Where this node holds the parts of `rank`."""
        return join(self.node_dir, f"{_RANK}{rank:05d}")

    def part(self, rank: int, iteration: int) -> str:
        """Where this node holds `rank`'s part of `iteration`."""
        return checkpoint_dir(self.rank_dir(rank), iteration)

    @property
    def before(self) -> "NodePaths":
        """This node's share of the tier the job wrote in its layout before a change (another world size)."""
        return NodePaths(join(self.root, _BEFORE), self.node)

    def merged(self, iteration: int) -> str:
        """Where this node's parts of every rank of `iteration` are one checkpoint (links to their data)."""
        return checkpoint_dir(join(self.node_dir, "merged"), iteration)


def rank_of(name: str) -> int | None:
    """The rank whose parts a directory of a node holds (`rank_00005` -> 5); None for any other name."""
    if name.startswith(_RANK) and name[len(_RANK):].isdigit():
        return int(name[len(_RANK):])
    return None


def node_of_dir(name: str) -> int | None:
    """The node whose parts a directory of a job's tier holds (`node_00001` -> 1); None for any other name."""
    if name.startswith(_NODE) and name[len(_NODE):].isdigit():
        return int(name[len(_NODE):])
    return None
