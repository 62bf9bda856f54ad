"""Every written byte of a checkpoint read back and checked against the index's crc32c; nothing is kept.

The audit (`audit.Audit.verify`: `inspect --verify`, `convert`'s check of its input) collects every bad chunk,
failed read and short file and goes on; the memory tier's restart stops at the first (`verify`). Reads go in
runs of whole checksum chunks through the staging slots, the same read pipeline a load uses.
"""
from __future__ import annotations

from typing import Callable

import torch

from .errors import CheckpointError
from .load_reads import Reads
from .open_checkpoint import OpenCheckpoint
from .problems import Problems
from .schema import Item


class CheckpointVerifier:
    """The byte checks of one open checkpoint."""

    def __init__(self, checkpoint: OpenCheckpoint):
        self.checkpoint = checkpoint

    def verify(self, rank: int) -> None:
        """Check every byte `rank` wrote, raising at the first damage (a malformed item included)."""
        self.checkpoint.items(rank)  # the first malformed item raises; `verify_all` leaves them to the audit
        self.verify_all(Problems.stop(), [rank])

    @torch.no_grad()
    def verify_all(self, problems: Problems, ranks=None, progress: Callable[[int], None] | None = None) -> dict:
        """Read every written item of `ranks` (default all) and check every chunk's crc32c, reporting each bad
        chunk, failed read and short file to `problems`. The structure is `datastates.audit`'s: a rank without a
        valid part and an item that does not validate are skipped here. `progress` receives the bytes of each
        read as it is submitted. Returns {"bytes_read", "chunks"}."""
        ckpt = self.checkpoint
        stats = {"bytes_read": 0, "chunks": 0}
        with Reads(ckpt, problems) as reads:
            for rank in range(ckpt.world_size) if ranks is None else ranks:
                for item in self._readable_items(rank, problems):
                    for first, last, nbytes in _chunk_groups(item, reads.pool.slot_bytes):
                        buf, slot, fresh = reads.buffer(nbytes)
                        reads.read_chunks(rank, item, first, last, buf, None, slot, fresh)
                        stats["bytes_read"] += nbytes
                        stats["chunks"] += last - first
                        if progress is not None:
                            progress(nbytes)
        return stats

    def _readable_items(self, rank: int, problems: Problems) -> list[Item]:
        """The valid written items of `rank` that lie within its data file, which is opened here."""
        ckpt = self.checkpoint
        try:
            items, _ = ckpt.part(rank).checked_items()
            size = ckpt.open_data(rank, problems)
        except CheckpointError as e:
            problems.add(ckpt.data_path(rank), str(e), type(e), rank=rank)
            return []
        return [it for it in items.values() if it.write and it.nbytes and it.offset + it.stored_bytes <= size]


def _chunk_groups(item: Item, max_bytes: int):
    """(first, last, nbytes) of runs of whole checksum chunks of `item`, each at most `max_bytes` (or one chunk)."""
    chunks = item.chunks()
    first = 0
    while first < len(chunks):
        last, start = first + 1, chunks[first][0]
        while last < len(chunks) and chunks[last][0] + chunks[last][1] - start <= max_bytes:
            last += 1
        yield first, last, chunks[last - 1][0] + chunks[last - 1][1] - start
        first = last
