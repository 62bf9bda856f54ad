"""The real trainer (4 ranks under torchrun) killed as a whole job, verified, and resumed (tests/trainer_kills.py):
one kill of a dense run and one of a mixture-of-experts run here, as each trainer start costs ~20 s on a small CPU
machine; the long run is `python tests/trainer_kills.py --kills 200 [--moe]`."""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import trainer_kills  # noqa: E402


@pytest.mark.parametrize("model", [trainer_kills.DENSE, trainer_kills.MOE], ids=["dense-tp2dp2", "moe-ep2dp2"])
def test_whole_job_kill_verify_resume(tmp_path, model):
    """SIGKILL every process of the job after a checkpoint; `inspect_checkpoint --verify` passes on the latest
    published checkpoint, and the next run resumes at the iteration after it with the same losses."""
    c = trainer_kills.run_campaign(1, str(tmp_path), seed=0, train_iters=14, max_delay=1.5, model=model)
    table = c.table()
    assert not c.violations, "\n".join(c.violations) + "\n" + table
    assert c.stats["kills (whole job)"] == 1
    assert c.stats["processes killed"] >= trainer_kills.WORLD + 1  # torchrun and every worker
    assert c.stats["resumes verified (right iteration)"] == 2  # the killed run from scratch, the final one
    assert c.stats["latest checkpoints verified (inspect_checkpoint --verify)"] == 2
