"""--ckpt-fully-parallel-load through the trainer, 4 ranks TP2 x DP2 with the distributed optimizer: a resume
that reads each saved byte once (the model weights, replicated across DP, passed between the ranks) continues
bit for bit like the uninterrupted run, and its ranks together read no more than the checkpoint's data files
hold. (Every other resume test reads without the exchange, the default on a file system.)"""
import glob
import os
import re
import shutil

from megatron_helpers import TINY, iter_dir, losses, saving_run, torchrun

FLAGS = TINY + ["--tensor-model-parallel-size", "2", "--global-batch-size", "8", "--train-iters", "4",
                "--use-distributed-optimizer", "--log-all-ranks"]
READ_RE = re.compile(r"read ([\d,]+) B from storage in \d+ requests, ([\d,]+) B received from")


def test_resume_reading_each_byte_once(tmp_path):
    root = str(tmp_path / "ck")
    ref = saving_run(4, FLAGS, root, every=2, iterations=4)
    shutil.rmtree(iter_dir(root, 4))  # resume from iteration 2
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("2")
    _, log = torchrun(4, FLAGS + ["--load", root, "--ckpt-fully-parallel-load"])
    resumed = losses(log)
    assert {i: resumed[i] for i in (3, 4)} == {i: ref[i] for i in (3, 4)}, log[-3000:]
    counted = READ_RE.findall(log)
    assert len(counted) == 4 and all(int(received.replace(",", "")) > 0 for _, received in counted), log[-3000:]
    data = sum(os.path.getsize(f) for f in glob.glob(os.path.join(iter_dir(root, 2), "rank_*.data")))
    assert sum(int(n.replace(",", "")) for n, _ in counted) <= data
