"""The test launcher itself: a wait answers for the job it names, also once pids have wrapped; a job past its
timeout says where each of its processes was."""
from __future__ import annotations

import subprocess
import sys

import pytest

from rank_launcher import ROOT, Launcher, environment

NEXT_PID = "/proc/sys/kernel/ns_last_pid"  # the pid the kernel gave last: the next fork gets this + 1


def test_a_job_given_the_pid_of_an_earlier_one_is_waited_for(tmp_path):
    """pid_max is 32768 here, so a long suite reuses its jobs' pids. A job spawned with the pid of one that
    exited 0 must be waited for and give its own exit code and output, not the earlier one's (CI once saw a
    trainer job 'exit 0' with an empty log)."""
    launcher = Launcher.for_python(sys.executable)
    first, second = tmp_path / "first.py", tmp_path / "second.py"
    # os._exit: a job forked from the launcher takes seconds to finalize the interpreter torch is loaded in
    first.write_text("import os\nprint('first', flush=True)\nos._exit(0)\n")
    second.write_text("import os, time\ntime.sleep(0.5)\nprint('second', flush=True)\nos._exit(3)\n")

    def spawn(script, log):
        return launcher._call(op="spawn", nproc=None, script=str(script), args=[], env=environment(), cwd=ROOT,
                              log=str(log))["pid"]

    def wait(pid):
        return launcher._call(op="wait", pid=pid, timeout=60)["status"]

    reused = 0
    for attempt in range(60):  # 5 reuses: the old launcher answered about 4 waits in 5 wrongly here
        earlier = spawn(first, tmp_path / f"first_{attempt}.log")
        assert wait(earlier) == 0
        try:  # another process may fork in between: then the pid is another
            with open(NEXT_PID, "w") as f:
                f.write(str(earlier - 1))
        except OSError as e:
            pytest.skip(f"setting the next pid needs CAP_SYS_ADMIN or CAP_CHECKPOINT_RESTORE: {e}")
        log = tmp_path / f"second_{attempt}.log"
        pid = spawn(second, log)
        assert wait(pid) == 3, f"the job of pid {pid} (reused: {pid == earlier}) is answered for wrongly"
        assert log.read_text() == "second\n"
        reused += pid == earlier
        if reused == 5:
            break
    else:
        pytest.fail(f"only {reused} of 60 jobs got the pid of the job before")


def test_a_job_past_its_timeout_shows_every_rank_s_stacks(tmp_path):
    """A hang seen once in CI must say where it waited: the TimeoutExpired of a job killed past its timeout
    carries, and says, every thread's Python stack of each rank and of the job process."""
    script = tmp_path / "stuck.py"
    script.write_text("import time\n\n\ndef stuck_in_rank():\n    time.sleep(3600)\n\n\nstuck_in_rank()\n")
    with pytest.raises(subprocess.TimeoutExpired) as e:
        Launcher.for_python(sys.executable).run(2, str(script), [], environment(), ROOT, timeout=15)
    out = e.value.output
    assert out.count("in stuck_in_rank") == 2, out  # faulthandler's frame line, one per rank
    assert "in _supervise" in out, out  # the job process, waiting for its ranks
    assert "in stuck_in_rank" in str(e.value)  # what pytest shows of it
