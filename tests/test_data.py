"""Tokenizers, tools/preprocess_data.py, the data and schedule flags (in-process; tiny tokenizers built here)."""
import glob
import json
import os
import types

import pytest

from corpus import documents, gpt2_bpe, hf_dir, preprocess, sentencepiece_model, write_jsonl
from megatron.training.arguments import ArgumentError, parse_args
from megatron.training.argument_checks import validate_args

TEXT = "the checkpoint is written lazily while the next forward pass runs"
BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--micro-batch-size", "2", "--lr", "1e-3"]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """--tokenizer-type name -> its flags, for a tiny tokenizer of each kind."""
    d = tmp_path_factory.mktemp("tok")
    vocab, merges = gpt2_bpe(str(d / "bpe"))
    sp = sentencepiece_model(str(d / "sp"))
    return {"GPT2BPETokenizer": ["--vocab-file", vocab, "--merge-file", merges],
            "HuggingFaceTokenizer": ["--tokenizer-model", hf_dir(str(d / "hf"))],
            "SentencePieceTokenizer": ["--tokenizer-model", sp], "Llama2Tokenizer": ["--tokenizer-model", sp],
            "NullTokenizer": ["--vocab-size", "1000"]}


def build(kind, flags):
    from megatron.training.tokenizer import build_tokenizer
    ns = types.SimpleNamespace(tokenizer_type=kind, vocab_file=None, merge_file=None, tokenizer_model=None,
                               vocab_size=None)
    for flag, value in zip(flags[::2], flags[1::2]):
        setattr(ns, flag[2:].replace("-", "_"), int(value) if flag == "--vocab-size" else value)
    return build_tokenizer(ns)


def reference(kind, flags):
    """The same files read by their own library: (ids of TEXT, vocabulary size, end-of-document id)."""
    path = flags[1]
    if kind == "GPT2BPETokenizer":
        from transformers import GPT2Tokenizer
        ref = GPT2Tokenizer(flags[1], flags[3])
        return ref(TEXT)["input_ids"], len(json.load(open(flags[1]))), ref.convert_tokens_to_ids("<|endoftext|>")
    if kind == "HuggingFaceTokenizer":
        from transformers import AutoTokenizer
        ref = AutoTokenizer.from_pretrained(path)
        return ref(TEXT, add_special_tokens=False)["input_ids"], len(ref), ref.eos_token_id
    import sentencepiece
    ref = sentencepiece.SentencePieceProcessor(model_file=path)
    return ref.encode(TEXT), ref.get_piece_size(), ref.eos_id()


@pytest.mark.parametrize("kind", ["GPT2BPETokenizer", "HuggingFaceTokenizer", "SentencePieceTokenizer",
                                  "Llama2Tokenizer"])
def test_tokenizer_matches_its_library(tokenizers, kind):
    tok = build(kind, tokenizers[kind])
    ids, vocab, eod = reference(kind, tokenizers[kind])
    assert len(ids) > 5 and tok.tokenize(TEXT) == ids
    assert (tok.vocab_size, tok.eod) == (vocab, eod)
    assert tok.detokenize(ids).strip() == TEXT


def test_null_tokenizer_is_megatron_cores():
    """--vocab-size ids, the last the EOD, whatever the megatron-core version: a checkpoint keeps its shape."""
    tok = build("NullTokenizer", ["--vocab-size", "1000"])
    assert type(tok).__module__.startswith("megatron.core.tokenizers")
    assert (tok.vocab_size, tok.eod, tok.tokenize("5 7 11")) == (1000, 999, [5, 7, 11])


def test_padded_vocab_is_upstreams():
    from megatron.training.tokenizer import padded_vocab_size
    # upstream: the next multiple of --make-vocab-size-divisible-by x TP (GPT-2's 50257 -> 50304 at TP1)
    assert [padded_vocab_size(50257, 128, tp) for tp in (1, 2, 8)] == [50304, 50432, 51200]
    assert padded_vocab_size(256, 128, 2) == 256


@pytest.mark.parametrize("kind", ["GPT2BPETokenizer", "HuggingFaceTokenizer", "SentencePieceTokenizer"])
def test_preprocess_writes_what_the_tokenizer_says(tokenizers, tmp_path, kind):
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    docs = documents(40, seed=2)
    jsonl = write_jsonl(str(tmp_path / "in.jsonl"), docs)
    with open(jsonl) as f:  # a second key, its own data set
        lines = [dict(json.loads(line), title=f"doc {i}") for i, line in enumerate(f)]
    with open(jsonl, "w") as f:
        f.writelines(json.dumps(x) + "\n" for x in lines)
    rc, out = preprocess(jsonl, str(tmp_path / "out" / "c"), ["--tokenizer-type", kind, *tokenizers[kind]],
                   "--json-keys", "text", "title", "--append-eod", "--workers", "2")
    assert rc == 0, out[-3000:]
    tok = build(kind, tokenizers[kind])
    for key, texts in (("text", docs), ("title", [x["title"] for x in lines])):
        ds = IndexedDataset(str(tmp_path / "out" / f"c_{key}_document"))
        assert len(ds) == len(texts)
        for i, text in enumerate(texts):
            assert ds[i].tolist() == tok.tokenize(text) + [tok.eod]
    assert not glob.glob(str(tmp_path / "out" / "*.tmp"))


def test_preprocess_bad_line_leaves_nothing(tokenizers, tmp_path):
    jsonl = write_jsonl(str(tmp_path / "in.jsonl"), documents(100, seed=3))
    with open(jsonl, "a") as f:
        f.write('{"text": "fine"}\n{"title": "no text"}\n')
    rc, out = preprocess(jsonl, str(tmp_path / "out" / "c"), ["--tokenizer-type", "GPT2BPETokenizer",
                                                        *tokenizers["GPT2BPETokenizer"]], "--workers", "2")
    assert rc != 0 and f"{jsonl}:102: no text under the key 'text'" in out
    assert os.listdir(tmp_path / "out") == []
    rc, out = preprocess(jsonl, str(tmp_path / "out" / "c"), ["--tokenizer-type", "GPT2BPETokenizer"])
    assert rc == 2 and "needs --vocab-file" in out


def args_of(extra, world=2):
    return validate_args(parse_args(argv=BASE + extra), world, cuda=False)


@pytest.mark.parametrize("extra, message", [
    (["--train-iters", "4", "--train-samples", "64"], "exactly one of --train-iters"),
    (["--lr"], "exactly one of --train-iters"),
    (["--train-iters", "4", "--rampup-batch-size", "4", "4", "32"], "--rampup-batch-size counts samples"),
    (["--train-iters", "4", "--lr-decay-samples", "10"], "--lr-decay-samples counts samples: .*--lr-decay-iters"),
    (["--train-samples", "64", "--lr-warmup-iters", "1"], "--lr-warmup-iters counts iterations"),
    (["--train-iters", "4", "--lr-warmup-iters", "1", "--lr-warmup-fraction", "0.1"], "give one"),
    (["--train-samples", "64", "--lr-warmup-samples", "64"], "warmup .* must be shorter"),
    (["--train-samples", "64", "--global-batch-size", "16", "--rampup-batch-size", "4", "4"], "three integers"),
    (["--train-samples", "64", "--global-batch-size", "16", "--rampup-batch-size", "2", "2", "32"],
     "multiples of micro-batch-size x data-parallel size = 4"),
    (["--train-samples", "64", "--global-batch-size", "16", "--rampup-batch-size", "4", "8", "32"],
     "a multiple of INCREMENT"),
    (["--train-iters", "4", "--tokenizer-type", "GPT2BPETokenizer"], "needs --vocab-file"),
    (["--train-iters", "4", "--tokenizer-type", "NullTokenizer", "--vocab-file", "x"], "--vocab-file does not apply"),
    (["--train-iters", "4", "--tokenizer-model", "/nonexistent", "--tokenizer-type", "HuggingFaceTokenizer"],
     "'/nonexistent' does not exist"),
    (["--train-iters", "4", "--valid-data-path", "x"], "need --train-data-path"),
    (["--train-iters", "4", "--data-path", "x", "--train-data-path", "y"], "exclusive"),
])
def test_refused_before_any_work(extra, message):
    with pytest.raises(ArgumentError, match=message):
        args_of(extra if extra != ["--lr"] else [])


def test_vocab_size_refused_with_a_real_tokenizer(tokenizers):
    with pytest.raises(ArgumentError, match="--vocab-size does not apply to --tokenizer-type GPT2BPETokenizer"):
        args_of(["--train-iters", "4", "--tokenizer-type", "GPT2BPETokenizer", *tokenizers["GPT2BPETokenizer"],
                 "--vocab-size", "300", "--mock-data"])


def test_weighted_data_path_is_a_blend(tmp_path, tokenizers):
    """`--data-path 0.3 a 0.7 b` is a blend of a and b (once refused as "0.3.bin does not exist"); a missing
    prefix is named, and --split defaults to upstream's."""
    from megatron.training.data import blends, build_datasets, check_data_paths
    prefixes = []
    for name in ("a", "b"):
        rc, out = preprocess(write_jsonl(str(tmp_path / f"{name}.jsonl"), documents(10, seed=4)), str(tmp_path / name),
                       ["--tokenizer-type", "GPT2BPETokenizer", *tokenizers["GPT2BPETokenizer"]])
        assert rc == 0, out[-2000:]
        prefixes.append(str(tmp_path / f"{name}_text_document"))
    args = args_of(["--train-iters", "4", "--data-path", "0.3", prefixes[0], "0.7", prefixes[1],
                    "--tokenizer-type", "GPT2BPETokenizer", *tokenizers["GPT2BPETokenizer"]])
    assert blends(args) == ((prefixes, [0.3, 0.7]), None) and args.split == "969, 30, 1"
    # upstream's split gives 10 documents no validation document: megatron-core would loop forever building it
    with pytest.raises(ValueError, match=f"leaves the validation split of {prefixes[0]} empty"):
        check_data_paths(args)
    args.split = "8,2,0"
    check_data_paths(args)
    train, valid, test = build_datasets(args, build("GPT2BPETokenizer", tokenizers["GPT2BPETokenizer"]))
    assert (type(train).__name__, valid is not None, test) == ("BlendedDataset", True, None)
    assert len(train) >= 4 * 4  # --train-iters x the global batch (mbs 2 x DP 2)
    assert [d.dataset.path_prefix for d in train.datasets] == prefixes
    args.data_path[3] = str(tmp_path / "c")
    with pytest.raises(ValueError, match=f"--data-path: {tmp_path / 'c'}.bin does not exist"):
        check_data_paths(args)
    # each split its own data set: a trains, b validates, no test split
    args = args_of(["--train-iters", "4", "--train-data-path", prefixes[0], "--valid-data-path", prefixes[1],
                    "--tokenizer-type", "GPT2BPETokenizer", *tokenizers["GPT2BPETokenizer"]])
    check_data_paths(args)
    train, valid, test = build_datasets(args, build("GPT2BPETokenizer", tokenizers["GPT2BPETokenizer"]))
    assert (train.dataset.path_prefix, valid.dataset.path_prefix, test) == (prefixes[0], prefixes[1], None)


def test_rampup_as_step_schedule_equals_megatron_core_016_ramp():
    """megatron-core 0.17+ ignore rampup_batch_size; the step schedule given to them instead yields 0.16's ramp
    (its own calculator is the reference) at every number of consumed samples."""
    import random
    from megatron.core import num_microbatches_calculator as nmc
    from megatron.training.schedules import rampup_as_steps
    ramp_cls = getattr(nmc, "RampupBatchsizeNumMicroBatchesCalculator", None)
    if ramp_cls is None:
        pytest.skip("this megatron-core has no rampup calculator to compare with")
    for trial in range(100):
        r = random.Random(trial)
        unit = r.choice([1, 2, 4, 8])
        start, inc, n, ramp = unit * r.randint(1, 5), unit * r.randint(1, 4), r.randint(1, 9), r.randint(1, 500)
        schedule = [tuple(map(int, e.split(":"))) for e in rampup_as_steps(start, inc, ramp, start + n * inc).split()]
        calc = ramp_cls(start + n * inc, unit, 1, False, 1, start, inc, ramp)
        for consumed in range(ramp + 20):
            calc.update(consumed, False)
            assert [b for t, b in schedule if consumed >= t][-1] == calc.current_global_batch_size
