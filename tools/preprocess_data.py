"""JSON-lines text -> megatron indexed data sets (`.bin`/`.idx`), for `pretrain_gpt.py --data-path`.

    python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \\
        --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt --append-eod --workers 4

Each line is a JSON object; every key of --json-keys (default: text) becomes its own data set,
`<output-prefix>_<key>_document.bin/.idx`, one document per line, written with megatron-core's
`IndexedDatasetBuilder` (the token dtype the smallest that holds the vocabulary). Pass that prefix to
`--data-path`. The files appear complete or not at all: they are written under temporary names, synced, then
renamed. Tokenizer flags are the trainer's (`--tokenizer-type`, `--vocab-file`, `--merge-file`,
`--tokenizer-model`, `--vocab-size`).
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.training.tokenizer import TOKENIZER_TYPES, TokenizerArgumentError, check_tokenizer_args  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    g = p.add_argument_group("input")
    g.add_argument("--input", required=True, help="a JSON-lines file")
    g.add_argument("--json-keys", nargs="+", default=["text"], help="the keys to tokenize, each to its own data set")
    g = p.add_argument_group("tokenizer")
    g.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES)
    g.add_argument("--vocab-file", default=None)
    g.add_argument("--merge-file", default=None)
    g.add_argument("--tokenizer-model", default=None)
    g.add_argument("--vocab-size", type=int, default=None, help="NullTokenizer only")
    g.add_argument("--append-eod", action="store_true", help="end every document with the end-of-document token")
    g = p.add_argument_group("output")
    g.add_argument("--output-prefix", required=True)
    g.add_argument("--workers", type=int, default=1, help="tokenizing processes")
    g.add_argument("--log-interval", type=int, default=10000, help="documents between progress lines")
    args = p.parse_args(argv)
    try:
        check_tokenizer_args(args)
    except TokenizerArgumentError as e:
        p.error(str(e))
    if args.workers < 1:
        p.error(f"--workers must be >= 1, got {args.workers}")
    if not os.path.isfile(args.input):
        p.error(f"--input {args.input!r} does not exist")
    return args


class Encoder:
    """Tokenizes one JSON line per call; one tokenizer per worker process (built in its initializer)."""
    tokenizer = None

    def __init__(self, args):
        self.args = args

    def initializer(self):
        from megatron.training.tokenizer import build_tokenizer
        Encoder.tokenizer = build_tokenizer(self.args)

    def encode(self, numbered_line):
        number, line = numbered_line
        try:
            doc = json.loads(line)
        except ValueError as e:
            raise ValueError(f"{self.args.input}:{number}: not a JSON object ({e})") from None
        out = {}
        for key in self.args.json_keys:
            if not isinstance(doc, dict) or not isinstance(doc.get(key), str):
                raise ValueError(f"{self.args.input}:{number}: no text under the key {key!r}")
            ids = Encoder.tokenizer.tokenize(doc[key])
            if self.args.append_eod and ids:
                ids = list(ids) + [Encoder.tokenizer.eod]
            out[key] = ids
        return out, len(line)


def _numbered_lines(path: str):
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                yield number, line


def _publish(tmp_path: str, path: str) -> None:
    with open(tmp_path, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp_path, path)


def _tokenize_into(args, encoder, builders) -> tuple[int, int]:
    """Feed every document to the builders, in input order; (documents, empty ones skipped)."""
    t0, docs, skipped, nbytes = time.time(), 0, 0, 0
    pool = multiprocessing.Pool(args.workers, initializer=encoder.initializer) if args.workers > 1 else None
    try:
        stream = (pool.imap(encoder.encode, _numbered_lines(args.input), chunksize=32) if pool
                  else map(encoder.encode, _numbered_lines(args.input)))
        for encoded, size in stream:
            docs, nbytes = docs + 1, nbytes + size
            for key, ids in encoded.items():
                if ids:
                    builders[key].add_document(ids, [len(ids)])
                else:
                    skipped += 1
            if docs % args.log_interval == 0:
                print(f"processed {docs} documents ({nbytes / max(time.time() - t0, 1e-9) / 2**20:.2f} MiB/s)",
                      flush=True)
    finally:
        if pool:
            pool.terminate()
    return docs, skipped


def main(argv=None) -> int:
    args = parse_args(argv)
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder
    encoder = Encoder(args)
    encoder.initializer()
    dtype = DType.optimal_dtype(Encoder.tokenizer.vocab_size)
    os.makedirs(os.path.dirname(os.path.abspath(args.output_prefix)), exist_ok=True)
    prefixes = {key: f"{args.output_prefix}_{key}_document" for key in args.json_keys}
    t0 = time.time()
    builders = {key: IndexedDatasetBuilder(prefix + ".bin.tmp", dtype=dtype) for key, prefix in prefixes.items()}
    try:
        docs, skipped = _tokenize_into(args, encoder, builders)
        for key, prefix in prefixes.items():
            builders[key].finalize(prefix + ".idx.tmp")
    except BaseException:
        for builder in builders.values():  # closed first: with multi-storage-client installed, megatron-core
            builder.data_file.close()      # writes through it, and its file takes its name only when closed
        for prefix in prefixes.values():  # nothing half-written is left behind
            for tmp in (prefix + ".bin.tmp", prefix + ".idx.tmp"):
                if os.path.exists(tmp):
                    os.remove(tmp)
        raise
    for prefix in prefixes.values():
        _publish(prefix + ".bin.tmp", prefix + ".bin")
        _publish(prefix + ".idx.tmp", prefix + ".idx")
        print(f"wrote {prefix}.bin/.idx", flush=True)
    print(f"{docs} documents, {skipped} empty documents skipped, dtype {dtype.__name__}, "
          f"{time.time() - t0:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ValueError as e:
        sys.exit(f"preprocess_data.py: error: {e}")
