"""The host staging of a rank's engine is sized to its checkpoint: all of it by default, within half of the node's
available memory over the ranks on the node, or within --ckpt-host-buffer-gb; smaller than the checkpoint, a
NOTICE says what it costs (in-process: a real model's parameters, the node's real /proc/meminfo)."""
import logging

import torch

from megatron.training.arguments import parse_args
from megatron.training.checkpointing.formats import staging_bytes
from megatron.training.checkpointing.state import saved_bytes_bound

MODEL = [torch.nn.Linear(512, 512), torch.nn.Linear(512, 512)]  # 2 MiB of fp32 parameters
NOTICE = "NOTICE: host staging is"


def test_staging_holds_the_whole_checkpoint_by_default(caplog):
    args = parse_args(argv=[])
    want = saved_bytes_bound(args, MODEL) * 11 // 10 + (64 << 20)
    with caplog.at_level(logging.INFO):
        assert staging_bytes(args, MODEL) == want
    assert NOTICE not in caplog.text


def test_the_flag_caps_it_and_a_notice_says_what_that_costs(caplog):
    args = parse_args(argv=["--ckpt-host-buffer-gb", "0.03"])
    with caplog.at_level(logging.INFO):
        assert staging_bytes(args, MODEL) == int(0.03 * (1 << 30))
    assert "NOTICE: host staging is 0.03 GiB per rank (--ckpt-host-buffer-gb) where this rank's checkpoint needs " \
           "0.07 GiB: each snapshot copies the rest only as storage frees staging" in caplog.text


def test_the_nodes_memory_over_its_ranks_bounds_it(caplog, monkeypatch):
    """So many ranks on this node that half of its available memory over them is less than the checkpoint."""
    ranks = 1 << 20
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(ranks))
    args = parse_args(argv=[])
    with caplog.at_level(logging.INFO):
        staged = staging_bytes(args, MODEL)
    with open("/proc/meminfo") as f:
        available = next(int(line.split()[1]) << 10 for line in f if line.startswith("MemAvailable:"))
    assert abs(staged - available // 2 // ranks) <= (1 << 30) // 2 // ranks  # the node's memory moved a little
    assert "of the node's" in caplog.text and f"available memory over its {ranks} ranks" in caplog.text
