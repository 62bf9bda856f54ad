"""--ckpt-format torch_dist on msc://: megatron-core's own multi-storage-client support writes and reads the
checkpoint (SeaweedFS behind an s3 profile), the trainer's tracker and format detection go through the same
profile, and a resume from the store is exact. s3:// with torch_dist is refused before any work, saying why."""
import pytest

from datastates import paths, tracker
from megatron_helpers import TINY, losses, torchrun

BASE = TINY + ["--train-iters", "4", "--global-batch-size", "4", "--hidden-dropout", "0", "--attention-dropout", "0",
               "--ckpt-format", "torch_dist"]


def _store(s3_server, tmp_path, monkeypatch, profile):
    """A fresh bucket behind the MSC profile `profile`, for this process and the ranks (their environment is
    this one's); the bucket's name."""
    bucket = s3_server.create_bucket()
    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("MSC_CONFIG", str(s3_server.write_msc_config(tmp_path / "msc.json", profile=profile,
                                                                    bucket=bucket)))
    return bucket


def test_torch_dist_saves_to_msc_and_resumes_exactly(s3_server, tmp_path, monkeypatch):
    bucket = _store(s3_server, tmp_path, monkeypatch, "tdist")
    root = "msc://tdist/run"
    _, log = torchrun(2, BASE + ["--save", root, "--save-interval", "2"])
    straight = losses(log)
    assert sorted(straight) == [1, 2, 3, 4], log[-3000:]

    keys = [o["Key"] for o in s3_server.client().list_objects_v2(Bucket=bucket, Prefix="run/").get("Contents", [])]
    for it in (2, 4):  # megatron-core's files, written through MSC: its config, DCP's index and the ranks' data
        prefix = f"run/iter_{it:07d}/"
        assert {prefix + "metadata.json", prefix + ".metadata"} <= set(keys), keys
        assert any(k.startswith(prefix) and k.endswith(".distcp") for k in keys), keys
    assert "run/" + paths.TRACKER in keys
    latest = tracker.find_latest(root)  # the tracker, read through the profile
    assert (latest.tracker, latest.iteration) == ("4", 4)
    from megatron.core.msc_utils import MultiStorageClientFeature
    from megatron.training.args_from_checkpoint import saved_args
    from megatron.training.checkpointing.formats import TorchDistFormat, detect
    assert detect(latest.path) is TorchDistFormat
    before = MultiStorageClientFeature.is_enabled()  # 0.16: on with MSC installed; 0.19: off
    saved, path = saved_args(root)  # --use-checkpoint-args: the common state, read in this process through MSC
    assert path == latest.path and saved.hidden_size == 64
    assert MultiStorageClientFeature.is_enabled() == before  # megatron-core's switch is back as it was

    _, log = torchrun(2, BASE + ["--load", paths.checkpoint_dir(root, 2)])
    assert "at iteration 2" in log and "(torch_dist)" in log, log[-3000:]
    assert losses(log) == {3: straight[3], 4: straight[4]}


@pytest.mark.parametrize("fmt, path, match", [
    ("torch_dist", "s3://{bucket}/run", "megatron-core reaches object stores through multi-storage-client only; "
                                        "use an msc:// profile for that bucket"),
    ("torch", "msc://tdist/run", "--ckpt-format torch writes local files"),
])
def test_what_torch_dist_and_torch_refuse_on_object_stores(s3_server, tmp_path, monkeypatch,
                                                           fmt, path, match):
    from megatron.training.arguments import ArgumentError, parse_args
    from megatron.training.argument_checks import validate_args
    bucket = _store(s3_server, tmp_path, monkeypatch, "tdist")
    args = parse_args(argv=BASE[:-2] + ["--ckpt-format", fmt, "--save", path.format(bucket=bucket)])
    with pytest.raises(ArgumentError, match=match):
        validate_args(args, world_size=2, cuda=False)


def test_disable_msc_turns_megatron_cores_switch_off():
    """Upstream's --disable-msc: megatron-core stops sending any path through multi-storage-client."""
    from megatron.core.msc_utils import MultiStorageClientFeature as feature
    from megatron.training.checkpointing.formats import disable_mcore_msc
    was = feature.is_enabled()
    feature.enable()
    try:
        disable_mcore_msc()
        assert not feature.is_enabled()
    finally:
        (feature.enable if was else feature.disable)()
