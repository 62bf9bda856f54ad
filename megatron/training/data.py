"""Training data: a deterministic synthetic token stream, or megatron-core's indexed data sets.

Both are random-access by global sample index, so the data order is a pure function of (seed, sample index)
and resuming at `consumed_samples` continues from the exact next sample. The batch layout is Megatron's
(MegatronPretrainingSampler): iteration with `consumed` samples so far reads samples
consumed + m * (mbs * dp) + dp_rank * mbs + [0, mbs) for micro-batch m.
"""
from __future__ import annotations

import numpy as np
import torch


class SyntheticTokens:
    """Sample i: an arithmetic progression modulo the vocabulary, start and stride drawn from (seed, i).

    Learnable (the loss goes down visibly within tens of iterations) and deterministic without any state.
    """

    def __init__(self, seq_length: int, vocab_size: int, seed: int):
        self.seq_length = seq_length
        self.vocab_size = vocab_size
        self.seed = seed

    def __getitem__(self, idx: int) -> torch.Tensor:
        g = torch.Generator().manual_seed((self.seed * 1_000_003 + int(idx)) % (2 ** 63))
        start = int(torch.randint(0, self.vocab_size, (1,), generator=g))
        stride = int(torch.randint(1, 8, (1,), generator=g))
        return (start + stride * torch.arange(self.seq_length + 1, dtype=torch.int64)) % self.vocab_size


class IndexedTokens:
    """Fixed-length windows of seq_length+1 tokens over the concatenated documents of megatron indexed data sets.

    Windows are visited in a seeded permutation per epoch. Reads go through megatron-core's `IndexedDataset`.
    """

    def __init__(self, prefixes: list[str], seq_length: int, vocab_size: int, seed: int):
        from megatron.core.datasets.indexed_dataset import IndexedDataset
        self.datasets = [IndexedDataset(p) for p in prefixes]
        self.seq_length = seq_length
        self.vocab_size = vocab_size
        self.seed = seed
        lengths = np.concatenate([np.asarray(d.sequence_lengths, dtype=np.int64) for d in self.datasets])
        self.owner = np.concatenate([np.full(len(d.sequence_lengths), i) for i, d in enumerate(self.datasets)])
        self.local = np.concatenate([np.arange(len(d.sequence_lengths)) for d in self.datasets])
        self.starts = np.concatenate([[0], np.cumsum(lengths)])
        self.total = int(self.starts[-1])
        self.num_windows = (self.total - 1) // seq_length
        if self.num_windows < 1:
            raise ValueError(f"data set {prefixes} holds {self.total} tokens: fewer than one sequence of "
                             f"{seq_length + 1}")
        self._perm_epoch = -1
        self._perm = None

    def _tokens(self, begin: int, end: int) -> np.ndarray:
        out = []
        seq = int(np.searchsorted(self.starts, begin, side="right") - 1)
        while begin < end:
            seq_end = int(self.starts[seq + 1])
            take = min(end, seq_end) - begin
            if take > 0:
                ds = self.datasets[int(self.owner[seq])]
                out.append(np.asarray(ds.get(int(self.local[seq]), offset=begin - int(self.starts[seq]),
                                             length=take), dtype=np.int64))
            begin += max(take, 0)
            seq += 1
        return np.concatenate(out)

    def __getitem__(self, idx: int) -> torch.Tensor:
        epoch, i = divmod(int(idx), self.num_windows)
        if epoch != self._perm_epoch:
            g = torch.Generator().manual_seed(self.seed + epoch)
            self._perm = torch.randperm(self.num_windows, generator=g)
            self._perm_epoch = epoch
        w = int(self._perm[i])
        toks = torch.from_numpy(self._tokens(w * self.seq_length, w * self.seq_length + self.seq_length + 1))
        if int(toks.max()) >= self.vocab_size:
            raise ValueError(f"token id {int(toks.max())} >= --vocab-size {self.vocab_size}")
        return toks


def build_dataset(args):
    if args.data_path:
        return IndexedTokens(args.data_path, args.seq_length, args.vocab_size, args.seed)
    return SyntheticTokens(args.seq_length, args.vocab_size, args.seed)


class MicroBatches:
    """The micro-batches of this DP rank for one iteration, given the samples consumed before it."""

    def __init__(self, dataset, micro_batch_size: int, dp_rank: int, dp_size: int, device="cpu"):
        self.dataset = dataset
        self.mbs = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.device = device
        self._mask_cache = {}

    def get(self, consumed: int, micro: int) -> dict:
        first = consumed + micro * self.mbs * self.dp_size + self.dp_rank * self.mbs
        seqs = torch.stack([self.dataset[first + j] for j in range(self.mbs)])
        tokens = seqs[:, :-1].contiguous()
        labels = seqs[:, 1:].contiguous()
        s = tokens.shape[1]
        if s not in self._mask_cache:
            self._mask_cache[s] = (torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool), diagonal=1),
                                   torch.arange(s, dtype=torch.int64).unsqueeze(0))
        mask, pos = self._mask_cache[s]
        batch = {"tokens": tokens, "labels": labels, "loss_mask": torch.ones(tokens.shape, dtype=torch.float32),
                 "attention_mask": mask, "position_ids": pos.expand(self.mbs, -1)}
        return {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}
