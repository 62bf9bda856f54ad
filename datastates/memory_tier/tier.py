"""LocalTier: one rank's side of the memory tier of one job, the object the trainer holds.

Its lifecycle: set-up (collective: learn every rank's node, remove what killed saves left, set apart this job's
tier of another layout, write the owner record), then one part per memory save at `path(iteration)`, sent to the clique by
`replicate`; at a restart `choose`; at the end `close`, and `remove` when the job finished. Replication and the
restart choice are delegated to `replication.Replicator` and `restart`, which get what they need from here.
"""
from __future__ import annotations

import torch.distributed as dist

from ..engine import CheckpointEngine
from ..errors import CheckpointError
from ..paths import join
from ..storage import SharedMemoryStorage
from . import restart
from .identity import owner, read_owner, write_owner
from .notices import notice
from .node_paths import NodePaths, node_of_dir
from .replication import Replicator, join_clique, parts_root
from .topology import fitted_replication, gather_machines, gather_nodes, node_of


class LocalTier:
    """One rank's side of the memory tier of one job; it keeps this rank's newest `keep` parts."""

    def __init__(self, base_dir: str, job: str, rank: int, world_size: int, layout: list, *, keep: int = 2,
                 replication_factor: int = 1, replication_jump: int | None = None, timeout_s: float = 600.0,
                 writer_threads: int = 4, **engine_kwargs):
        """Collective when the default group is initialised (every rank builds its tier at the same point).
        `layout` describes how the state is split (e.g. TP, PP, DP sizes): a tier of another layout is
        cleared, never loaded."""
        self.rank, self.world_size, self.keep, self.job = rank, world_size, keep, job
        self.node, per_node = node_of(rank, world_size)
        self.paths = NodePaths(join(base_dir, job), self.node)
        self.storage = SharedMemoryStorage(writer_threads=writer_threads, ahead=keep)  # the pages of the first saves
        self._owner = owner(job, world_size, layout)
        self._nodes = gather_nodes(world_size, self.node)
        self._machines = gather_machines(base_dir, world_size)
        self._set_up(distributed=dist.is_available() and dist.is_initialized())
        self.engine = CheckpointEngine(rank=0, world_size=1, keep_last=keep, storage=self.storage, tracker=False,
                                       **engine_kwargs)
        clique, group = [rank], None
        factor, jump = fitted_replication(world_size, per_node, replication_factor, replication_jump)
        self._tell_fitted(replication_factor, factor, jump, per_node)
        if factor > 1:
            clique, group = join_clique(rank, world_size, factor, jump, timeout_s, self._nodes)
        self._replicator = Replicator(self.storage, self.paths, self._nodes, rank, clique, group, keep)
        self.errors = self._replicator.errors  # replications that failed (each also logged as a warning)

    def _tell_fitted(self, factor: int, fitted: int, jump: int, per_node: int) -> None:
        """Say in one line when the world present takes fewer peers than asked, or none (a restart on fewer nodes
        than the flags were written for is never refused for it)."""
        if fitted < factor:
            nodes = len(set(self._nodes))
            present = f"{nodes} node{'s' if nodes > 1 else ''} of {per_node} rank{'s' if per_node > 1 else ''} present"
            notice(f"replication follows the world: {present}, too few for --replication-factor {factor} x "
                   f"--replication-jump {jump}: " + ("no replication (storage holds what a lost node held)"
                                                     if fitted == 1 else f"each part kept by {fitted} ranks "
                                                                         f"{jump} apart"))

    def _set_up(self, distributed: bool) -> None:
        """The node's first rank removes what killed saves left and sets apart (or clears) a tier of another
        owner; the owner record is (re)written; every rank's own directory exists after."""
        found = read_owner(self.storage, self.paths.job_file)
        stale = found not in (None, self._owner)
        self.replaced = found if stale else None  # the owner record of what is set apart (for the resume line)
        if distributed:
            dist.barrier()  # every rank has read the owner record before any rank rewrites it
        node_dir = self.paths.node_dir
        if self._first_of_node:
            if self._first_of_machine:
                self._adopt_renumbered()
            for name in self.storage.list(node_dir):
                parts_root(self.storage, join(node_dir, name)).clean_leftovers()
            if stale:
                self._set_apart(found, set_up_fate(self.storage, self.paths, self._owner))
            if stale or not self.storage.exists(self.paths.job_file):
                self.storage.make_dirs(self.paths.root)
                write_owner(self.storage, self.paths.job_file, self._owner)
        if distributed:
            dist.barrier()  # cleared before any rank writes again
        self.storage.make_dirs(self.paths.rank_dir(self.rank))

    @property
    def _first_of_node(self) -> bool:
        return self.rank == min(r for r in range(self.world_size) if self._nodes[r] == self.node)

    @property
    def _first_of_machine(self) -> bool:
        return self.rank == min(r for r in range(self.world_size) if self._machines[r] == self._machines[self.rank])

    def _adopt_renumbered(self) -> None:
        """The parts this machine's memory holds under a node number none of its ranks has now (the job re-formed
        and its nodes were numbered anew, e.g. node 0 lost and node 1 now node 0) become this node's: a part is
        the same bytes whichever node holds it, and a restart looks for it under the node's own number."""
        mine = {self._nodes[r] for r in range(self.world_size) if self._machines[r] == self._machines[self.rank]}
        for name in self.storage.list(self.paths.root):
            old = node_of_dir(name)
            if old is None or old in mine:
                continue
            other = NodePaths(self.paths.root, old)
            for rank_name in self.storage.list(other.node_dir):
                src, dst = join(other.node_dir, rank_name), join(self.paths.node_dir, rank_name)
                self.storage.make_dirs(dst)
                for part in self.storage.list(src):  # a part held under both numbers is kept once
                    if not self.storage.exists(join(dst, part)):
                        self.storage.move(join(src, part), join(dst, part))
            self.storage.remove(other.node_dir)
            notice(f"memory tier {other.node_dir}: the parts this machine held as node {old} are node "
                   f"{self.node}'s now ({self.paths.node_dir})", any_rank=True)

    def _set_apart(self, found: dict, fate: str) -> None:
        """This job's tier in another layout (the world changed): its parts go under `before/` (replacing what an
        earlier change left there), for a restart into this layout to read like a storage checkpoint; a tier of
        another job, or holding nothing, is cleared (`set_up_fate`)."""
        node_dir, before = self.paths.node_dir, self.paths.before
        if fate == CLEARED:
            notice(f"memory tier {node_dir} holds checkpoints of another layout: cleared")
            self.storage.remove(node_dir)
            return
        self.storage.remove(before.node_dir)
        self.storage.make_dirs(before.root)
        write_owner(self.storage, before.job_file, found)
        self.storage.move(node_dir, before.node_dir)
        notice(f"memory tier {node_dir} holds checkpoints of another layout (world size {found['world_size']}): "
               f"set apart in {before.node_dir}, to be read into this one")

    def node_of_rank(self, rank: int) -> int:
        return self._nodes[rank]

    def path(self, iteration: int) -> str:
        """Where this rank saves its part of `iteration` (give it to `self.engine.save`, then `replicate`)."""
        return self.paths.part(self.rank, iteration)

    def replicate(self, iteration: int, handle) -> None:
        """Send this rank's part of `iteration` to its clique once the save is published (background)."""
        self._replicator.submit(iteration, handle)

    def drain(self) -> None:
        """Wait until every queued replication is done."""
        self._replicator.drain()

    def held(self) -> dict[int, list[int]]:
        """rank -> the published iterations of its parts this node holds for this job (what `choose` offers)."""
        return restart.held_parts(self.storage, self.paths, self._owner)

    def choose(self, newer_than: int | None) -> str | None:
        """Collective over the default group: the directory of this rank's part of the newest memory checkpoint
        that every rank can load and verify and that is newer than storage's `newer_than`, else of the parts
        set apart in the layout before a change, merged into one checkpoint of every old rank on this node (read
        like a storage one, resharded); None when storage is the one to load (told in a notice when the tier had
        something). Parts set apart go once this layout has an iteration of its own."""
        path = restart.choose(storage=self.storage, paths=self.paths, nodes=self._nodes, rank=self.rank,
                              keep=self.keep, engine=self.engine, held=self.held(), newer_than=newer_than)
        if path is not None:
            if self._first_of_node:
                self.storage.remove(self.paths.before.node_dir)
            return path
        return restart.choose_before(storage=self.storage, paths=self.paths.before, nodes=self._nodes,
                                     rank=self.rank, keep=self.keep, engine=self.engine, newer_than=newer_than,
                                     merge=self._first_of_node)

    def close(self) -> None:
        """Finish the queued replications and stop."""
        self.drain()
        self.engine.close()

    def remove(self) -> None:
        """The job finished: delete this node's tier (after every rank of the node closed its tier)."""
        self.storage.remove(self.paths.node_dir)
        self.storage.remove(self.paths.before.node_dir)
        for path in (self.paths.before.job_file, self.paths.before.root, self.paths.job_file, self.paths.root):
            # unless another node's directory is there
            self.storage.remove_empty(path)


OWN, CLEARED, SET_APART = "own", "cleared", "set apart"


def set_up_fate(storage: SharedMemoryStorage, paths: NodePaths, record: dict) -> str:
    """What a tier's set-up under the owner `record` does with what this node holds: keeps it as its own (the
    same owner, or nothing recorded), clears it (another owner's tier holding no part), or sets it apart (this
    job's parts in another layout)."""
    found = read_owner(storage, paths.job_file)
    if found in (None, record):
        return OWN
    if found.get("job") != record["job"] or not restart.node_parts(storage, paths):
        return CLEARED
    return SET_APART


def check_fits(base_dir: str, need_bytes: int, job: str | None = None, rank: int = 0, world_size: int = 1,
               layout: list | None = None) -> None:
    """Fail before any work when the tier of `job` (rank `rank` of `world_size` in `layout`) cannot fit in the
    memory file system it lives on: what is free there, plus what this node's set-up gives back (this layout's
    own parts, whose pages the saves reuse; a tier it clears; the parts an earlier change set apart, replaced by
    the ones it sets apart now). Parts set apart stay beside the new layout's saves: they count as taken."""
    storage = SharedMemoryStorage()
    free = storage.free_bytes(base_dir)
    given_back, kept = 0, 0
    if job is not None:
        paths = NodePaths(join(base_dir, job), node_of(rank, world_size)[0])
        fate = set_up_fate(storage, paths, owner(job, world_size, layout or []))
        if fate == SET_APART:
            given_back, kept = bytes_under(storage, paths.before.node_dir), bytes_under(storage, paths.node_dir)
        else:
            given_back, kept = bytes_under(storage, paths.node_dir), bytes_under(storage, paths.before.node_dir)
    if need_bytes > free + given_back:
        held = (f" ({kept / 2**30:.2f} GiB of it held by parts of this job's earlier layout, set apart for a "
                f"restart into this one)" if kept else "")
        raise CheckpointError(f"the memory tier needs about {need_bytes / 2**30:.2f} GiB in {base_dir!r} but only "
                              f"{(free + given_back) / 2**30:.2f} GiB are free there{held}: lower "
                              f"--replication-factor, or point --non-persistent-local-ckpt-dir at a larger memory "
                              f"file system")


def bytes_under(storage: SharedMemoryStorage, path: str) -> int:
    """The size of every object under `path` (0 when there is none)."""
    names = storage.list(path)
    if not names:
        return stat.size if (stat := storage.stat(path)) is not None else 0
    return sum(bytes_under(storage, join(path, name)) for name in names)
