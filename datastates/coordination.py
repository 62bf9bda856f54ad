"""Agreement on each save across ranks, through a torch.distributed key-value store, never the file system.

Every message is O(1) per rank; rank 0 alone does O(W) work (reading the W reports). Nothing here runs on the
training thread: the engine's publisher thread calls it, so training never blocks on a rank that is late or
dead. Keys of save `seq` (under a prefix unique to this engine):

    {seq}/r/{rank}   each rank's report: its manifest, or why it failed
    {seq}/n          how many ranks reported (store.add); the rank that makes it W sets {seq}/all
    {seq}/fail       failure log (store.append); a failing rank also sets {seq}/gate at once
    {seq}/gate       rank 0 wakes on it: set by the last report, or by the first failure
    {seq}/result     rank 0's verdict, set after `latest` names the checkpoint (or on failure), with the
                     checkpoints it retired, for each rank to delete its files from
    {seq}/ack        ranks that read the verdict (each deletes its report); the last one deletes the rest

The trainer's Hugging Face export agrees through a Coordinator of its own, with the same keys (`report`,
`await_reports`, `manifests`, then `forget` on rank 0, which alone publishes: no verdict is waited for).

A dead or stuck rank shows as a timeout on rank 0, which names the ranks that did not report; a dead rank 0
shows as a timeout on the others. The store is the launcher's (torchrun's TCPStore through the default
process group), on its own client connection so blocking waits never hold up the training thread's store use.
"""
from __future__ import annotations

import datetime
import json

import torch.distributed as dist

from .errors import CheckpointError, CheckpointTimeoutError



def default_store() -> dist.Store:
    """A fresh client of the default process group's store."""
    try:
        store = dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError) as e:
        raise CheckpointError(f"cannot reach the default process group's store to coordinate saves ({e}); pass "
                              f"CheckpointEngine(store=...)") from e
    try:
        return store.clone()
    except (RuntimeError, NotImplementedError):
        return store  # stores without clone() (a custom one) have no single connection to hold up


class Coordinator:
    """One rank's side of save agreement for one engine."""

    def __init__(self, store: dist.Store | None, rank: int, world_size: int):
        if world_size > 1 and store is None:
            raise CheckpointError(f"world_size={world_size} needs a torch.distributed store to agree on saves: "
                                  f"initialise the default process group or pass CheckpointEngine(store=...)")
        self.rank, self.world_size = rank, world_size
        self._local: dict[int, tuple[dict | None, str | None]] = {}
        self.store = store
        if store is not None:
            # every rank creates its engines in the same order, so the nth engine of each rank gets id n
            engine_id = store.add(f"datastates/engines/{rank}", 1)
            self.store = dist.PrefixStore(f"datastates/{engine_id}/", store)

    def _wait(self, key: str, timeout_s: float) -> bool:
        try:
            self.store.wait([key], datetime.timedelta(seconds=max(timeout_s, 0.001)))
            return True
        except RuntimeError:  # DistStoreError from TCPStore, a plain RuntimeError("Wait timeout") from FileStore
            return False

    def _missing(self, seq: int) -> list[int]:
        """The ranks that have not reported save `seq` (after a timeout only: this is O(W))."""
        if self.store.check([f"{seq}/all"]):
            return []
        return [r for r in range(self.world_size) if not self.store.check([f"{seq}/r/{r}"])]

    def report(self, seq: int, manifest: dict | None, error: str | None) -> None:
        """Every rank: this rank's part of save `seq` is durable (manifest) or failed (error)."""
        if self.world_size == 1:
            self._local[seq] = (manifest, error)  # the completer may report the next save before this is gathered
            return
        body = {"manifest": manifest} if error is None else {"error": error}
        self.store.set(f"{seq}/r/{self.rank}", json.dumps(body, separators=(",", ":")))
        if error is not None:
            self.store.append(f"{seq}/fail", f"rank {self.rank}: {error}\n")
            self.store.set(f"{seq}/gate", "fail")
        if self.store.add(f"{seq}/n", 1) == self.world_size:
            self.store.set(f"{seq}/all", "1")
            self.store.set(f"{seq}/gate", "all")

    def await_reports(self, seq: int, what: str, timeout_s: float) -> None:
        """Rank 0: wait until every rank reported save `seq`; raise naming the ranks that failed or are missing."""
        if self.world_size == 1:
            error = self._local[seq][1]
            if error is not None:
                del self._local[seq]
                raise CheckpointError(f"{what} not published: rank 0: {error}")
            return
        if not self._wait(f"{seq}/gate", timeout_s):
            missing = self._missing(seq)
            if missing:
                raise CheckpointTimeoutError(f"{what} not published: rank(s) {missing} did not finish within "
                                             f"{timeout_s:g} s")
            # every rank's report is there (each written once its part was durable): the last one's count was
            # lost with its process, killed between the two, so nothing is missing
        if self.store.check([f"{seq}/fail"]):  # the gate's value may be the last report's, set after a failure
            causes = self.store.get(f"{seq}/fail").decode().strip().replace("\n", "; ")
            raise CheckpointError(f"{what} not published: {causes}")

    def manifests(self, seq: int) -> dict[int, dict]:
        """Rank 0, after `await_reports`: every rank's manifest of save `seq` (one round trip, O(W) bytes)."""
        if self.world_size == 1:
            return {0: self._local.pop(seq)[0]}
        keys = [f"{seq}/r/{r}" for r in range(self.world_size)]
        reports = [json.loads(v) for v in self.store.multi_get(keys)]
        return {r: rep["manifest"] for r, rep in enumerate(reports)}

    def await_all_reports(self, seq: int, timeout_s: float) -> bool:
        """Rank 0, after a failure: give the other ranks time to finish touching the save's directory."""
        return self.world_size == 1 or self._wait(f"{seq}/all", timeout_s)

    def announce(self, seq: int, error: str | None, retired: list[str] = ()) -> None:
        """Rank 0: the verdict on save `seq`, once it is published and `latest` names it (or it failed), with the
        directories it retired."""
        if self.world_size > 1:
            body = {"retired": list(retired)} if error is None else {"error": error}
            self.store.set(f"{seq}/result", json.dumps(body, separators=(",", ":")))

    def verdict(self, seq: int, what: str, timeout_s: float) -> list[str]:
        """Ranks other than 0: wait for rank 0's verdict on save `seq`; raise it if the save failed, else return
        the directories rank 0 retired. Waits a little longer than rank 0 waits for the ranks, so that rank 0's
        verdict usually names a late rank; if it does not come, this rank names the missing ranks itself."""
        if self.world_size == 1:
            return []
        timeout_s += min(5.0, 0.1 * timeout_s)
        if not self._wait(f"{seq}/result", timeout_s):
            missing = self._missing(seq)
            who = f"rank(s) {missing} did not finish" if missing else "rank 0 did not publish it"
            raise CheckpointTimeoutError(f"{what} not published within {timeout_s:g} s: {who}")
        result = json.loads(self.store.get(f"{seq}/result"))
        if "error" in result:
            raise CheckpointError(result["error"])
        return result["retired"]

    def forget(self, seq: int) -> None:
        """Rank 0, in an agreement whose verdict no rank waits for (the trainer's Hugging Face export: rank 0 alone
        publishes), after `await_reports`: save `seq`'s keys removed (a rank that reports after a timeout leaves
        its own, under a `seq` never used again)."""
        if self.world_size == 1:
            self._local.pop(seq, None)
            return
        for key in [f"r/{r}" for r in range(self.world_size)] + ["n", "all", "fail", "gate"]:
            self.store.delete_key(f"{seq}/{key}")

    def done(self, seq: int) -> None:
        """Every rank, after the verdict: removes its report; the last one to get here removes the rest."""
        if self.world_size == 1:
            return
        self.store.delete_key(f"{seq}/r/{self.rank}")
        if self.store.add(f"{seq}/ack", 1) == self.world_size:
            for key in ("n", "all", "fail", "gate", "result", "ack"):
                self.store.delete_key(f"{seq}/{key}")
