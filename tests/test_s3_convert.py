"""tools/convert_checkpoint.py writing to and reading from an object store (a real SeaweedFS, tests/s3_store.py)
as the trainer does: through the engine's storage and the save root's policy (published by the index, the
tracker after it), loadable from there."""
import os
import sys

import torch

from datastates import CheckpointEngine, paths, tracker
from datastates.storage import storage_for
from test_tools import EMB, NORM, OPT, QKV, full_tensors, save_two_ranks

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_convert_to_datastates_on_s3_publishes_and_loads_back(s3, s3_server, tmp_path):
    sys.path.insert(0, REPO)
    from tools.convert_checkpoint import main
    full = full_tensors()
    save_two_ranks(paths.checkpoint_dir(str(tmp_path / "ds"), 7), full)
    assert main(["--from", "datastates", "--to", "datastates", "--input", str(tmp_path / "ds"),
                 "--output", s3]) == 0
    assert tracker.read_latest(s3) == 7 and tracker.published_iterations(s3) == [7]
    bucket, _, prefix = s3[len("s3://"):].partition("/")
    client = s3_server.client()
    assert client.list_multipart_uploads(Bucket=bucket, Prefix=prefix).get("Uploads", []) == []
    names = sorted(o["Key"][len(prefix) + 1:] for o in client.list_objects_v2(Bucket=bucket, Prefix=prefix)["Contents"])
    assert names == ["iter_0000007/metadata.json", "iter_0000007/rank_00000.data",
                     "iter_0000007/rank_00000.manifest.json", paths.TRACKER]
    from datastates.megatron import load_sharded, make_registry
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    template = {k: ShardedTensor.from_rank_offsets(k, torch.zeros_like(v)) for k, v in full.items()
                if k != QKV}
    with CheckpointEngine(host_buffer_bytes=1 << 20, storage=storage_for(s3), rank=0, world_size=1,
                          registry=make_registry()) as eng:
        got = load_sharded(eng, template, s3)
    for k in (EMB, NORM, OPT):
        assert torch.equal(got[k], full[k]), k
    from tools.inspect_checkpoint import main as inspect
    assert inspect([s3, "--verify"]) == 0  # the save root resolved through the tracker the conversion wrote


def test_convert_refuses_an_occupied_output_on_s3(s3, tmp_path, caplog):
    sys.path.insert(0, REPO)
    from tools.convert_checkpoint import main
    save_two_ranks(paths.checkpoint_dir(str(tmp_path / "ds"), 7), full_tensors())
    args = ["--from", "datastates", "--to", "datastates", "--input", str(tmp_path / "ds"), "--output", s3]
    assert main(args) == 0
    assert main(args) == 1
    assert f"output {paths.checkpoint_dir(s3, 7)!r} already exists" in caplog.text
