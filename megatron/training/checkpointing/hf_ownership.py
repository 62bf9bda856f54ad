"""--save-hf with data parallelism: each replicated model weight written, in the checkpoint, by the data-parallel
rank that is to write its Hugging Face file, so that a file is built from the weights its own rank kept.

Without this the save spreads the DP replicas' weights over the DP ranks by size alone (`ReplicaOwnership`), which
leaves most of a file's bytes on other ranks, to pass over gloo at every export (`hf_staged`). Here the export's own
plan over the model's pieces (gathered where the save's writers are chosen: at its first save; each piece once,
not each replica) gives the files, and each file a DP rank: where most of its bytes are that only one DP rank
holds (experts under EP), else in runs of consecutive files (a weight split over two consecutive files, as a
layer's fused projection often is, then lies on one rank), as many files a DP rank as round robin gives
(`balanced_owners`). Each replicated weight prefers the DP rank of the file most of its bytes go to; the export
then finds each file's bytes kept on one DP rank and writes it there (`Pieces.owners`). The save's balance holds:
a preference is honoured only within 5% of an even share of the bytes (`ReplicaOwnership.compute`).
"""
from __future__ import annotations

import collections
import logging

import torch

from datastates import Box, dtype_name
from datastates.megatron import shard_identity

from .hf_staged import Piece, Pieces, balanced_owners
from .state import saveable_args

log = logging.getLogger(__name__)


class _Shapes:
    """What the export's plan reads of its source: the tensors' global shapes and dtypes, and the run's flags."""
    path = "--save-hf"

    def __init__(self, tensors: dict, args):
        self.tensors, self._args = tensors, args

    def args(self):
        return self._args

    def close(self) -> None:
        pass


class FileAlignedWriters:
    """`ReplicaOwnership(prefer=)` under --save-hf: {identity of a local model weight: the rank of the DP `group`
    that writes the file most of its bytes go to}. Collective: on the DP group, then on the world."""

    def __init__(self, args, group):
        self.args, self.group = args, group

    def __call__(self, shards: list) -> dict:
        from megatron.core.dist_checkpointing import ShardedTensor
        from datastates.hf.export import MTP, is_model_tensor
        weights = [sh for sh in shards if isinstance(sh, ShardedTensor) and sh.flattened_range is None
                   and is_model_tensor(sh.key) and not sh.key.startswith(MTP)]
        me = torch.distributed.get_rank(self.group)
        local = [Piece(me, str(i), sh.key, dtype_name(sh.dtype),
                       Box(tuple(int(x) for x in sh.global_offset), (1,) * sh.prepend_axis_num + tuple(sh.local_shape)),
                       tuple(int(x) for x in sh.global_shape)) for i, sh in enumerate(weights)]
        # which DP ranks hold each piece (within the group: O(DP)), then each piece once on the world, from its
        # lowest holder, marked when one DP rank alone holds it: what every rank learns is the model's pieces,
        # not their replicas
        held: list = [None] * torch.distributed.get_world_size(self.group)
        torch.distributed.all_gather_object(held, [(p.name, p.box) for p in local], group=self.group)
        holders = collections.defaultdict(set)
        for rank, keys in enumerate(held):
            for key in keys:
                holders[key].add(rank)
        once = [(p, len(holders[(p.name, p.box)]) == 1) for p in local if min(holders[(p.name, p.box)]) == me]
        gathered: list = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(gathered, once)
        try:  # after the gathers, nothing collective: a failure leaves the save's balance alone, never fails it
            return self._preferences([x for ranks in gathered for x in ranks], local, weights)
        except Exception as e:  # noqa: BLE001 (the same on every rank; the export itself fails and says why)
            log.warning("--save-hf: the model's files cannot be planned at the first save (%s): replicated weights "
                        "are written where the bytes balance", e)
            return {}

    def _preferences(self, pieces: list, local: list, weights: list) -> dict:
        """`pieces`: (piece, whether one DP rank alone holds it) of the model, each once."""
        from datastates.hf.export import plan_source
        pieces = list({(p.name, p.box): (p, one) for p, one in pieces}.values())
        alone = Pieces([p for p, one in pieces if one])  # the experts under EP, by the DP rank that holds them
        mine, tensors = Pieces(local), Pieces([p for p, _ in pieces]).tensors
        plan = plan_source(_Shapes(tensors, saveable_args(self.args)), tokenizer="", drop_mtp=True)
        files = plan.shards(self.args.save_hf_max_shard_size)
        # each file's DP rank: where the bytes only one DP rank holds are, else in runs of consecutive files
        file_rank = balanced_owners(alone.held(plan, files), len(files), torch.distributed.get_world_size(self.group))
        toward = collections.defaultdict(collections.Counter)  # a local piece: {file: its bytes in the file}
        for (k, i), n in mine.held(plan, files, by=lambda piece: piece.id).items():
            toward[i][k] = n
        return {shard_identity(weights[int(i)]): file_rank[max(c, key=lambda k: (c[k], -k))]
                for i, c in toward.items()}
