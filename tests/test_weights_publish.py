"""--publish-weights-dir: policy versions for the inference side, published while training
(megatron/training/checkpointing/weights_publish.py), read by the readers' library (datastates.weights).

A TP2 run with the memory tier every iteration publishes a version every iteration, from the saves' own snapshots
(memory-tier saves, and the storage saves beside --save-hf's exports), with deltas. Two real reader processes run
beside it: one follows the versions to the last through the deltas, each bit for bit the full version; one is
SIGKILLed in the middle of reading a version, which the trainer then frees (training never waited for either). The last version is byte for byte --save-hf's model of
the same iteration, and a transformers model loaded in place from it computes that model's logits bit for bit. A
job SIGKILLed in the middle of a version's publication leaves the previous version whole, named by `latest`.
"""
import os
import signal
import subprocess
import sys
import threading

import pytest
import torch

from megatron_helpers import ROOT, torchrun
from rank_launcher import environment

pytest.importorskip("transformers")

from hf_helpers import TRAIN, hf_model, hf_tensors  # noqa: E402
from test_hf_publish import MODEL, SHARD, assert_same_bytes  # noqa: E402

from datastates.weights import WeightsReader  # noqa: E402


def reader(root: str, *args: str) -> subprocess.Popen:
    """A reader process (tests/weights_reader.py), returned once it said READY (its imports done)."""
    p = subprocess.Popen([sys.executable, "tests/weights_reader.py", root, *args], cwd=ROOT, env=environment(),
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    first = p.stdout.readline()
    assert first == "READY\n", first + p.stdout.read()
    return p


def kill_once_mid_read(holder: subprocess.Popen, held: list) -> None:
    """SIGKILL the holder once it holds a version half read; note which."""
    for line in holder.stdout:
        if line.startswith("MID-READ"):
            held.append(int(line.split()[1]))
            holder.send_signal(signal.SIGKILL)
            return


def in_place(version):
    """A transformers model of the version's config, its weights copied in place from the version."""
    from transformers import AutoConfig, AutoModelForCausalLM
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(version.path), dtype=torch.float32).eval()
    version.load_into(model)
    return model


def test_versions_follow_training_readers_come_and_die_and_the_last_is_the_hf_export(tmp_path):
    """bf16 at lr 1e-6, an RL step: few elements change, so the follower takes the deltas."""
    versions, hf = str(tmp_path / "versions"), str(tmp_path / "hf")
    train = TRAIN[:TRAIN.index("--train-iters")] + ["--lr", "1e-6", "--bf16", "--train-iters", "6"]  # the last --lr
    holder, follower, held = reader(versions, "hold"), reader(versions, "follow", "6"), []
    killer = threading.Thread(target=kill_once_mid_read, args=(holder, held))
    killer.start()
    try:
        _, log = torchrun(2, MODEL + train + [
            "--tensor-model-parallel-size", "2", "--save", str(tmp_path / "ckpt"), "--save-interval", "2",
            "--async-ckpt", "--non-persistent-save-interval", "1", "--non-persistent-local-ckpt-dir",
            str(tmp_path / "tier"), "--save-hf", hf, "--save-hf-max-shard-size", SHARD, "--publish-weights-dir",
            versions, "--publish-weights-interval", "1", "--publish-weights-keep-last", "1",
            "--publish-weights-deltas", "8"])
        out, _ = follower.communicate(timeout=120)
    finally:
        for p in (holder, follower):
            p.kill()
        killer.join()
    for it in range(1, 7):
        assert f"published weights version {it}: " in log, log[-4000:]
    # the follower took versions up to the last, through the deltas after its first, each one it could still
    # compare bit for bit the full version, the last one included; the holder died holding one
    got = [line.split()[1:] for line in out.splitlines() if line.startswith("GOT")]
    its = [int(g[0]) for g in got]
    assert its and its[-1] == 6 and its == sorted(set(its)) and out.rstrip().endswith("DONE"), out
    assert got[-1][3] == "exact" and "DIFFERS" not in out, out
    # a follower that started late on a loaded machine may take only the last version (its first is always whole);
    # otherwise it came through the deltas, which the trainer wrote either way (their exactness over chains:
    # test_weights_versions)
    assert len(got) == 1 or any(g[2] == "deltas" for g in got), out
    assert os.listdir(os.path.join(versions, "deltas")), os.listdir(versions)
    assert held and held[0] < 6 and holder.wait() == -signal.SIGKILL
    # keep-last 1: the dead reader's version was freed by a later publication; the last is what `latest` names
    assert sorted(os.listdir(versions)) == ["deltas", "iter_0000006", "latest"], os.listdir(versions)
    assert sorted(os.listdir(os.path.join(versions, "deltas"))) == [f"iter_000000{i}.safetensors" for i in range(2, 7)]
    last = os.path.join(versions, "iter_0000006")
    assert_same_bytes(last, os.path.join(hf, "iter_0000006"))
    with WeightsReader(versions).newest() as version:
        assert version.iteration == 6
        pairs = dict(version.tensors())
        hf_pairs = hf_tensors(os.path.join(hf, "iter_0000006"))
        assert pairs.keys() == hf_pairs.keys() and all(torch.equal(pairs[n], hf_pairs[n]) for n in pairs)
        model = in_place(version)
    tokens = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model(tokens).logits, hf_model(os.path.join(hf, "iter_0000006"))(tokens).logits)


def test_a_job_killed_mid_publication_leaves_the_previous_version_whole(tmp_path):
    """SIGKILL (tests/fault_launcher.py, FAULT_KILL_IN_EXPORT) once a safetensors file of version 3 is written:
    `latest` names version 2, which a reader loads whole; version 3's files were never in a reader's sight."""
    versions = str(tmp_path / "versions")
    train = TRAIN[:TRAIN.index("--train-iters")] + ["--train-iters", "4"]
    rc, log = torchrun(1, MODEL + train + [
        "--save", str(tmp_path / "ckpt"), "--save-interval", "100", "--async-ckpt", "--non-persistent-save-interval",
        "1", "--non-persistent-local-ckpt-dir", str(tmp_path / "tier"), "--save-hf-max-shard-size", SHARD,
        "--publish-weights-dir", versions, "--publish-weights-interval", "1"],
        env={"FAULT_KILL_IN_EXPORT": "3:first-file"}, check=False, faults=True)
    assert rc != 0 and "FAULT-KILL-EXPORT iteration 3" in log, log[-3000:]
    assert sorted(os.listdir(versions)) == ["iter_0000001", "iter_0000002", "iter_0000003.partial", "latest"]
    reader = WeightsReader(versions)
    with reader.newest() as version:
        assert version.iteration == 2
        model = in_place(version)
    with torch.no_grad():
        assert torch.isfinite(model(torch.arange(32).reshape(1, 32)).logits).all()
