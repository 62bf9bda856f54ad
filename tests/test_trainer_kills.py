"""The real trainer (4 ranks under torchrun) killed as a whole job, verified, and resumed (tests/trainer_kills.py):
one kill here, as each trainer start costs ~20 s on a small CPU machine; the long run is
`python tests/trainer_kills.py --kills 200`."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import trainer_kills  # noqa: E402


def test_whole_job_kill_verify_resume(tmp_path):
    c = trainer_kills.run_campaign(1, str(tmp_path), seed=0, train_iters=20, max_delay=1.5)
    table = c.table()
    assert not c.violations, "\n".join(c.violations) + "\n" + table
    assert c.stats["kills (whole job)"] == 1
    assert c.stats["processes killed"] >= trainer_kills.WORLD + 1  # torchrun and every worker
    assert c.stats["resumes verified (right iteration)"] == 2  # the killed run from scratch, the final one
    assert c.stats["latest checkpoints verified (inspect_checkpoint --verify)"] == 2
