"""A resume continues at exactly the next sample on a real blended corpus, and a batch-size ramp resumes
exactly (2 ranks, torchrun, tiny tokenizers and corpora built here)."""
import glob
import json
import math
import re

import numpy as np
import pytest

from corpus import documents, gpt2_bpe, hf_dir, preprocess, write_jsonl
from megatron_helpers import torchrun

MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--micro-batch-size", "2", "--lr", "1e-3", "--seed", "1234", "--async-ckpt", "--no-ckpt-fsync"]
LINE_RE = re.compile(r"iteration\s+(\d+)/\s*\d+ \| consumed samples:\s+(\d+) \|.*learning rate: (\S+) \| "
                     r"global batch size:\s+(\d+) \| lm loss: (\S+) \|")
DOCS = {"a": 40, "b": 60}


def iterations(log: str) -> dict[int, tuple]:
    """iteration -> (consumed samples, learning rate, global batch size, loss), as printed (compared exactly)."""
    return {int(m.group(1)): m.groups()[1:] for m in LINE_RE.finditer(log)}


def corpus(tmp_path, tokenizer_flags) -> list[str]:
    """Two indexed data sets of different documents, preprocessed with the tokenizer; their prefixes."""
    prefixes = []
    for seed, (name, n) in enumerate(DOCS.items()):
        jsonl = write_jsonl(str(tmp_path / f"{name}.jsonl"), documents(n, seed=10 + seed))
        r = preprocess(jsonl, str(tmp_path / "data" / name), tokenizer_flags, "--append-eod")
        assert r.returncode == 0, r.stderr[-3000:]
        prefixes.append(str(tmp_path / "data" / f"{name}_text_document"))
    return prefixes


def straight_and_resumed(tmp_path, flags, stop: int) -> tuple[dict, dict, dict]:
    """(a straight run, the run stopped at `stop`, its resume), each as iterations()."""
    _, straight = torchrun(2, flags)
    ck = str(tmp_path / "ck")
    _, first = torchrun(2, flags + ["--save", ck, "--save-interval", str(stop), "--exit-interval", str(stop)])
    _, resumed = torchrun(2, flags + ["--save", ck, "--load", ck, "--save-interval", "100"])
    assert f"successfully loaded checkpoint from {ck} (datastates) at iteration {stop}" in resumed
    return iterations(straight), iterations(first), iterations(resumed)


def embedding_rows(ckpt_dir: str) -> set[int]:
    """The rows of the word embedding saved in a checkpoint (the weights and their optimizer states)."""
    from datastates import CheckpointEngine
    with CheckpointEngine(rank=0, world_size=1) as engine:
        index = engine.reader(ckpt_dir).global_index()
    return {shards[0].global_shape[0] for name, shards in index.items() if "word_embeddings.weight" in name}


def test_blended_corpus_resumes_at_the_next_sample(tmp_path):
    vocab, merges = gpt2_bpe(str(tmp_path / "bpe"))
    tok = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab, "--merge-file", merges]
    a, b = corpus(tmp_path, tok)
    cache = str(tmp_path / "cache")
    flags = MODEL + tok + ["--global-batch-size", "8", "--train-iters", "8", "--data-path", "0.3", a, "0.7", b,
                           "--split", "50,25,25", "--data-cache-path", cache]
    straight, first, resumed = straight_and_resumed(tmp_path, flags, 4)
    assert sorted(straight) == list(range(1, 9)) and sorted(first) == [1, 2, 3, 4] and sorted(resumed) == [5, 6, 7, 8]
    assert {i: straight[i] for i in first} == first
    assert {i: straight[i] for i in resumed} == resumed  # bit-for-bit: losses printed as repr of the float
    # the embedding has upstream's padded vocabulary: the BPE's entries rounded up to a multiple of 128 (TP1)
    rows = math.ceil(len(json.load(open(vocab))) / 128) * 128
    assert embedding_rows(str(tmp_path / "ck" / "iter_0000008")) == {rows}
    # --data-cache-path holds megatron-core's indices; --split: each data set's training documents are its first half
    for desc in glob.glob(f"{cache}/*-GPTDataset-train-description.txt"):
        path = json.load(open(desc))["dataset_path"]
        docs = np.load(desc.replace("description.txt", "document_index.npy"))
        assert set(docs.tolist()) == set(range(DOCS[path.split("/")[-1][0]] // 2)), path
    # the blend's weights: 30% of the 64 training samples come from the first data set
    (blend,) = glob.glob(f"{cache}/*-BlendedDataset-train-dataset_index.npy")
    assert abs(int((np.load(blend) == 0).sum()) - 0.3 * 64) <= 1


@pytest.mark.parametrize("workers", ["1"])
def test_batch_size_ramp_resumes_exactly(tmp_path, workers):
    tok = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", hf_dir(str(tmp_path / "hf"))]
    a, _ = corpus(tmp_path, tok)
    # 100 samples, batch 4 -> 16 in steps of 4 over 48 samples, LR warmup and decay in samples
    flags = MODEL + tok + ["--global-batch-size", "16", "--train-samples", "100", "--rampup-batch-size", "4", "4",
                           "48", "--lr-warmup-fraction", "0.1", "--lr-decay-samples", "90", "--data-path", a, "--split", "95,5,0",
                           "--num-workers", workers]
    straight, first, resumed = straight_and_resumed(tmp_path, flags, 5)
    batch = [int(straight[i][2]) for i in sorted(straight)]
    assert sorted(set(batch)) == [4, 8, 12, 16] and batch[3] != batch[4]  # the resume starts where the batch grows
    assert sorted(resumed) == list(range(6, len(straight) + 1))
    assert {i: straight[i] for i in first} == first
    assert {i: straight[i] for i in resumed} == resumed
