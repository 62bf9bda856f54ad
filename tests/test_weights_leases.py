"""Published weight versions and their readers' leases (datastates.weights, weights_versions.VersionRoot), without
a trainer: versions written through --save-hf's writer into a root, a real reader process holding one.

A version a reader holds is never freed, however far publication goes on, and publication never waits for it;
once the reader is SIGKILLed the next publication frees it. A retired or unpublished version asked for by number,
and a model the version does not fit, get a clear error.
"""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

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


def publish(root: VersionRoot, iteration: int) -> None:
    """A version of one tensor `w` full of the iteration, as the trainer's export writes one."""
    directory = root.stage(root.path(iteration))
    shards = [[Planned("w", (4, 4), torch.float32)]]
    writer = ShardedWriter(root.storage, directory, shards)
    writer.write("w", torch.full((4, 4), float(iteration)))
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


def test_a_model_the_version_does_not_fit_is_refused(tmp_path):
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
