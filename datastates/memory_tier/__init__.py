"""The node-local memory tier: every rank's newest checkpoints in memory that outlives the training processes.

A software failure, the common case, kills the processes but not the node: their memory tier in `/dev/shm`
survives, and the restart loads from it in seconds instead of from the parallel file system. Each rank saves
its own part as a self-contained checkpoint (same format, checksums and atomic publication as on storage, no
fsync) with its own `CheckpointEngine` on shared-memory storage (`storage.SharedMemoryStorage`): the snapshot is
copied straight into the tier's pages, and a storage save of the same iteration writes from those pages
(`CheckpointEngine.save(pages=)`). With replication, each part is also sent to the F-1 peers of the rank's
clique on other nodes, so that a node lost entirely is recovered from its peers' memory.

One module per job, read in this order: `tier` (LocalTier: set-up, where parts go, the end of the tier),
`identity` (whose tier it is), `node_paths` (where its files are), `topology` (nodes and cliques), `replication`
(the background exchange with the clique), `restart` (which iteration every rank loads, and recovery of the
parts a node lacks), `notices` (what the tier tells the operator).
"""
from .identity import job_id
from .tier import LocalTier, check_fits
from .topology import cliques, fitted_replication, node_of

__all__ = ["LocalTier", "check_fits", "cliques", "fitted_replication", "job_id", "node_of"]
