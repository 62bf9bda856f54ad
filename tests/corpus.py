"""Tiny tokenizers and corpora built in the test (nothing fetched from a model hub).

- `gpt2_bpe(dir)`: a byte-level BPE trained with the `tokenizers` library, saved as GPT-2's vocab.json + merges.txt
- `hf_dir(dir)`: the same kind of tokenizer saved by transformers' `save_pretrained` (a --tokenizer-model dir)
- `sentencepiece_model(dir)`: a SentencePiece model trained by the sentencepiece library
- `write_jsonl(path, docs)`, `preprocess(...)`: JSON lines and `tools/preprocess_data.py` run on them
"""
from __future__ import annotations

import json
import os

from rank_launcher import run_python

WORDS = ("the checkpoint is written lazily while the next forward and backward pass runs on every rank "
         "tensor parallel pipeline data parallel optimizer state snapshot durable storage memory tier restart "
         "resume exactly bit for bit loss goes down learning rate warmup decay batch size ramp").split()


def documents(n: int, seed: int, min_words: int = 8, max_words: int = 60) -> list[str]:
    """n pseudo-random English-like documents, deterministic in seed."""
    import random
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(min_words, max_words))) for _ in range(n)]


def _train_bpe(vocab_size: int = 300):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(documents(200, seed=0), trainer)
    return tok


def gpt2_bpe(directory: str, vocab_size: int = 300) -> tuple[str, str]:
    """(vocab.json, merges.txt) of a tiny byte-level BPE, in GPT-2's file layout."""
    os.makedirs(directory, exist_ok=True)
    _train_bpe(vocab_size).model.save(directory)
    return os.path.join(directory, "vocab.json"), os.path.join(directory, "merges.txt")


def hf_dir(directory: str, vocab_size: int = 300) -> str:
    """A local HuggingFace tokenizer directory (tokenizer.json + configs) written by transformers."""
    from transformers import PreTrainedTokenizerFast
    fast = PreTrainedTokenizerFast(tokenizer_object=_train_bpe(vocab_size), eos_token="<|endoftext|>",
                                   bos_token="<|endoftext|>", unk_token="<|endoftext|>")
    fast.save_pretrained(directory)
    return directory


def sentencepiece_model(directory: str, vocab_size: int = 200) -> str:
    import sentencepiece as spm
    os.makedirs(directory, exist_ok=True)
    text = os.path.join(directory, "train.txt")
    with open(text, "w") as f:
        f.write("\n".join(documents(300, seed=1)))
    prefix = os.path.join(directory, "sp")
    spm.SentencePieceTrainer.train(input=text, model_prefix=prefix, vocab_size=vocab_size, model_type="bpe",
                                   bos_id=1, eos_id=2, unk_id=0, pad_id=-1, minloglevel=2)
    return prefix + ".model"


def write_jsonl(path: str, docs: list[str], key: str = "text") -> str:
    with open(path, "w") as f:
        for i, d in enumerate(docs):
            f.write(json.dumps({key: d, "id": i}) + "\n")
    return path


def preprocess(jsonl: str, prefix: str, tokenizer_flags: list[str], *extra: str) -> tuple[int, str]:
    """tools/preprocess_data.py on `jsonl`: (exit code, output)."""
    return run_python("tools/preprocess_data.py", "--input", jsonl, "--output-prefix", prefix, *tokenizer_flags,
                      *extra, timeout=120)
