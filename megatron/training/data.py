"""Training data: megatron-core's `GPTDataset`s (blended by `BlendedMegatronDatasetBuilder`), or its `MockGPTDataset`.

Both are random-access by global sample index and deterministic in their configuration, so the sample order is
a pure function of (flags, sample index) and resuming at the checkpoint's `consumed_samples` continues from the
exact next sample, blends included. The batch order is Megatron's MegatronPretrainingSampler: the micro-batch
read after `consumed` samples on DP rank r holds samples consumed + r * mbs + [0, mbs); the next one starts
mbs * dp samples later. A ramped batch size only changes how many micro-batches an iteration takes.
"""
from __future__ import annotations

import functools
import os

import torch

# ----- megatron-core's data sets -----

def _blend(paths):
    from megatron.core.datasets.utils import get_blend_from_list
    return get_blend_from_list(paths) if paths else None


def blends(args):
    """(blend, blend_per_split) of megatron-core's config from --data-path or --{train,valid,test}-data-path."""
    if args.data_path:
        return _blend(args.data_path), None
    per_split = [_blend(p) for p in (args.train_data_path, args.valid_data_path, args.test_data_path)]
    return None, per_split if any(per_split) else None


def check_data_paths(args) -> None:
    """Every prefix of every blend has its .bin and .idx, and every weight is positive (named when not)."""
    blend, per_split = blends(args)
    named = [("--data-path", blend)] + [(f"--{s}-data-path", b) for s, b in
                                        zip(("train", "valid", "test"), per_split or []) if b]
    for flag, (prefixes, weights) in [(f, b) for f, b in named if b]:
        for prefix in prefixes:
            for ext in (".bin", ".idx"):
                if not os.path.isfile(prefix + ext):
                    hint = (" (a blend is WEIGHT PREFIX pairs: every weight a number)"
                            if len(prefixes) > 1 and weights is None else "")
                    raise ValueError(f"{flag}: {prefix + ext} does not exist{hint}")
        if weights is not None and any(w <= 0 for w in weights):
            raise ValueError(f"{flag}: weights must be positive, got {weights}")
        _check_splits(flag, prefixes, args.split if flag == "--data-path" else "1,0,0")


def _check_splits(flag: str, prefixes: list[str], split: str) -> None:
    """Every split --split asks for holds a document of every data set: megatron-core loops forever on an
    empty one (its epochs never reach the samples asked for)."""
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix, parse_and_normalize_split)
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    try:
        bounds = convert_split_vector_to_split_matrix(parse_and_normalize_split(split))
    except (AssertionError, ValueError) as e:
        raise ValueError(f"--split {split!r} is not three proportions like '969, 30, 1' ({e})") from None
    for prefix in prefixes:
        n = len(IndexedDataset(prefix))
        for name, bound in zip(("train", "validation", "test"), bounds):
            if bound is not None and round(bound[1] * n) <= round(bound[0] * n):
                raise ValueError(f"{flag}: --split {split!r} leaves the {name} split of {prefix} empty (the share "
                                 f"{bound[0]:g}-{bound[1]:g} of its {n} documents); give that split 0 or a larger "
                                 "share")


def gpt_dataset_config(args, tokenizer):
    """megatron-core's GPTDatasetConfig from the flags, as upstream's pretrain_gpt.py builds it."""
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig
    blend, per_split = blends(args)
    return GPTDatasetConfig(
        random_seed=args.seed, sequence_length=args.seq_length, blend=blend, blend_per_split=per_split,
        split=args.split if per_split is None else None, path_to_cache=args.data_cache_path,
        num_dataset_builder_threads=args.num_dataset_builder_threads, mmap_bin_files=args.mmap_bin_files,
        tokenizer=tokenizer, reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask, eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.reset_attention_mask)


def split_sizes(args) -> list[int]:
    """Samples wanted from the train, validation and test splits, counted as upstream: every periodic evaluation
    and the one at the end read --eval-iters global batches of validation data, the test set one evaluation."""
    evaluation = args.eval_iters * args.global_batch_size
    evaluations = args.train_iters // args.eval_interval + 1 if args.eval_iters else 0
    return [args.train_samples or args.train_iters * args.global_batch_size, evaluations * evaluation, evaluation]


def build_datasets(args, tokenizer):
    """(train, valid, test): megatron-core's GPTDatasets (or blends of them) with --data-path and its kin, else
    its MockGPTDataset (--mock-data: documents of counting tokens, as upstream's). Every rank builds them (rank 0
    first, writing the index cache); each reads its own micro-batches."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, MockGPTDataset
    return tuple(BlendedMegatronDatasetBuilder(MockGPTDataset if args.mock_data else GPTDataset, split_sizes(args),
                                               lambda: True, gpt_dataset_config(args, tokenizer)).build())


def build_train_valid_test_datasets(args, tokenizer=None):
    """(train, valid, test) of the flags, with the tokenizer of the flags unless given: the default provider of
    `pretrain`."""
    if tokenizer is None:
        from .global_vars import get_tokenizer
        tokenizer = get_tokenizer()
    return build_datasets(args, tokenizer)


# ----- batches -----

class RankSampler(torch.utils.data.Sampler):
    """This DP rank's micro-batches of sample indices from `consumed` on (MegatronPretrainingSampler's order)."""

    def __init__(self, total: int | None, consumed: int, micro_batch_size: int, dp_rank: int, dp_size: int):
        self.total, self.consumed = total, consumed
        self.mbs, self.dp_rank, self.dp_size = micro_batch_size, dp_rank, dp_size

    def __iter__(self):
        first = self.consumed
        while self.total is None or first + self.mbs * self.dp_size <= self.total:
            yield list(range(first + self.dp_rank * self.mbs, first + (self.dp_rank + 1) * self.mbs))
            first += self.mbs * self.dp_size


def collate(samples: list[dict], causal_mask: bool = True) -> dict:
    """Stack the samples; their own attention masks (--reset-attention-mask), else one causal mask shared by
    every sample (True = masked), or none (--no-create-attention-mask-in-dataloader: the model's attention
    masks causally by itself)."""
    keys = ("tokens", "labels", "loss_mask", "position_ids") + (("attention_mask",) if "attention_mask" in samples[0]
                                                                 else ())
    batch = {k: torch.stack([torch.as_tensor(s[k]) for s in samples]) for k in keys}
    if "attention_mask" not in batch and causal_mask:
        s = batch["tokens"].shape[1]
        batch["attention_mask"] = torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool), diagonal=1)
    return batch


class MicroBatches:
    """Iterator of this DP rank's micro-batches from `consumed` samples on, on `device`; a token outside the
    tokenizer's vocabulary (data preprocessed with another tokenizer) stops the run naming it."""

    def __init__(self, dataset, consumed: int, micro_batch_size: int, dp_rank: int, dp_size: int, *,
                 vocab_size: int, num_workers: int = 0, device="cpu", what: str = "training data",
                 causal_mask: bool = True):
        total = len(dataset) if hasattr(dataset, "__len__") else None
        sampler = RankSampler(total, consumed, micro_batch_size, dp_rank, dp_size)
        # its own generator: a loader seeds its workers from the global torch RNG otherwise, and a draw from it
        # here (after a resume restored it, but before training in a straight run) would shift the dropout masks
        self.loader = iter(torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=num_workers,
                                                       collate_fn=functools.partial(collate, causal_mask=causal_mask),
                                                       persistent_workers=num_workers > 0,
                                                       generator=torch.Generator().manual_seed(0)))
        self.vocab_size, self.device, self.what = vocab_size, device, what

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        try:
            batch = next(self.loader)
        except StopIteration:
            raise RuntimeError(f"the {self.what} ran out: the data set was built for fewer samples than the run "
                               "consumes (check --train-samples against --rampup-batch-size)") from None
        top = int(batch["tokens"].max())
        if top >= self.vocab_size:
            raise ValueError(f"token id {top} in the data is outside the tokenizer's vocabulary of "
                             f"{self.vocab_size}: was the data preprocessed with another tokenizer?")
        return {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}
