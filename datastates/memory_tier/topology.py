"""Which node each rank is on, and which ranks replicate each other: the replication that protects against a
lost node needs peers on other nodes, and restart needs to know which node holds which part.

Nodes: torchrun's GROUP_RANK / LOCAL_WORLD_SIZE (or Slurm's SLURM_NODEID) name the node of a rank. On one
machine, `DATASTATES_RANKS_PER_NODE=k` simulates nodes of k consecutive ranks.

Cliques follow Megatron-LM's: with factor F and jump J, ranks {i, i+J, ..., i+(F-1)J} (within blocks of F*J
ranks) hold each other's parts; J defaults to the ranks per node, so the peers are on other nodes. The cliques
follow the world present (`fitted_replication`): a job restarted on fewer nodes replicates among those left, with fewer
peers or none, instead of failing.
"""
from __future__ import annotations

import os
import socket

import torch.distributed as dist

from ..errors import CheckpointError


def node_of(rank: int, world_size: int) -> tuple[int, int]:
    """(node index, ranks per node) of `rank`, as this process's environment says."""
    simulated = os.environ.get("DATASTATES_RANKS_PER_NODE")
    if simulated:
        per_node = int(simulated)
        if per_node < 1 or world_size % per_node:
            raise CheckpointError(f"DATASTATES_RANKS_PER_NODE={simulated} does not divide the world size "
                                  f"{world_size}")
        return rank // per_node, per_node
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    node = os.environ.get("GROUP_RANK", os.environ.get("SLURM_NODEID", rank // max(per_node, 1)))
    return int(node), per_node


def gather_nodes(world_size: int, node: int) -> tuple[int, ...]:
    """Every rank's node, as that rank sees it (GROUP_RANK and SLURM_NODEID name the node of the process that
    reads them, not another rank's): all-gathered when the default group is initialised."""
    nodes = [node_of(r, world_size)[0] for r in range(world_size)]
    if dist.is_available() and dist.is_initialized():
        dist.all_gather_object(nodes, node)
    return tuple(nodes)


def gather_machines(base_dir: str, world_size: int) -> tuple[str, ...]:
    """Every rank's machine and tier directory (`host:path`): the ranks that share one node-local memory, whatever
    their node numbers (which a job that re-forms may give out anew)."""
    mine = f"{socket.gethostname()}:{os.path.realpath(base_dir)}"
    machines = [mine] * world_size
    if dist.is_available() and dist.is_initialized():
        dist.all_gather_object(machines, mine)
    return tuple(machines)


def cliques(world_size: int, factor: int, jump: int) -> list[list[int]]:
    """Megatron-LM's replication cliques: groups of `factor` ranks `jump` apart."""
    if factor < 1 or jump < 1:
        raise CheckpointError(f"--replication-factor {factor} and --replication-jump {jump} must be positive")
    if world_size % (factor * jump):
        raise CheckpointError(f"--replication-factor {factor} x --replication-jump {jump} = {factor * jump} does "
                              f"not divide the world size {world_size}")
    return [[base + i + k * jump for k in range(factor)]
            for base in range(0, world_size, factor * jump) for i in range(jump)]


def fitted_replication(world_size: int, per_node: int, factor: int, jump: int | None) -> tuple[int, int]:
    """(factor, jump) of the replication the world present can take, the one rule of the check at a job's start
    and of the tier: the jump is `--replication-jump`, else the ranks per node (peers on other nodes); the factor
    the largest f <= `factor` whose cliques (f ranks `jump` apart) tile the world; 1 (no replication) when none
    does, e.g. a single node left of a job that lost the others."""
    jump = jump or per_node
    return max((f for f in range(1, factor + 1) if world_size % (f * jump) == 0), default=1), jump
