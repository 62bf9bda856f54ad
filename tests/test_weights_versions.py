"""Published weight versions and their readers' leases (datastates.weights, weights_versions.VersionRoot), without
a trainer: versions written through --save-hf's writer into a root, a real reader process holding one.

A version a reader holds is never freed, however far publication goes on, and publication never waits for it;
once the reader is SIGKILLed the next publication frees it. A retired or unpublished version asked for by number,
and a model the version does not fit, get a clear error. A reader k versions behind reaches the newest through the
deltas exactly to the bit, reading a fraction of the bytes; one whose chain was retired is told so, untouched.
"""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors import safe_open

from megatron_helpers import ROOT
from rank_launcher import environment

from datastates import storage_for
from datastates.hf.writer import Planned, ShardedWriter
from datastates.weights import WeightsError, WeightsReader
from megatron.training.checkpointing.weights_versions import VersionRoot

HOLD = """
import sys, time
from datastates.weights import WeightsReader
version = WeightsReader(sys.argv[1]).open(int(sys.argv[2]))
name, tensor = next(version.tensors())
print("HELD", float(tensor[0, 0]), flush=True)
time.sleep(600)
"""


def publish(root: VersionRoot, iteration: int, tensors: dict | None = None) -> None:
    """A version of `tensors` (by default one, `w`, full of the iteration), as the trainer's export writes one."""
    tensors = tensors or {"w": torch.full((4, 4), float(iteration))}
    directory = root.stage(root.path(iteration))
    shards = [[Planned(n, tuple(t.shape), t.dtype) for n, t in tensors.items()]]
    writer = ShardedWriter(root.storage, directory, shards)
    for name, tensor in tensors.items():
        writer.write(name, tensor)
    writer.close()
    root.storage.write_bytes(os.path.join(directory, "config.json"), json.dumps({}).encode())
    root.publish(directory, iteration, shards)


def held(root: str) -> list[str]:
    return sorted(n for n in os.listdir(root) if n.startswith("iter_"))


def test_a_held_version_stays_until_its_reader_dies_and_publication_never_waits(tmp_path):
    path = str(tmp_path / "versions")
    os.makedirs(path)
    root = VersionRoot(storage_for(path), path, keep_last=1)
    publish(root, 1)
    holder = subprocess.Popen([sys.executable, "-c", HOLD, path, "1"], cwd=ROOT, env=environment(),
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().split() == ["HELD", "1.0"]
        t0 = time.monotonic()
        for it in (2, 3):
            publish(root, it)
        assert time.monotonic() - t0 < 5  # never waited for the reader
        assert held(path) == ["iter_0000001", "iter_0000003"]  # 2 freed (no reader), 1 held
        reader = WeightsReader(path)
        with reader.newest() as newest:
            assert newest.iteration == 3 and torch.equal(dict(newest.tensors())["w"], torch.full((4, 4), 3.0))
        with pytest.raises(WeightsError, match=r"version 2 under .* is not held: it was retired \(the versions held "
                                               r"now: \[1, 3\]\)"):
            reader.open(2)
        with pytest.raises(WeightsError, match=r"version 9 under .* is not held: it is not published"):
            reader.open(9)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    publish(root, 4)  # the dead reader holds nothing: 1 goes now
    assert held(path) == ["iter_0000004"]
    assert open(os.path.join(path, "latest")).read() == "iter_0000004\n"


def test_a_model_the_version_does_not_fit_and_a_pointer_to_nothing_are_refused(tmp_path):
    path = str(tmp_path / "versions")
    os.makedirs(path)
    publish(VersionRoot(storage_for(path), path, keep_last=1), 1)
    with WeightsReader(path).newest() as version:
        with pytest.raises(WeightsError, match=r"'w' is \(4, 4\) in the version, \(4, 3\) in the model"):
            version.load_into(torch.nn.ParameterDict({"w": torch.nn.Parameter(torch.zeros(4, 3))}))
        with pytest.raises(WeightsError, match=r"the version has no tensor for the model's b"):
            version.load_into(torch.nn.ParameterDict({"w": torch.nn.Parameter(torch.zeros(4, 4)),
                                                      "b": torch.nn.Parameter(torch.zeros(4))}))
    with pytest.raises(WeightsError, match="read after close"):
        next(version.tensors())
    with open(os.path.join(path, "latest"), "w") as f:  # a pointer to nothing (a root damaged by hand)
        f.write("iter_0000009\n")
    with pytest.raises(WeightsError, match=r"latest names version 9, which is not there"):
        WeightsReader(path).newest()


def test_a_reader_versions_behind_reaches_the_newest_through_deltas_exactly(tmp_path):
    """bf16 tensors of which about 1% of the elements change per version (-0.0 and NaN among them: compared by
    their bits), and one whose every element changes (sent whole); a reader holding version 1 is brought to 3,
    then 2 versions behind to 5, bit for bit the full version; a copy left at 1 once the delta to 2 is retired,
    and one whose deltas would take more bytes than the full version, are told to load it, untouched."""
    path = str(tmp_path / "versions")
    os.makedirs(path)
    root = VersionRoot(storage_for(path), path, keep_last=1, deltas=3)
    g = torch.Generator().manual_seed(0)
    tensors = {"a": torch.randn(300, 200, generator=g).bfloat16(), "b": torch.randn(1000, generator=g).bfloat16(),
               "c": torch.zeros(64, dtype=torch.bfloat16)}  # every element changes: sent whole
    publish(root, 1, tensors)
    reader = WeightsReader(path)
    with reader.open(1) as version:
        held = dict(version.tensors())  # the reader's own copy (an engine's weights)
    for it in range(2, 6):
        tensors = {k: v.clone() for k, v in tensors.items()}
        tensors["c"].fill_(it)
        for t in (tensors["a"], tensors["b"]):
            flat = t.view(-1)
            flat[torch.randperm(flat.numel(), generator=g)[:flat.numel() // 100]] += 0.5
        tensors["b"][0], tensors["b"][1] = -0.0 if it % 2 else 0.0, float("nan") if it == 5 else 1.0
        publish(root, it, tensors)
        if it == 3:
            behind = {k: v.clone() for k, v in held.items()}  # stays at 1
            assert reader.catch_up(held, 1)[0] == 3
    before = {k: v.clone() for k, v in behind.items()}
    with pytest.raises(WeightsError, match=r"no delta to version 2 under .*: version 1 cannot be brought to 5 by "
                                           r"deltas; load the full version"):
        reader.catch_up(behind, 1)  # deltas=3: the delta to 2 is retired
    assert all(torch.equal(behind[k].view(torch.int16), before[k].view(torch.int16)) for k in behind)  # untouched
    newest, nbytes = reader.catch_up(held, 3)  # 2 versions behind: the deltas to 4 and 5
    assert newest == 5
    with reader.open(5) as version:
        full = dict(version.tensors())
        assert nbytes * 10 < version.nbytes
    assert all(torch.equal(held[k].view(torch.int16), full[k].view(torch.int16)) for k in full)
    with safe_open(os.path.join(path, "deltas", "iter_0000005.safetensors"), framework="pt") as f:
        assert sorted(f.keys()) == ["a:index", "a:value", "b:index", "b:value", "c:full"]
    assert sorted(os.listdir(os.path.join(path, "deltas"))) == [f"iter_000000{i}.safetensors" for i in (3, 4, 5)]
    for it in (6, 7):  # every element changes: two deltas take more bytes than one full version
        publish(root, it, {k: torch.randn(v.shape, generator=g).bfloat16() for k, v in tensors.items()})
    before = {k: v.clone() for k, v in held.items()}
    with pytest.raises(WeightsError, match=r"the deltas from version 5 to 7 under .* take more bytes than the full "
                                           r"version: version 5 cannot be brought to 7 by deltas"):
        reader.catch_up(held, 5)
    assert all(torch.equal(held[k].view(torch.int16), before[k].view(torch.int16)) for k in held)
