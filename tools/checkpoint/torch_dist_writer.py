"""megatron-core's torch_dist format, written piece by piece through PyTorch DCP's own file writer.

megatron-core's writer stages every tensor of the state before it writes the first byte
(`FileSystemWriterAsync.prepare_write_data`): a conversion through it holds the whole model. PyTorch DCP's
`FileSystemWriter` instead asks its planner for each write item as it writes it. Here every tensor is a list of
pieces, one per index of its leading (layer, expert) axes, each a chunk of the tensor in the DCP metadata and made
only when it is written: host memory holds one piece, whatever the model's size. One writer thread: DCP's other
writer threads drop their exceptions (torch 2.13, `filesystem._write_files_from_queue`), which would publish a
checkpoint with pieces missing.

What megatron-core 0.16 and 0.19 read as torch_dist: DCP files whose tensors are keyed by their ShardedTensor key and
whose objects by their ShardedObject's unique key (holding `torch.save([value])`), megatron-core's
`metadata.json`, and the common state in `common.pt` (0.19 writes it inside the DCP files instead but still reads
`common.pt`, so a checkpoint written under either version loads under both). Files are fsynced and written into
the unpublished place of the save root's policy (`datastates.SaveRoot`, `metadata.json` its marker, written last:
`<out>.<pid>-<random>.partial`, this process's alone), committed as `out` when complete, never over an output
another conversion completed meanwhile, the tracker pointed at it; a failure removes it (DCP reports a failure as a
`CheckpointException`, a BaseException, holding the error that caused it).
"""
from __future__ import annotations

import dataclasses
import io
import itertools
import json
import os
import warnings
from typing import Callable

import torch
from torch.distributed import checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

from datastates import SaveRoot, storage_for

from .paths import ConvertError

COMMON_FILE = "common.pt"  # the common state: written by megatron-core <= 0.16, read by 0.19 too
CONFIG_FILE = "metadata.json"


@dataclasses.dataclass(frozen=True)
class Pieces:
    """A tensor of `shape` and `dtype` written as one piece per index of its first `lead` axes; `build(index)`
    makes the values of one piece (shape `shape[lead:]`) when the writer reaches it."""
    shape: tuple[int, ...]
    dtype: torch.dtype
    lead: int
    build: Callable[[tuple[int, ...]], torch.Tensor]

    @classmethod
    def whole(cls, tensor: torch.Tensor, lead: int = 0) -> "Pieces":
        """A tensor already in memory, written as `lead` axes' worth of pieces (so that a reader can take one)."""
        return cls(tuple(tensor.shape), tensor.dtype, lead, lambda index: tensor[index])

    def indices(self):
        return itertools.product(*(range(n) for n in self.shape[:self.lead]))


class PiecePlanner(DefaultSavePlanner):
    """DCP's default global planning (metadata from the items, overlap and bounds checks) over write items of our
    own: a chunk per piece, a byte item per object; `resolve_data` builds each as it is written. `listed`: an
    object is saved as `[value]` (megatron-core's ShardedObject) rather than itself (a plain DCP state dict's);
    `paths`: each key's place in a nested state dict, recorded in the metadata as DCP's flattening records it."""

    def __init__(self, tensors: dict[str, Pieces], objects: dict[str, object], listed: bool = True,
                 paths: dict[str, tuple] | None = None):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.tensors, self.objects, self.listed, self.paths = tensors, objects, listed, paths

    def create_global_plan(self, all_plans):
        plans, metadata = super().create_global_plan(all_plans)
        if self.paths is not None:
            metadata = dataclasses.replace(metadata, planner_data=self.paths)
            self.metadata = metadata
        return plans, metadata

    def create_local_plan(self) -> SavePlan:
        items = [WriteItem(index=MetadataIndex(key), type=WriteItemType.BYTE_IO) for key in self.objects]
        for key, pieces in self.tensors.items():
            size = torch.Size(pieces.shape)
            properties = TensorProperties(dtype=pieces.dtype)
            for index in pieces.indices():
                offsets = torch.Size((*index, *(0,) * (len(size) - pieces.lead)))
                sizes = torch.Size((*(1,) * pieces.lead, *size[pieces.lead:]))
                chunk = ChunkStorageMetadata(offsets=offsets, sizes=sizes)
                items.append(WriteItem(index=MetadataIndex(key, offsets), type=WriteItemType.SHARD,
                                       tensor_data=TensorWriteData(chunk=chunk, properties=properties, size=size)))
        self.plan = SavePlan(items)
        return self.plan

    def resolve_data(self, write_item: WriteItem):
        key = write_item.index.fqn
        if write_item.type == WriteItemType.BYTE_IO:
            buffer = io.BytesIO()
            torch.save([self.objects[key]] if self.listed else self.objects[key], buffer)
            buffer.seek(0)
            return buffer
        pieces = self.tensors[key]
        chunk = write_item.tensor_data.chunk
        values = pieces.build(tuple(chunk.offsets[:pieces.lead]))
        if tuple(values.shape) != tuple(pieces.shape[pieces.lead:]) or values.dtype != pieces.dtype:
            raise ConvertError(f"piece {tuple(chunk.offsets[:pieces.lead])} of {key!r} was built as "
                               f"{tuple(values.shape)} {values.dtype}, not {pieces.shape[pieces.lead:]} {pieces.dtype}")
        return values.reshape(chunk.sizes).contiguous()


def object_name(key: str, offset: tuple[int, ...], shape: tuple[int, ...]) -> str:
    """The name megatron-core's torch_dist gives a ShardedObject in the DCP files."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    return ShardedObject(key, None, tuple(shape), tuple(offset)).unique_key


def save_torch_dist(tensors: dict[str, Pieces], objects: dict[tuple[str, tuple], object],
                    object_shapes: dict[str, tuple], common: dict, out: str) -> None:
    """Write a torch_dist checkpoint of world size 1 at `out` (which must not exist): `tensors` piece by piece,
    the ShardedObjects `objects` ({(key, offset): value}) of global shapes `object_shapes`, and `common`; the
    tracker of its save root points at it."""
    named = {object_name(key, offset, object_shapes[key]): value for (key, offset), value in objects.items()}
    for name in named:
        if name in tensors:
            raise ConvertError(f"object {name!r} has the name of a tensor")
    root = SaveRoot(storage_for(out), os.path.dirname(os.path.abspath(out)), marker=CONFIG_FILE)
    try:
        _publish(root, planner=PiecePlanner(tensors, named), common=common, out=out)
    finally:
        root.storage.close()


def write_dcp(directory: str, planner: PiecePlanner) -> None:
    """DCP's files of `planner`'s items in `directory`, fsynced, from this one process."""
    writer = dcp.FileSystemWriter(directory, thread_count=1, sync_files=True)
    with warnings.catch_warnings():  # DCP warns that it saves in one process even when told to
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save({}, storage_writer=writer, planner=planner, no_dist=True)


def _failed(e: BaseException, what: str, out: str) -> ConvertError:
    """The ConvertError of a failed write of `out`: the error DCP reports as the cause (a `CheckpointException`,
    a BaseException, holds it), a ConvertError raised while building a piece as it is."""
    cause = e.failures[0][0] if isinstance(e, CheckpointException) and 0 in e.failures else e
    if isinstance(cause, ConvertError):
        return cause
    return ConvertError(f"writing {what} checkpoint {out!r} failed: {type(cause).__name__}: {cause}")


def publish_dcp(root: SaveRoot, out: str, planner: PiecePlanner, what: str, marker: bytes | None = None,
                beside: Callable[[str], None] | None = None) -> None:
    """DCP's files of `planner` (and what `beside` adds to the directory) written unseen, then `out` published
    with `marker` (None: DCP's own files hold the root's marker) and the tracker pointed at it, never over an
    output another conversion completed meanwhile; a failure removes what was written. `what` names the format."""
    partial = root.stage(out, private=True)
    try:
        write_dcp(partial, planner)
        if beside is not None:
            beside(partial)
        root.publish(partial, out, marker, replace=False)
    except FileExistsError:
        root.storage.remove(partial)
        raise ConvertError(f"output {out!r} was written by another conversion meanwhile: refusing to overwrite it") \
            from None
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP and the file system raise many types
        root.storage.remove(partial)
        raise _failed(e, what, out) from None


def _publish(root: SaveRoot, planner: PiecePlanner, common: dict, out: str) -> None:
    """torch_dist: DCP's files, the common state and megatron-core's metadata.json (the marker)."""
    from megatron.core.dist_checkpointing.core import CheckpointingConfig

    def common_file(partial: str) -> None:
        common_bytes = io.BytesIO()
        torch.save(common, common_bytes)
        root.storage.write_bytes(os.path.join(partial, COMMON_FILE), common_bytes.getbuffer())
    config = dataclasses.asdict(CheckpointingConfig(sharded_backend="torch_dist"))
    publish_dcp(root, out, planner, "torch_dist", json.dumps(config).encode(), common_file)
