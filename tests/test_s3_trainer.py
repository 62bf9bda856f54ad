"""The trainer on an object store: 4 ranks TP2 x DP2, bf16, distributed optimizer, the memory tier every iteration
and s3:// every 2 (written from the tier's pages), then an exact resume from s3://; the checkpoints read whole
onto one process (a reshard) through the conversion tool's reader, and refusals that need no run."""
import os
import sys

import pytest
import torch

from datastates import tracker
from hf_helpers import assert_round_trip, tiny_llama
from megatron_helpers import ROOT, TINY, losses, torchrun
from s3_store import s3_server  # noqa: F401  (the session fixture)

BASE = TINY + ["--train-iters", "4", "--global-batch-size", "8", "--hidden-dropout", "0", "--attention-dropout", "0",
               "--bf16", "--use-distributed-optimizer", "--tensor-model-parallel-size", "2"]


def test_tp2_dp2_saves_to_s3_from_the_memory_tier_and_resumes_exactly(s3_server, tmp_path, monkeypatch):  # noqa: F811
    env = dict(s3_server.env(), DATASTATES_JOB_ID="s3-trainer", DATASTATES_RANKS_PER_NODE="2")
    for k, v in env.items():
        monkeypatch.setenv(k, v)  # this process reads the same store below
    bucket = s3_server.create_bucket()
    first, second = f"s3://{bucket}/first", f"s3://{bucket}/second"
    _, log = torchrun(4, BASE + ["--save", first, "--save-interval", "2", "--async-ckpt",
                                 "--non-persistent-save-interval", "1",
                                 "--non-persistent-local-ckpt-dir", str(tmp_path / "mem")], env=env)
    straight = losses(log)
    assert sorted(straight) == [1, 2, 3, 4], log[-3000:]
    assert tracker.published_iterations(first) == [2, 4]

    _, log = torchrun(4, BASE + ["--load", f"{first}/iter_0000002", "--save", second, "--save-interval", "2",
                                 "--async-ckpt"], env=env)
    assert "at iteration 2" in log, log[-3000:]
    assert losses(log) == {3: straight[3], 4: straight[4]}

    sys.path.insert(0, os.path.join(ROOT, "tools"))
    from convert_checkpoint import main as convert, read_datastates
    from inspect_checkpoint import main as inspect
    assert inspect([first]) == 0 and inspect([second, "--verify"]) == 0  # every chunk's crc32c, read from s3://
    a, b = read_datastates(first, 4).tensors, read_datastates(second, 4).tensors  # TP2 x DP2 onto one process
    model = [k for k in a if not k.startswith("optimizer.")]  # the flat optimizer buckets' padding is not state
    assert a.keys() == b.keys() and model and [k for k in model if not torch.equal(a[k], b[k])] == []
    copy = f"s3://{bucket}/copy"  # the conversion tool from s3:// to s3://
    assert convert(["--from", "datastates", "--input", second, "--to", "datastates", "--output", copy]) == 0
    c = read_datastates(copy, None).tensors
    assert c.keys() == b.keys() and [k for k in b if not torch.equal(b[k], c[k])] == []


def test_hf_import_to_s3_and_export_from_s3_are_bit_exact(s3_server, tmp_path, monkeypatch, capsys):  # noqa: F811
    """--from hf with an s3:// --output, then --to hf with it as --input (the transformers side is a local
    directory: transformers reads and writes files)."""
    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    source = str(tmp_path / "source")
    tiny_llama(source, vocab=100)
    ckpt = f"s3://{s3_server.create_bucket()}/ckpt"
    assert_round_trip(source, str(tmp_path), 100, ckpt=ckpt)
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    from convert_checkpoint import main as convert
    for fmt in ("hf", "torch_dist"):  # formats of file systems: refused before any work, saying why
        assert convert(["--from", "datastates", "--input", ckpt, "--to", fmt, "--output", f"{ckpt}-{fmt}"]) == 1
        assert f"--output '{ckpt}-{fmt}': {fmt} is read and written on a file system only" in capsys.readouterr().err


@pytest.mark.parametrize("flags, match", [
    (["--ckpt-format", "torch_dist"], "object stores need --ckpt-format datastates"),
    (["--load", "/tmp/elsewhere"], "on different storages"),
    (["--disable-msc"], None),
])
def test_what_an_object_store_refuses_before_any_work(s3_server, monkeypatch, flags, match):  # noqa: F811
    from megatron.training.arguments import ArgumentError, parse_args
    from megatron.training.validation import validate_args
    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    save = "msc://nowhere/run" if "--disable-msc" in flags else f"s3://{s3_server.create_bucket()}/run"
    args = parse_args(argv=BASE + ["--save", save] + flags)
    with pytest.raises(ArgumentError, match=match or "disabled by --disable-msc"):
        validate_args(args, world_size=4, cuda=False)
