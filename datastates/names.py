"""How the megatron adapter names the items it saves: the one definition its readers parse the names with.

A checkpoint's global items are found by name. `datastates.megatron` names them from megatron-core's keys, and
the reader (`CheckpointReader.common`), the trainer and the tools take the names apart again, so the rules live
here, once, without megatron-core (a tool reads a checkpoint without it; `datastates.megatron` re-exports them):

- the common state: a `Common` value at path `a/b` of the state is the object `common:a/b`;
- a ShardedTensor is the tensor named by its key; a ShardedObject is the object `key@o1,o2` (its grid offset);
- a flattened range of a local shard (the distributed optimizer) is the 1-D tensor `key@o1,o2|flat`, one per
  local shard (its global offset).
"""
from __future__ import annotations

import re

COMMON_PREFIX = "common:"
FLAT_SUFFIX = "|flat"
_SHARD_NAME = re.compile(r"^(?P<key>.+)@(?P<offset>\d+(?:,\d+)*)$")


def common_name(path: str) -> str:
    """The name of the common value at `path` (slash-joined) of the saved state."""
    return COMMON_PREFIX + path


def common_path(name: str) -> str | None:
    """The state path of a common value's name; None for any other name."""
    return name[len(COMMON_PREFIX):] if name.startswith(COMMON_PREFIX) else None


def shard_name(key: str, offset) -> str:
    """`key@o1,o2`: a ShardedObject's name (and the start of every shard's item id)."""
    return f"{key}@{','.join(map(str, offset))}"


def parse_shard_name(name: str) -> tuple[str, tuple[int, ...]] | None:
    """(key, offset) of a `shard_name`; None for a name of another form."""
    m = _SHARD_NAME.match(name)
    return None if m is None else (m.group("key"), tuple(int(x) for x in m.group("offset").split(",")))


def flat_name(key: str, offset) -> str:
    """The name of the flattened range of the local shard of `key` at global `offset`."""
    return shard_name(key, offset) + FLAT_SUFFIX


def is_flat(name: str) -> bool:
    """Whether a tensor name is a flattened range (distributed-optimizer state, not a model-shaped tensor)."""
    return name.endswith(FLAT_SUFFIX)
