"""The trainer on an object store: 4 ranks TP2 x DP2, bf16, distributed optimizer, the memory tier every iteration
and s3:// every 2 (written from the tier's pages), then an exact resume from s3:// saving to a file system, each
byte read once and passed on (the default for an object store); the checkpoints read whole onto one process (a
reshard) through the conversion tool's reader; the store killed in the middle of a save (training goes on with
--ckpt-on-failure warn, stops with stop) and the whole job killed in the middle of an upload
(tests/fault_launcher.py), an exact resume without the exchange; the Hugging Face tools to and from s3://; and refusals
that need no run."""
import os
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from datastates import paths, tracker
from hf_helpers import assert_round_trip, tiny_llama
from megatron_helpers import ROOT, TINY, losses, torchrun

BASE = TINY + ["--train-iters", "4", "--global-batch-size", "8", "--hidden-dropout", "0", "--attention-dropout", "0",
               "--bf16", "--use-distributed-optimizer", "--tensor-model-parallel-size", "2"]


def test_tp2_dp2_saves_to_s3_from_the_memory_tier_and_resumes_exactly(s3_server, tmp_path, monkeypatch):
    env = dict(s3_server.env(), DATASTATES_JOB_ID="s3-trainer", DATASTATES_RANKS_PER_NODE="2")
    for k, v in env.items():
        monkeypatch.setenv(k, v)  # this process reads the same store below
    bucket = s3_server.create_bucket()
    first, second = f"s3://{bucket}/first", str(tmp_path / "second")  # the resume crosses storages: s3:// -> disk
    _, log = torchrun(4, BASE + ["--save", first, "--save-interval", "2", "--async-ckpt",
                                 "--non-persistent-save-interval", "1",
                                 "--non-persistent-local-ckpt-dir", str(tmp_path / "mem")], env=env)
    straight = losses(log)
    assert sorted(straight) == [1, 2, 3, 4], log[-3000:]
    assert tracker.published_iterations(first) == [2, 4]

    _, log = torchrun(4, BASE + ["--load", f"{first}/iter_0000002", "--save", second, "--save-interval", "2",
                                 "--async-ckpt", "--log-all-ranks"], env=env)
    assert "at iteration 2" in log, log[-3000:]
    assert losses(log) == {3: straight[3], 4: straight[4]}
    # read once, passed on: on by default for an object store, so every rank received from its DP peer bytes it did
    # not read, and the ranks together read no more than the data objects hold
    counted = [(int(read.replace(",", "")), int(received.replace(",", ""))) for read, received in
               re.findall(r"read ([\d,]+) B from storage in \d+ requests, ([\d,]+) B received from", log)]
    assert len(counted) == 4 and all(received > 0 for _, received in counted), log[-3000:]
    bucket_objects = s3_server.client().list_objects_v2(Bucket=bucket, Prefix="first/iter_0000002/")["Contents"]
    assert sum(read for read, _ in counted) <= sum(o["Size"] for o in bucket_objects if o["Key"].endswith(".data"))

    sys.path.insert(0, os.path.join(ROOT, "tools"))
    from convert_checkpoint import main as convert, read_datastates
    from inspect_checkpoint import main as inspect
    assert inspect([first]) == 0 and inspect([second, "--verify"]) == 0  # every chunk's crc32c, read from s3://
    a, b = read_datastates(first, 4).tensors, read_datastates(second, 4).tensors  # TP2 x DP2 onto one process
    model = [k for k in a if not k.startswith("optimizer.")]  # the flat optimizer buckets' padding is not state
    assert a.keys() == b.keys() and model and [k for k in model if not torch.equal(a[k], b[k])] == []
    copy = f"s3://{bucket}/copy"  # the conversion tool from the file system to s3://
    assert convert(["--from", "datastates", "--input", second, "--to", "datastates", "--output", copy]) == 0
    c = read_datastates(copy, None).tensors
    assert c.keys() == b.keys() and [k for k in b if not same_bits(b[k], c[k])] == []


def same_bits(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Bit for bit, NaNs included (torch.equal says a NaN differs from itself: optimizer buckets may hold some)."""
    return x.dtype == y.dtype and x.shape == y.shape and torch.equal(x.reshape(-1).view(torch.uint8),
                                                                     y.reshape(-1).view(torch.uint8))


def faulted_run(store, control, nproc=2, **run):
    """A faulted run on `nproc` ranks (`run`: torchrun's arguments) whose FAULT_STORE_DOWN requests this thread
    serves: weed dies with the thread that started it (PR_SET_PDEATHSIG), so the job runs on another."""
    with ThreadPoolExecutor(1) as pool:
        job = pool.submit(torchrun, nproc, faults=True, check=False, **run)
        for request, act in (("store-down", store.stop), ("store-up", store.start)):
            while not os.path.exists(os.path.join(control, request)) and not job.done():
                time.sleep(0.05)
            if job.done():
                break
            act()
            open(os.path.join(control, request + ".done"), "w").close()
        try:
            return job.result()  # what the job's thread raised, raised here
        finally:
            if store.proc is None:
                store.start()


def stored(store, url):
    """(objects, open multipart uploads) under the prefix `url`."""
    bucket, _, prefix = url[len("s3://"):].partition("/")
    c = store.client()
    return ([o["Key"] for o in c.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", [])],
            [u["Key"] for u in c.list_multipart_uploads(Bucket=bucket, Prefix=prefix).get("Uploads", [])])


def test_store_killed_mid_save_and_job_killed_mid_upload(s3_server, tmp_path, monkeypatch):
    """DP2, a lazy save every iteration to s3://. Run A: the store dies while iteration 3's parts are going up
    and is back before the save of 5: the saves of 3 and 4 fail, --ckpt-on-failure warn keeps training, 5 and 6
    publish, and 2, published before, still loads. Run B resumes at 6 (removing what the failed save of 3 left)
    and the whole job is SIGKILLed while iteration 8's data is going up. Run C resumes exactly after 7, the last
    published, removing the open uploads, and computes B's loss of iteration 8 again, each rank reading all it
    needs itself (--no-ckpt-fully-parallel-load). Run D resumes at 8 with --ckpt-on-failure stop and the store
    dies in the save of 9: every rank stops at the same iteration, naming the failed checkpoint, and 8 stays
    the latest, whole."""
    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    root = f"s3://{s3_server.create_bucket()}/run"
    flags = TINY + ["--train-iters", "8", "--global-batch-size", "4", "--save", root, "--save-interval", "1",
                    "--async-ckpt", "--ckpt-on-failure", "warn"]
    control = str(tmp_path)
    rc, log = faulted_run(s3_server, control, args=flags + ["--exit-interval", "6"],
                          env={"FAULT_STORE_DOWN": "3:5", "FAULT_CONTROL_DIR": control, "AWS_MAX_ATTEMPTS": "2"})
    assert rc == 0 and "FAULT-STORE-DOWN" in log and sorted(losses(log)) == [1, 2, 3, 4, 5, 6], log[-4000:]
    for it in (3, 4):
        assert (f"checkpoint of iteration {it} failed, training goes on (--ckpt-on-failure warn); the last "
                f"published checkpoint is still 2") in log, log[-4000:]
    assert tracker.published_iterations(root) == [1, 2, 5, 6]
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    from inspect_checkpoint import main as inspect
    assert inspect([paths.checkpoint_dir(root, 2), "--verify"]) == 0

    rc, log = torchrun(2, flags + ["--load", root], faults=True, check=False,
                       env={"FAULT_KILL_JOB_IN_UPLOAD": "8"})
    assert rc != 0 and "FAULT-KILL-JOB" in log, log[-4000:]
    removed = [line for line in log.splitlines() if "removed the leftovers of an unfinished checkpoint" in line]
    assert removed and all("iter_0000003" in line for line in removed), log[-4000:]  # the store was down
    assert stored(s3_server, paths.checkpoint_dir(root, 3)) == ([], [])  # when the failed save of 3 ended
    killed = losses(log)
    assert sorted(killed) == [7, 8] and tracker.published_iterations(root)[-1] == 7, log[-4000:]
    assert stored(s3_server, paths.checkpoint_dir(root, 8))[1]  # the job died in the middle of its uploads

    _, log = torchrun(2, flags + ["--load", root, "--no-ckpt-fully-parallel-load", "--log-all-ranks"])
    assert "at iteration 7" in log and losses(log) == {8: killed[8]}, log[-4000:]
    assert "an open multipart upload" in log
    assert len(re.findall(r"read [\d,]+ B from storage in \d+ requests\n", log)) == 2, log[-4000:]  # no exchange
    assert tracker.published_iterations(root)[-2:] == [7, 8] and not stored(s3_server, root)[1]

    control = str(tmp_path / "stop")  # run A's requests are in the first one
    os.mkdir(control)
    rc, log = faulted_run(s3_server, control, args=flags + ["--load", root, "--train-iters", "12",
                                                             "--ckpt-on-failure", "stop", "--log-all-ranks"],
                          env={"FAULT_STORE_DOWN": "9:99", "FAULT_CONTROL_DIR": control, "AWS_MAX_ATTEMPTS": "2"})
    stops = re.findall(r"rank (\d): stopping at iteration (\d+): a checkpoint failed \(--ckpt-on-failure stop\)", log)
    assert rc != 0 and "FAULT-STORE-DOWN" in log and sorted(rank for rank, _ in stops) == ["0", "1"], log[-4000:]
    (stopped,) = {int(it) for _, it in stops}  # the same on both ranks, and no step trained after it
    assert 9 <= stopped <= 12 and max(losses(log)) <= stopped, log[-4000:]
    # the error names a checkpoint the store's death failed: 9, or 10 when its call, refused, is recorded first
    assert re.search(r"CheckpointError: [^\n]*iter_00000(09|10)", log), log[-4000:]
    assert tracker.read_latest(root) == 8 and inspect([paths.checkpoint_dir(root, 8), "--verify"]) == 0


def test_hf_import_to_s3_and_export_from_s3_are_bit_exact(s3_server, tmp_path, monkeypatch, capsys):
    """--from hf with an s3:// --output, then --to hf with it as --input to a local directory and, in this process,
    to an s3:// --output (as the trainer's --save-hf writes there): the same bytes, file for file. A transformers
    model is read from a file system only (safetensors' reader), and torch_dist lives on file systems only."""
    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    source = str(tmp_path / "source")
    tiny_llama(source, vocab=100)
    bucket = s3_server.create_bucket()
    ckpt = f"s3://{bucket}/ckpt"
    assert_round_trip(source, str(tmp_path), 100, ckpt=ckpt)
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    from convert_checkpoint import main as convert
    assert convert(["--from", "datastates", "--input", ckpt, "--to", "hf", "--output", f"{ckpt}-hf",
                    "--max-shard-size", "50000"]) == 0
    local = str(tmp_path / "local")
    assert convert(["--from", "datastates", "--input", ckpt, "--to", "hf", "--output", local,
                    "--max-shard-size", "50000"]) == 0
    client = s3_server.client()
    objects = {o["Key"][len("ckpt-hf/"):]: o["Key"] for o in
               client.list_objects_v2(Bucket=bucket, Prefix="ckpt-hf/")["Contents"]}
    assert sorted(objects) == sorted(os.listdir(local)) and len(objects) > 3, objects  # several safetensors files
    for name, key in objects.items():
        with open(os.path.join(local, name), "rb") as f:
            assert client.get_object(Bucket=bucket, Key=key)["Body"].read() == f.read(), name
    capsys.readouterr()
    assert convert(["--from", "datastates", "--input", ckpt, "--to", "hf", "--output", f"{ckpt}-hf"]) == 1
    assert f"output '{ckpt}-hf' already exists and is not empty" in capsys.readouterr().err
    assert convert(["--from", "hf", "--input", f"{ckpt}-hf", "--to", "datastates", "--output", f"{ckpt}-2"]) == 1
    assert f"--input '{ckpt}-hf': hf is read from a file system only" in capsys.readouterr().err
    assert convert(["--from", "datastates", "--input", ckpt, "--to", "torch_dist", "--output", f"{ckpt}-td"]) == 1
    assert f"--output '{ckpt}-td': torch_dist is read and written on a file system only" in capsys.readouterr().err


@pytest.mark.parametrize("flags, match", [
    (["--ckpt-format", "torch_dist"], "through multi-storage-client only; use an msc:// profile"),
    (["--disable-msc"], None),
])
def test_what_an_object_store_refuses_before_any_work(s3_server, monkeypatch, flags, match):
    from megatron.training.arguments import ArgumentError, parse_args
    from megatron.training.argument_checks import validate_args
    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    save = "msc://nowhere/run" if "--disable-msc" in flags else f"s3://{s3_server.create_bucket()}/run"
    args = parse_args(argv=BASE + ["--save", save] + flags)
    with pytest.raises(ArgumentError, match=match or "disabled by --disable-msc"):
        validate_args(args, world_size=4, cuda=False)
