"""What a read does with a damaged checkpoint: stop at the first problem, or collect every one of them.

A load (the trainer's resume) stops at the first problem: nothing it could still read would make the state
whole. A check (`inspect --verify`, `convert`'s refusal of an unusable input) wants them all in one run: every
bad checksum, short file, missing shard or mismatched box of every rank, each named with its file and, where
known, its rank, item and file offset. The engine's checks and reads report to a `Problems`; `Problems.stop()`
raises the first report as the error it describes, `Problems()` keeps them.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

from .errors import CheckpointError


@dataclasses.dataclass(frozen=True)
class Problem:
    """One thing wrong with a checkpoint: the file it concerns, what is wrong, and where inside it."""

    file: str
    message: str
    rank: Optional[int] = None
    item: Optional[str] = None
    offset: Optional[int] = None  # in the file

    def to_json(self) -> dict:
        return {"file": self.file, "problem": self.message,
                **{k: v for k, v in (("rank", self.rank), ("item", self.item), ("offset", self.offset))
                   if v is not None}}


class Problems:
    """The problems (and warnings) found in a checkpoint, in the order found, each reported once."""

    def __init__(self):
        self.found: list[Problem] = []
        self.warnings: list[dict] = []
        self._seen: set[tuple[str, str]] = set()

    @staticmethod
    def stop() -> "Problems":
        """A policy that raises each problem at once (a load's)."""
        return _Stop()

    def add(self, file: str, message: str, error: type[CheckpointError] = CheckpointError, **where) -> None:
        """Record a problem with `file` (`where`: rank, item, offset); the same one again is not repeated.
        `error` is what a stopping policy raises."""
        if (file, message) not in self._seen:
            self._seen.add((file, message))
            self.found.append(Problem(file, message, **where))

    def warn(self, file: str, message: str) -> None:
        self.warnings.append({"file": file, "warning": message})

    @property
    def items(self) -> list[dict]:
        """Every problem as a JSON record: {"file", "problem", and "rank"/"item"/"offset" where known}."""
        return [p.to_json() for p in self.found]

    def __bool__(self) -> bool:
        return bool(self.found)

    def __len__(self) -> int:
        return len(self.found)

    def summary(self) -> str:
        return "\n".join(f"  {p.file}: {p.message}" for p in self.found)


class _Stop(Problems):
    def add(self, file: str, message: str, error: type[CheckpointError] = CheckpointError, **where) -> None:
        raise error(message)
