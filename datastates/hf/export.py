"""A datastates or torch_dist checkpoint -> a directory transformers' from_pretrained loads as it is.

Streamed: one megatron-core tensor (one layer, or one layer's expert, of a stacked one) is read, split into its
transformers tensors and written before the next is read, so host memory holds about twice the largest such
tensor plus the reader's staging budget (STAGING_BYTES, or 4 x the largest saved chunk when that is more), never
the model.
The directory is written under a temporary name and renamed when complete; a failure removes it.
"""
from __future__ import annotations

import contextlib
import logging
import os
import re
from dataclasses import dataclass

import torch

from datastates import Storage, storage_for

from . import HFError, saved_flag
from .arch import geometry_from_args, hf_config, rules_for
from .mapping import Rule, unit_indices
from .source import open_source
from .writer import OutputDirectory, Planned, ShardedWriter, copy_in, plan_shards, write_json

STAGING_BYTES = 32 << 20
DEFAULT_SHARD_BYTES = 2 << 30
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "vocab.txt", "chat_template.jinja")
MTP = "mtp."  # megatron-core's multi-token prediction block
# where megatron-core puts optimizer state: `optimizer.`, or `chained_<k>.optimizer.` for the ChainedOptimizer of a
# mixture of experts (a dense and an expert optimizer)
NOT_MODEL = re.compile(r"(chained_\d+\.)?optimizer\.")

log = logging.getLogger(__name__)


def is_model_tensor(name: str) -> bool:
    """Whether a saved global tensor is a model weight (not optimizer state, not a flattened range)."""
    return not NOT_MODEL.match(name) and not name.endswith("|flat")


def model_tensors(tensors: dict) -> set[str]:
    return {n for n in tensors if is_model_tensor(n)}


def _check_names(rules: list[Rule], present: set[str], where: str, arch: str) -> None:
    """Every model tensor is mapped and every mapping has its tensor: nothing dropped, nothing made up."""
    wanted = {r.megatron for r in rules}
    unknown, missing = sorted(present - wanted), sorted(wanted - present)
    if unknown:
        raise HFError(f"{where}: model tensors with no {arch} equivalent (refused rather than dropped): "
                      f"{', '.join(unknown)}")
    if missing:
        raise HFError(f"{where}: the {arch} mapping needs tensors this checkpoint lacks: {', '.join(missing)}")


def _exported(names: set[str], drop_mtp: bool) -> set[str]:
    """The model tensors to export: without the multi-token prediction layers (`mtp.`) for --drop-mtp."""
    if not drop_mtp:
        return names
    dropped = {n for n in names if n.startswith(MTP)}
    if dropped:
        log.info("--drop-mtp: leaving out the %d tensors of the multi-token prediction layers (under %r); the main "
                 "model's logits do not depend on them", len(dropped), MTP)
    return names - dropped


def _units(rules: list[Rule], geo):
    """(rule, unit index) in the order tensors are read and written."""
    for rule in rules:
        for index in unit_indices(rule, geo):
            yield rule, index


def _plan(rules: list[Rule], tensors: dict, geo) -> list[Planned]:
    """Each output tensor's name, shape and dtype, from the splits applied to shape-only (meta) tensors."""
    out = []
    for rule, index in _units(rules, geo):
        shape, dtype = tensors[rule.megatron]
        meta = torch.empty(shape[len(rule.at) + len(index):], dtype=dtype, device="meta")
        if rule.vocab:
            meta = meta[:geo.vocab]
        out += [Planned(n, tuple(p.shape), dtype) for n, p in zip(rule.names(index), rule.split(meta))]
    return out


def _tokenizer_files(directory: str) -> list[str]:
    return [os.path.join(directory, n) for n in TOKENIZER_FILES if os.path.isfile(os.path.join(directory, n))]


def _run_tokenizer(args) -> str | None:
    """The run's own transformers tokenizer directory (--tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR),
    when it is still there; None (said why, when there was one) otherwise."""
    directory = saved_flag(args, "tokenizer_model")
    if saved_flag(args, "tokenizer_type") != "HuggingFaceTokenizer" or not directory:
        return None
    if not os.path.isdir(directory) or not _tokenizer_files(directory):
        log.warning("the run's tokenizer (--tokenizer-model %s) is not a tokenizer directory here: exporting without "
                    "tokenizer files (name one with --tokenizer DIR)", directory)
        return None
    log.info("copying the run's tokenizer files from %s (--tokenizer-model)", directory)
    return directory


def _copy_tokenizer(storage: Storage, directory: str, tokenizer: str) -> None:
    found = _tokenizer_files(tokenizer)
    if not found:
        raise HFError(f"--tokenizer {tokenizer!r} holds none of the tokenizer files {', '.join(TOKENIZER_FILES)}")
    for path in found:
        copy_in(storage, directory, path)


@dataclass
class ExportPlan:
    """Everything an export writes, known before any tensor is read: the checkpoint's architecture, the mapping,
    every output tensor's name, shape and dtype, and the tokenizer to copy. Holds the open source (`close`)."""
    source: object
    geo: object
    rules: list
    planned: list
    dtype: torch.dtype
    tokenizer: str | None

    def shards(self, max_shard_bytes: int) -> list[list[Planned]]:
        return plan_shards(self.planned, max_shard_bytes)

    def units(self):
        """(rule, unit index) of every megatron-core unit, in the order they are read and written."""
        return _units(self.rules, self.geo)

    def close(self) -> None:
        self.source.close()


def plan_export(kind: str, path: str, *, tokenizer: str | None = None, init_distributed=None,
                drop_mtp: bool = False) -> ExportPlan:
    """Open the checkpoint at `path` (`kind`: its format) and plan its export; refusals (HFError) come here, before
    anything is written."""
    if tokenizer is not None and not os.path.isdir(tokenizer):
        raise HFError(f"--tokenizer {tokenizer!r} is not a directory")
    return plan_source(open_source(kind, path, STAGING_BYTES, init_distributed), tokenizer=tokenizer,
                       drop_mtp=drop_mtp)


def plan_source(source, *, tokenizer: str | None = None, drop_mtp: bool = False) -> ExportPlan:
    """Plan the export of an open source (its `tensors`, saved `args()`, `read` of units, `close`): a checkpoint
    read back (`open_source`), or the trainer's staged weights; closes it on a refusal."""
    try:
        tensors = source.tensors
        geo = geometry_from_args(source.args(), {n: s for n, (s, _) in tensors.items()}, source.path, drop_mtp)
        tokenizer = tokenizer if tokenizer is not None else _run_tokenizer(source.args())
        rules = [r.with_key(tensors) for r in rules_for(geo, tensors)]
        _check_names(rules, _exported(model_tensors(tensors), drop_mtp), source.path, geo.arch)
        dtype = tensors["embedding.word_embeddings.weight"][1]
        planned = _plan(rules, tensors, geo)
        padding = tensors["embedding.word_embeddings.weight"][0][0] - geo.vocab
        if padding:
            log.info("dropping the %d rows Megatron padded the vocabulary with (--vocab-size %d)", padding, geo.vocab)
        return ExportPlan(source, geo, rules, planned, dtype, tokenizer)
    except BaseException:
        source.close()
        raise


def write_metadata(plan: ExportPlan, storage: Storage, directory: str) -> None:
    """config.json and the tokenizer's files, into `directory` of `storage`."""
    write_json(storage, directory, "config.json", hf_config(plan.geo, str(plan.dtype).replace("torch.", "")))
    if plan.tokenizer is not None:
        _copy_tokenizer(storage, directory, plan.tokenizer)


def export(kind: str, path: str, output: str, *, tokenizer: str | None = None,
           max_shard_bytes: int = DEFAULT_SHARD_BYTES, init_distributed=None, drop_mtp: bool = False,
           progress: bool = True) -> str:
    """Write the transformers model directory `output` from the checkpoint at `path` (`kind`: its format);
    `drop_mtp` leaves the run's multi-token prediction layers out; `progress`: a progress bar on a terminal."""
    plan = plan_export(kind, path, tokenizer=tokenizer, init_distributed=init_distributed, drop_mtp=drop_mtp)
    storage = storage_for(output)
    try:
        with OutputDirectory(storage, output) as out:
            write_metadata(plan, storage, out.path)
            write_tensors(plan, storage, out.path, plan.shards(max_shard_bytes), progress=progress)
    finally:
        storage.close()
        plan.close()
    log.info("exported %s (%s, %s) to %s", plan.source.path, kind, plan.geo.arch, output)
    return out.final


def _progress_bar(total: int, shown: bool):
    if not shown:
        return contextlib.nullcontext(None)
    from tqdm import tqdm
    return tqdm(total=total, unit="B", unit_scale=True, desc="export", disable=None)


def write_tensors(plan: ExportPlan, storage: Storage, directory: str, shards: list[list[Planned]],
                  mine: set[int] | None = None, progress: bool = False, in_flight_bytes: int = 0) -> None:
    """The safetensors files of `shards` in `directory` of `storage` (only those numbered in `mine`, and then no
    index: each process of the trainer's export writes its share); a megatron-core unit is read only when one of
    its tensors is to be written. `in_flight_bytes`: `ShardedWriter`'s (more than 0 only for a source whose units
    stay valid after the next read)."""
    wanted = None if mine is None else {e.name for k in mine for e in shards[k]}
    total = sum(e.nbytes for k, shard in enumerate(shards) for e in shard if mine is None or k in mine)
    source, geo = plan.source, plan.geo
    with _progress_bar(total, progress) as bar:
        writer = ShardedWriter(storage, directory, shards, bar, mine, in_flight_bytes)
        try:
            for rule, index in _units(plan.rules, geo):
                names = rule.names(index)
                if wanted is not None and not wanted.intersection(names):
                    continue
                t = source.read(rule.megatron, rule.at + index)
                if rule.vocab:
                    t = t[:geo.vocab]
                for name, piece in zip(names, rule.split(t)):
                    if wanted is None or name in wanted:
                        writer.write(name, piece)
                del t
        except BaseException:
            writer.abort()
            raise
        writer.close()
