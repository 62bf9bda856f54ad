"""Fine-tuning from what others wrote: a GPTModel saved by stock megatron-core (`dist_checkpointing.save` of the
model's sharded state dict, weights only), loaded by the trainer with --finetune, as is (torch_dist) and after
tools/convert_checkpoint.py made a datastates checkpoint of it. The trainer's first loss must equal that model's
loss on the same batch (one rank, dropout 0: the same computation, compared bit for bit), and up to rounding
when loaded into TP2; upstream's --pretrained-checkpoint (with --ckpt-step) does the same. Without --finetune the
trainer refuses, naming the flag, before training."""
import math
import re

from megatron_helpers import TINY, losses, torchrun
from rank_launcher import run_python

FLAGS = TINY + ["--global-batch-size", "4", "--train-iters", "4", "--hidden-dropout", "0",
                "--attention-dropout", "0", "--make-vocab-size-divisible-by", "64"]


def _run(cmd: list[str]) -> str:
    rc, out = run_python(*cmd, timeout=240)
    assert rc == 0, out[-4000:]
    return out


def test_finetune_from_a_stock_megatron_core_model(tmp_path):
    stock = str(tmp_path / "stock" / "iter_0000000")
    out = _run(["tests/stock_gpt.py", stock, "--init-seed", "999", *FLAGS])
    stock_loss = re.search(r"STOCK-LOSS (\S+)", out).group(1)
    converted = str(tmp_path / "converted")
    _run(["tools/convert_checkpoint.py", "--from", "torch_dist", "--to", "datastates", "--input", stock,
          "--output", converted])

    rc, log = torchrun(1, FLAGS + ["--load", stock, "--exit-interval", "1"], check=False)
    assert rc != 0 and "has no iteration and no train_state" in log and "pass --finetune" in log, log[-3000:]
    assert not losses(log)

    # upstream's fine-tuning flags: --pretrained-checkpoint when --load holds nothing yet, --ckpt-step its iteration
    for source in (["--load", stock, "--finetune", "--no-load-optim", "--no-load-rng"],
                   ["--load", str(tmp_path / "ck"), "--pretrained-checkpoint", converted, "--ckpt-step", "0"]):
        _, log = torchrun(1, FLAGS + source + ["--exit-interval", "1"])
        assert "for fine-tuning from iteration 0" in log, log[-3000:]
        assert ("holds no checkpoint: fine-tuning from --pretrained-checkpoint" in log) == \
            ("--pretrained-checkpoint" in source), log[-3000:]
        assert losses(log)[1] == stock_loss, (source, losses(log), stock_loss)

    # into another layout (the vocabulary padded alike: 128 rows at TP1 and TP2): TP2 sums the same products in
    # another order, so equal up to float rounding
    _, log = torchrun(2, FLAGS + ["--load", converted, "--finetune", "--tensor-model-parallel-size", "2",
                                  "--exit-interval", "1"])
    assert math.isclose(float(losses(log)[1]), float(stock_loss), rel_tol=1e-5), (losses(log), stock_loss)
