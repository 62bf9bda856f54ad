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
import re
import signal
import subprocess
import sys
import threading

import pytest
import torch
from safetensors import safe_open

from megatron_helpers import ROOT, torchrun
from rank_launcher import environment

pytest.importorskip("transformers")

from hf_helpers import TRAIN, hf_model, hf_tensors  # noqa: E402
from test_hf_publish import MODEL, SHARD, assert_same_bytes  # noqa: E402

from test_weights_versions import rank_of, reassembled, same  # noqa: E402

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


def in_place(version, tensors: dict | None = None):
    """A transformers model (fp32) of the version's config, its weights copied in place from the version, or from
    `tensors` (its tensors, reassembled)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(version.path), dtype=torch.float32).eval()
    if tensors is None:
        version.load_into(model)
    else:
        model.load_state_dict(tensors, strict=True)
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
        # a TP2 engine's ranks: packed, what the test rebuilds with torch.cat; unpacked, reassembled, the version
        config, sliced = version.config, [dict(version.tensors(tp_rank=r, tp_size=2)) for r in range(2)]
        assert all(same(t, rank_of(pairs, config, 2, r)[n]) for r in range(2)
                   for n, t in version.tensors(packed=True, tp_rank=r, tp_size=2))
        from_slices = in_place(version, reassembled(sliced, pairs))
    tokens = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = hf_model(os.path.join(hf, "iter_0000006"))(tokens).logits
        assert torch.equal(model(tokens).logits, logits) and torch.equal(from_slices(tokens).logits, logits)


def test_a_job_killed_mid_publication_leaves_the_previous_version_whole_and_its_restart_goes_on(tmp_path):
    """SIGKILL (tests/fault_launcher.py, FAULT_KILL_IN_EXPORT) once a safetensors file of version 3 is written:
    `latest` names version 2, which a reader loads whole; version 3's files were never in a reader's sight. The job
    restarted (--load: it resumes from the memory tier, or from the run's last checkpoint when the kill came after
    it) goes on publishing: the killed version's leftovers removed,
    a version for each iteration it trains, `latest` the last, older ones retired by --publish-weights-keep-last,
    its first delta chained from version 2, through which a reader's copy of version 2 reaches the last exactly
    (bf16 at lr 1e-6: few elements change)."""
    versions, tier, ckpt = str(tmp_path / "versions"), str(tmp_path / "tier"), str(tmp_path / "ckpt")
    flags = MODEL + TRAIN[:TRAIN.index("--train-iters")] + ["--lr", "1e-6", "--bf16", "--save", ckpt,
                                                            "--save-interval", "100", "--async-ckpt",
                                                            "--non-persistent-save-interval", "1",
                                                            "--non-persistent-local-ckpt-dir", tier,
                                                            "--save-hf-max-shard-size", SHARD, "--publish-weights-dir",
                                                            versions, "--publish-weights-interval", "1"]
    rc, log = torchrun(1, flags + ["--train-iters", "4"], env={"FAULT_KILL_IN_EXPORT": "3:first-file"}, check=False,
                       faults=True)
    assert rc != 0 and "FAULT-KILL-EXPORT iteration 3" in log, log[-3000:]
    assert sorted(os.listdir(versions)) == ["iter_0000001", "iter_0000002", "iter_0000003.partial", "latest"]
    reader = WeightsReader(versions)
    with reader.newest() as version:
        assert version.iteration == 2
        copy = {n: t.clone() for n, t in version.tensors()}  # a rollout engine's weights, kept across the restart
        model = in_place(version)
    with torch.no_grad():
        assert torch.isfinite(model(torch.arange(32).reshape(1, 32)).logits).all()

    _, log = torchrun(1, flags + ["--train-iters", "6", "--load", ckpt, "--publish-weights-deltas", "4"])
    resumed = int(re.search(r"RESUMED from .* at iteration (\d+)", log)[1])  # the newest of the tier and storage
    assert resumed in (2, 3, 4), log[-3000:]  # the last save the killed job made before or after version 3's kill
    # once each: the run's final storage save of iteration 6, which the tier saved and published, adds none
    assert all(log.count(f"published weights version {it}: ") == 1 for it in range(resumed + 1, 7)), log[-3000:]
    assert sorted(os.listdir(versions)) == ["deltas", "iter_0000005", "iter_0000006", "latest"], log[-3000:]
    with safe_open(os.path.join(versions, "deltas", f"iter_{resumed + 1:07d}.safetensors"), framework="pt") as f:
        assert f.metadata()["from"] == "2"
    newest, nbytes = reader.catch_up(copy, 2)
    with reader.open(6) as version:
        assert newest == 6 and nbytes < version.nbytes
        assert all(torch.equal(copy[n].view(torch.int16), t.view(torch.int16)) for n, t in version.tensors())
