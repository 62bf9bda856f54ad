"""Tokenizers by upstream Megatron-LM's `--tokenizer-type` names, and the padded vocabulary size.

HuggingFaceTokenizer, the SentencePiece types and NullTokenizer are megatron-core's own tokenizer classes
(`megatron.core.tokenizers.MegatronTokenizer`). GPT2BPETokenizer is built here from `--vocab-file` and
`--merge-file` with the `tokenizers` library: megatron-core's GPT2BPETokenizer asks the model hub for a
"gpt2" tokenizer configuration and cannot run offline. `check_tokenizer_args` imports nothing heavy, so that
`validate_args` can refuse a bad combination before any work.
"""
from __future__ import annotations

import json
import os
from collections import OrderedDict

SENTENCEPIECE_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer")
TOKENIZER_TYPES = ("NullTokenizer", "GPT2BPETokenizer", "HuggingFaceTokenizer") + SENTENCEPIECE_TYPES
GPT2_EOD = "<|endoftext|>"


class TokenizerArgumentError(ValueError):
    """A tokenizer flag is missing, points at nothing, or does not apply to the chosen --tokenizer-type."""


def _require_path(args, flag: str, kind: str) -> None:
    value = getattr(args, flag.lstrip("-").replace("-", "_"))
    if value is None:
        raise TokenizerArgumentError(f"--tokenizer-type {args.tokenizer_type} needs {flag}")
    exists = os.path.isdir(value) if kind == "dir" else os.path.isfile(value) if kind == "file" else \
        os.path.exists(value)
    if not exists:
        raise TokenizerArgumentError(f"{flag} {value!r} does not exist")


def check_tokenizer_args(args) -> None:
    """Refuse a tokenizer configuration that cannot work, naming the flag (no file is read)."""
    kind = args.tokenizer_type
    needs = {"GPT2BPETokenizer": ("--vocab-file", "--merge-file"), "HuggingFaceTokenizer": ("--tokenizer-model",),
             "NullTokenizer": ()}.get(kind, ("--tokenizer-model",))
    for flag in needs:
        _require_path(args, flag, "any" if kind == "HuggingFaceTokenizer" else "file")
    for flag in ("--vocab-file", "--merge-file", "--tokenizer-model"):
        if flag not in needs and getattr(args, flag[2:].replace("-", "_")) is not None:
            raise TokenizerArgumentError(f"{flag} does not apply to --tokenizer-type {kind} (it reads "
                                         f"{', '.join(needs) or '--vocab-size'}); drop it")
    if kind == "NullTokenizer":
        if args.vocab_size is None:
            raise TokenizerArgumentError("--tokenizer-type NullTokenizer needs --vocab-size (pre-tokenized data)")
    elif args.vocab_size is not None:
        raise TokenizerArgumentError(f"--vocab-size does not apply to --tokenizer-type {kind}: the vocabulary is "
                                     "the tokenizer's; drop --vocab-size")


def padded_vocab_size(vocab_size: int, make_divisible_by: int, tensor_parallel_size: int) -> int:
    """Upstream's padding: the next multiple of --make-vocab-size-divisible-by x TP (embedding rows)."""
    multiple = make_divisible_by * tensor_parallel_size
    return -(-vocab_size // multiple) * multiple


class GPT2BPETokenizer:
    """GPT-2's byte-level BPE from a vocab.json and merges.txt: ids, vocabulary size (the JSON's entries) and
    end-of-document token (<|endoftext|>) as upstream's GPT2BPETokenizer has them."""

    def __init__(self, vocab_file: str, merge_file: str):
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers
        with open(vocab_file, encoding="utf-8") as f:
            vocab = json.load(f)
        if GPT2_EOD not in vocab:
            raise TokenizerArgumentError(f"--vocab-file {vocab_file!r} has no {GPT2_EOD} token")
        self._tok = Tokenizer(models.BPE.from_file(vocab_file, merge_file))
        self._tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        self._tok.decoder = decoders.ByteLevel()
        self.vocab_size = len(vocab)
        self.eod = vocab[GPT2_EOD]
        self.paths = (os.path.abspath(vocab_file), os.path.abspath(merge_file))

    def tokenize(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def detokenize(self, ids) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    @property
    def unique_identifiers(self) -> OrderedDict:
        """What megatron-core's data sets hash into their cache names."""
        return OrderedDict(cls=type(self).__name__, vocab_file=self.paths[0], merge_file=self.paths[1])


def _null_tokenizer(vocab_size: int):
    """megatron-core's NullTokenizer with --vocab-size ids, the last one the EOD: 0.17+'s rule (and current
    upstream's) under every supported megatron-core. 0.16's class adds the EOD after the ids it is given, so it is
    given one id fewer; the same checkpoint then has the same embedding under both."""
    from megatron.core.tokenizers import MegatronTokenizer
    from megatron.core.tokenizers.text import text_tokenizer
    if "null-text" in text_tokenizer.TOKENIZER_MAPPING_LIBRARIES:
        return MegatronTokenizer.from_pretrained(metadata_path={"library": "null-text"}, vocab_size=vocab_size)
    return MegatronTokenizer.from_pretrained(metadata_path={"library": "null"}, vocab_size=vocab_size - 1)


def build_tokenizer(args):
    """The tokenizer of --tokenizer-type: an object with tokenize(), detokenize(), vocab_size and eod."""
    from megatron.core.tokenizers import MegatronTokenizer
    check_tokenizer_args(args)
    kind = args.tokenizer_type
    if kind == "GPT2BPETokenizer":
        return GPT2BPETokenizer(args.vocab_file, args.merge_file)
    if kind == "NullTokenizer":
        return _null_tokenizer(args.vocab_size)
    if kind == "HuggingFaceTokenizer":
        return MegatronTokenizer.from_pretrained(tokenizer_path=args.tokenizer_model,
                                                 metadata_path={"library": "huggingface"})
    return MegatronTokenizer.from_pretrained(tokenizer_path=args.tokenizer_model,
                                             metadata_path={"library": "sentencepiece"})
