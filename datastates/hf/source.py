"""A checkpoint's model tensors, read one tensor (or one unit of a stacked one: a layer, a layer's expert) at a time.

datastates checkpoints are checked as the other tools check them (the engine's Audit: published, every rank's
files, every tensor covered) and read through the engine's public reader, which verifies every chunk's
crc32c and assembles a box of a global tensor from whichever ranks' shards hold it, within the engine's staging
budget. torch_dist checkpoints are read box by box through PyTorch DCP, the format under megatron-core's torch_dist.
"""
from __future__ import annotations

import os

import torch

from datastates import Audit, CheckpointError, CheckpointReader, NotACheckpointError, find_latest, storage_for
from datastates.paths import METADATA, TRACKER, scheme as url_scheme
from datastates.names import common_name

from . import HFError

ARGS_OBJECT = common_name("args")


class DatastatesSource:
    """name -> (global shape, dtype) of every global tensor, the saved flags, and reads of boxes."""

    def __init__(self, path: str, staging_bytes: int):
        try:
            self.reader = CheckpointReader.open(path, threads=2, staging_bytes=staging_bytes)
        except CheckpointError as e:
            raise HFError(f"input {path!r}: {e}") from None
        self.path = self.reader.path
        try:
            audit = Audit(self.path)
        except NotACheckpointError as e:
            self.reader.close()
            raise HFError(str(e)) from None
        if audit.problems:
            self.reader.close()
            raise HFError(f"input checkpoint {self.path!r} is unusable:\n{audit.problems.summary()}")
        self.tensors = self.reader.tensors()
        self._unit_buffer = None

    def args(self):
        if ARGS_OBJECT not in self.reader.objects():
            return None
        return self._read(self.reader.object, ARGS_OBJECT)

    def read(self, name: str, index: tuple[int, ...] = ()) -> torch.Tensor:
        """The whole tensor, or the unit `index` of a stacked one (a layer, or a layer's expert: its leading
        axes). The units of one tensor are read into the same buffer: a unit is valid until the next read."""
        shape, dtype = self.tensors[name]
        if not index:
            return self._read(self.reader.tensor, name)
        unit = (1,) * len(index) + tuple(shape[len(index):])
        if self._unit_buffer is None or self._unit_buffer[0] != name:
            self._unit_buffer = None  # freed before the next is allocated
            self._unit_buffer = (name, torch.empty(unit, dtype=dtype))
        offset = tuple(index) + (0,) * (len(shape) - len(index))
        return self._read(self.reader.tensor, name, offset, unit, self._unit_buffer[1]).reshape(shape[len(index):])

    def _read(self, read, *args):
        try:
            return read(*args)
        except CheckpointError as e:
            raise HFError(f"reading {self.path!r} failed: {e}") from None

    def close(self) -> None:
        self.reader.close()


def torch_dist_directory(path: str) -> str:
    """An iteration directory of a torch_dist checkpoint, or a save root's latest one."""
    path = os.path.normpath(path)
    if os.path.isfile(os.path.join(path, METADATA)):
        return path
    latest = find_latest(path)
    if latest.path is not None and os.path.isfile(os.path.join(latest.path, METADATA)):
        return latest.path
    raise HFError(f"input {path!r} is neither a torch_dist checkpoint directory (no {METADATA}) nor a save "
                  f"root whose {TRACKER} names one")


def _box_planner(name: str, offset: tuple[int, ...]):
    """A PyTorch DCP load planner that reads one box (at `offset`, the size of the state's tensor) of the saved
    tensor `name`: DCP reads only the saved chunks the box overlaps, each chunk whole, and copies their overlap."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
    from torch.distributed.checkpoint.planner import LoadPlan
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    class BoxPlanner(DefaultLoadPlanner):
        def create_local_plan(self) -> LoadPlan:
            box = ChunkStorageMetadata(offsets=torch.Size(offset), sizes=self.state_dict[name].size())
            return LoadPlan(create_read_items_for_chunk_list(name, self.metadata.state_dict_metadata[name], [box]))

        def lookup_tensor(self, index):
            return self.state_dict[index.fqn]  # the box itself (DCP's default wants a box at the origin)
    return BoxPlanner(flatten_state_dict=False, flatten_sharded_tensors=False)


class TorchDistSource:
    """The same interface over a torch_dist checkpoint: megatron-core reads its tensor list and common state, and
    PyTorch DCP (the format under megatron-core's) reads each box. megatron-core's own load of one layer's box, in
    a world of one process, fails building PyTorch's sharded-tensor metadata (it places every other layer's
    fragment on this rank); a DCP read of a box holds the saved chunks it overlaps, one at a time."""

    def __init__(self, path: str, init_distributed):
        self.path = torch_dist_directory(path)
        init_distributed()
        from megatron.core import dist_checkpointing
        from megatron.core.dist_checkpointing import serialization
        from megatron.core.dist_checkpointing.mapping import ShardedTensor
        try:
            meta = serialization.load_sharded_metadata(self.path)
            self._common = dist_checkpointing.load_common_state_dict(self.path)
        except Exception as e:  # megatron-core raises many types (CheckpointingException, RuntimeError, OSError)
            raise HFError(f"reading torch_dist checkpoint {self.path!r} failed: {type(e).__name__}: {e}") from None
        self.tensors = {sh.key: (tuple(sh.global_shape), sh.dtype) for sh in meta.values()
                        if isinstance(sh, ShardedTensor)}

    def args(self):
        return self._common.get("args") if isinstance(self._common, dict) else None

    def read(self, name: str, index: tuple[int, ...] = ()) -> torch.Tensor:
        """As DatastatesSource.read (a fresh buffer each time)."""
        from torch.distributed import checkpoint as dcp
        shape, dtype = self.tensors[name]
        box = torch.empty((1,) * len(index) + tuple(shape[len(index):]), dtype=dtype)
        try:
            dcp.load({name: box}, storage_reader=dcp.FileSystemReader(self.path),
                     planner=_box_planner(name, tuple(index) + (0,) * (len(shape) - len(index))))
        except Exception as e:  # noqa: BLE001 (DCP wraps reader errors in CheckpointException, among others)
            raise HFError(f"reading {name!r} from {self.path!r} failed: {type(e).__name__}: {e}") from None
        return box.reshape(shape[len(index):])

    def close(self) -> None:
        pass


def open_source(kind: str, path: str, staging_bytes: int, init_distributed):
    if url_scheme(path) is not None:  # convert_checkpoint refuses torch_dist there
        if not storage_for(path).exists(path):
            raise HFError(f"input {path!r} does not exist")
    elif not os.path.isdir(path):
        raise HFError(f"input {path!r} is not a directory")
    if kind == "datastates":
        return DatastatesSource(path, staging_bytes)
    return TorchDistSource(path, init_distributed)
