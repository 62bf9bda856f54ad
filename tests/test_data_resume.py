"""A resume continues at exactly the next sample on a real blended corpus, and a batch-size ramp resumes
exactly (2 ranks, torchrun, tiny tokenizers and corpora built here)."""
import glob
import json
import math
import re
import struct

import numpy as np
import pytest

from corpus import documents, gpt2_bpe, hf_dir, preprocess, write_jsonl
from megatron_helpers import torchrun

MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--micro-batch-size", "2", "--lr", "1e-3", "--seed", "1234", "--async-ckpt", "--no-ckpt-fsync"]
LINE_RE = re.compile(r"iteration\s+(\d+)/\s*\d+ \| consumed samples:\s+(\d+) \|.*learning rate: (\S+) \| "
                     r"global batch size:\s+(\d+) \| lm loss: (\S+) \|")
OPTIONAL_FIGURES = ["--log-throughput", "--log-params-norm", "--log-num-zeros-in-grad", "--log-timers-to-tensorboard",
                    "--log-memory-to-tensorboard"]
VALID_RE = re.compile(r"validation loss at iteration (\d+) on (\w+) set \| lm loss value: (\S+) \|")
DOCS = {"a": 40, "b": 60}


def iterations(log: str) -> dict[int, tuple]:
    """iteration -> (consumed samples, learning rate, global batch size, loss), as printed (compared exactly)."""
    return {int(m.group(1)): m.groups()[1:] for m in LINE_RE.finditer(log)}


def corpus(tmp_path, tokenizer_flags) -> list[str]:
    """Two indexed data sets of different documents, preprocessed with the tokenizer; their prefixes."""
    prefixes = []
    for seed, (name, n) in enumerate(DOCS.items()):
        jsonl = write_jsonl(str(tmp_path / f"{name}.jsonl"), documents(n, seed=10 + seed))
        rc, out = preprocess(jsonl, str(tmp_path / "data" / name), tokenizer_flags, "--append-eod")
        assert rc == 0, out[-3000:]
        prefixes.append(str(tmp_path / "data" / f"{name}_text_document"))
    return prefixes


def straight_and_resumed(tmp_path, flags, stop: int, straight_flags=(), stopped_flags=()):
    """(a straight run, the run stopped at `stop`, its resume), each as iterations(), and their three logs."""
    _, straight = torchrun(2, flags + list(straight_flags))
    ck = str(tmp_path / "ck")
    flags = flags + list(stopped_flags) + ["--save", ck]
    _, first = torchrun(2, flags + ["--save-interval", str(stop), "--exit-interval", str(stop)])
    _, resumed = torchrun(2, flags + ["--load", ck, "--save-interval", "100"])
    assert f"successfully loaded checkpoint from {ck} (datastates) at iteration {stop}" in resumed
    return iterations(straight), iterations(first), iterations(resumed), (straight, first, resumed)


def validation(log: str) -> dict[tuple[int, str], str]:
    """(iteration, split) -> the printed validation loss."""
    return {(int(m.group(1)), m.group(2)): m.group(3) for m in VALID_RE.finditer(log)}


def scalars(tb_dir: str) -> dict[str, dict[int, float]]:
    """Every scalar of the TensorBoard event files under `tb_dir`, read by TensorBoard's own reader."""
    from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer
    mux = EventMultiplexer().AddRunsFromDirectory(tb_dir)
    mux.Reload()
    out = {}
    for run, tags in mux.Runs().items():
        for tag in tags["scalars"]:
            out.setdefault(tag, {}).update({e.step: e.value for e in mux.Scalars(run, tag)})
    return out


def scalar_events(tb_dir: str) -> dict[str, list[tuple[int, float]]]:
    """Every (step, value) of each scalar under `tb_dir`, one per event (two at one step stay two)."""
    from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer
    mux = EventMultiplexer().AddRunsFromDirectory(tb_dir)
    mux.Reload()
    return {tag: [(e.step, e.value) for run in mux.Runs() for e in mux.Scalars(run, tag)
                  if tag in mux.Runs()[run]["scalars"]]
            for tag in {t for tags in mux.Runs().values() for t in tags["scalars"]}}


def check_evaluation_and_metrics(straight, logs, tb_straight, tb_resumed, wandb_dir):
    """Validation every 2 iterations and at the end (validation and test); the stopped and resumed runs evaluate
    what the straight one does; TensorBoard and W&B hold the printed values."""
    straight_log, first_log, resumed_log = logs
    valid = validation(straight_log)
    assert sorted(valid) == [(2, "validation"), (4, "validation"), (6, "validation"), (8, "test"),
                             (8, "validation")], straight_log[-3000:]
    assert len({v for (_, split), v in valid.items() if split == "validation"}) == 4  # new samples each time
    assert {**validation(first_log), **validation(resumed_log)} == valid
    both = scalars(tb_straight), scalars(tb_resumed)
    for tb in both:
        assert tb["lm loss"] == {i: pytest.approx(float(straight[i][3]), rel=1e-6) for i in straight}
        assert tb["lm loss validation"] == {i: pytest.approx(float(valid[(i, "validation")]), rel=1e-6)
                                            for i in (2, 4, 6)} | {8: pytest.approx(float(valid[(8, "validation")]),
                                                                                    rel=1e-6)}
        assert tb["learning-rate"] == {i: pytest.approx(float(straight[i][1]), rel=1e-6) for i in straight}
        assert set(tb["grad-norm"]) == set(tb["iteration-time"]) == set(range(1, 9))
    # the optional figures, in the straight run only: they change nothing its losses show (compared above)
    assert {"throughput", "params-norm", "num-zeros", "forward-backward-time", "checkpoint-wait-time",
            "optimizer-time", "mem-resident-bytes"} <= set(both[0]) and not set(both[1]) & {"throughput", "params-norm"}
    assert all(v > 0 for v in both[0]["params-norm"].values()) and set(both[0]["throughput"]) == set(range(1, 9))
    assert glob.glob(f"{tb_straight}/*.pt.trace.json")  # torch.profiler's trace of iteration 2
    # the stopped run's checkpoint at 4 and the resumed run's at 8: their stall and time to durable on the last
    # rank and the slowest rank's stall, each logged at an iteration the run had reached, naming its checkpoint
    events = scalar_events(tb_resumed)
    assert sorted(v for _, v in events["checkpoint/iteration"]) == [4, 4, 8, 8]  # the rank's, the slowest's
    assert all(step >= v for step, v in events["checkpoint/iteration"])
    assert len(events["checkpoint/stall-ms"]) == len(events["checkpoint/slowest-stall-ms"]) == 2
    assert all(v > 0 for _, v in events["checkpoint/durable-ms"])
    (run,) = glob.glob(f"{wandb_dir}/wandb/offline-run-*/run-*.wandb")
    history = wandb_history(run)
    assert {i: h["lm loss"] for i, h in history.items() if "lm loss" in h} == \
        {i: pytest.approx(float(straight[i][3]), rel=1e-6) for i in straight}
    # the straight run saved at 4 and 8: W&B kept its checkpoints' scalars (a step lower than one seen is dropped)
    saved = {h["checkpoint/iteration"]: (step, h) for step, h in history.items() if "checkpoint/iteration" in h}
    assert 8 in saved and all(step >= it for it, (step, _) in saved.items()), history
    assert {"checkpoint/stall-ms", "checkpoint/durable-ms", "checkpoint/slowest-stall-ms"} <= set(saved[8][1])
    assert saved[8][1]["checkpoint/slowest-stall-ms"] >= saved[8][1]["checkpoint/stall-ms"]


def wandb_history(path: str) -> dict[int, dict]:
    """step -> the scalars of an offline W&B run file, decoded with wandb's own protobuf schema (the file is a
    LevelDB-style log of 32 KiB blocks after a 7-byte header; records may span blocks)."""
    from wandb.proto import wandb_internal_pb2
    data = open(path, "rb").read()
    assert data[:4] == b":W&B", path
    pos, pending, history = 7, b"", {}
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:  # a block's tail too short for a record header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last piece of one
            record = wandb_internal_pb2.Record.FromString(pending)
            pending = b""
            if record.WhichOneof("record_type") == "history":
                items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
                history[items["_step"]] = items
    return history


def embedding_rows(ckpt_dir: str) -> set[int]:
    """The rows of the word embedding saved in a checkpoint (the weights and their optimizer states)."""
    from datastates import CheckpointEngine
    with CheckpointEngine(rank=0, world_size=1) as engine:
        index = engine.checkpoint(ckpt_dir).global_index()
    return {shards[0].global_shape[0] for name, shards in index.items() if "word_embeddings.weight" in name}


def test_blended_corpus_resumes_at_the_next_sample(tmp_path):
    vocab, merges = gpt2_bpe(str(tmp_path / "bpe"))
    tok = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab, "--merge-file", merges]
    a, b = corpus(tmp_path, tok)
    cache = str(tmp_path / "cache")
    flags = MODEL + tok + ["--global-batch-size", "8", "--train-iters", "8", "--data-path", "0.3", a, "0.7", b,
                           "--split", "50,25,25", "--data-cache-path", cache]
    tb_straight, tb_resumed, wandb_dir = (str(tmp_path / d) for d in ("tb_straight", "tb_resumed", "wandb"))
    evaluation = ["--eval-interval", "2", "--eval-iters", "1"]
    straight, first, resumed, logs = straight_and_resumed(
        tmp_path, flags + evaluation, 4,
        straight_flags=["--tensorboard-dir", tb_straight, "--wandb-project", "p", "--wandb-save-dir", wandb_dir,
                        "--save", str(tmp_path / "ck_straight"), "--save-interval", "4",
                        *OPTIONAL_FIGURES, "--profile", "--use-pytorch-profiler", "--profile-step-start", "1",
                        "--profile-step-end", "2"],
        stopped_flags=["--tensorboard-dir", tb_resumed])
    assert sorted(straight) == list(range(1, 9)) and sorted(first) == [1, 2, 3, 4] and sorted(resumed) == [5, 6, 7, 8]
    check_evaluation_and_metrics(straight, logs, tb_straight, tb_resumed, wandb_dir)
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
    straight, first, resumed, _ = straight_and_resumed(tmp_path, flags, 5)
    batch = [int(straight[i][2]) for i in sorted(straight)]
    assert sorted(set(batch)) == [4, 8, 12, 16] and batch[3] != batch[4]  # the resume starts where the batch grows
    assert sorted(resumed) == list(range(6, len(straight) + 1))
    assert {i: straight[i] for i in first} == first
    assert {i: straight[i] for i in resumed} == resumed
