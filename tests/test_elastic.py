"""A node lost for good, and a node that joins, inside one elastic torchrun job. The loss: two real torchrun agents on this machine as two nodes of
2 ranks under one c10d rendezvous (`--nnodes 1:2`, a store the test hosts, `--max-restarts 3`), TP2 with the
distributed optimizer, the memory tier every iteration with replication factor 2, each node its own tier directory.

After its memory checkpoint of iteration 7 is held everywhere, node 1's ranks SIGKILL their agent and themselves
(tests/fault_launcher.py, FAULT_KILL_NODE_AFTER_LOCAL). Node 0's ranks fail in iteration 8, its agent re-forms the
job alone, and the trainer goes on as TP2 x DP1 with 4 micro-batches a step instead of 2 (the global batch kept),
replication off (said in one line), from the memory tier's iteration 7 (storage has 5): node 0's own parts and
its replicas of node 1's, set apart in the old layout and read into the new one like a storage checkpoint.
Checked: the resume line, that every sample index after the shrink is the one the uninterrupted run reads in that
iteration (none skipped or repeated), and that every loss after it equals that of a plain 2-rank run that loads
iteration 7, saved to storage by a 4-rank run, into the same new layout.

The same loss of node 0, the node that started first, under a rendezvous on etcd (tests/etcd_server.py), which
no node hosts: the survivor, renumbered node 0, goes on alike. A c10d rendezvous hosted by an agent cannot lose
that node (docs/restarts.md).
"""
import datetime
import os
import re
import subprocess
import sys
import time

import pytest
import torch.distributed as dist

from megatron_helpers import ROOT, TINY, losses, torchrun
from rank_launcher import environment
from trainer_kills import kill_tree

ITERS, GBS, MBS, KILLED_AFTER, STORAGE_EVERY = 12, 8, 2, 7, 5
FLAGS = TINY + ["--global-batch-size", str(GBS), "--train-iters", str(ITERS), "--tensor-model-parallel-size", "2",
                "--use-distributed-optimizer"]
SAMPLES_RE = re.compile(r"FAULT-SAMPLES rank (\d+) attempt (\d+): ([\d ]+)")


def _agent(node: int, endpoint: str, flags: list[str], work: str, faults: dict | None = None,
           rdzv_conf: str = "is_host=false", backend: str = "c10d") -> tuple[subprocess.Popen, str]:
    """One node: a torchrun agent of 2 ranks joining the rendezvous at `endpoint` (the test's c10d store, or an
    etcd), with a memory tier directory of its own; (the agent, its log), every worker's output in that log."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc_per_node", "2",
           "--rdzv-backend", backend, "--rdzv-endpoint", endpoint, "--rdzv-id", "elastic-test",
           "--rdzv-conf", rdzv_conf, "--max-restarts", "3", os.path.join(ROOT, "tests", "fault_launcher.py"),
           *flags, "--non-persistent-local-ckpt-dir", os.path.join(work, f"mem{node}")]
    env = environment({"DATASTATES_JOB_ID": "elastic-test", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
                       "FAULT_LOG_SAMPLES": "1",
                       **({"FAULT_KILL_NODE_AFTER_LOCAL": f"1:{KILLED_AFTER}"} if faults is None else faults)})
    log = os.path.join(work, f"agent{node}.log")
    with open(log, "w") as out:
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True), log


def c10d_store() -> tuple[dist.TCPStore, str]:
    """A c10d rendezvous store that neither node holds, hosted by this process (no port probed and released):
    (the store, its endpoint)."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, multi_tenant=True, timeout=datetime.timedelta(seconds=60))
    return store, f"127.0.0.1:{store.port}"


def _elastic_job(work: str, flags: list[str], endpoint: str, killed: int = 1, backend: str = "c10d",
                 rdzv_conf: str = "is_host=false", timeout: float = 400) -> tuple[int, str, str]:
    """(which agent survived, its log, the lost node's log) of the two agents' job, agent 0 started first, whose
    node `killed` (torchrun's GROUP_RANK) is lost after iteration 7; past `timeout` every process is killed."""
    faults = {"FAULT_KILL_NODE_AFTER_LOCAL": f"{killed}:{KILLED_AFTER}"}
    agents = [_agent(node, endpoint, flags, work, faults, rdzv_conf, backend) for node in range(2)]
    codes = []
    for proc, _ in agents:
        try:
            codes.append(proc.wait(timeout=timeout))
        except subprocess.TimeoutExpired:
            for p, _ in agents:
                kill_tree(p.pid)
            raise AssertionError(f"the elastic job did not end within {timeout} s: logs in {work}") from None
    texts = [open(log).read() for _, log in agents]
    lost = [i for i, text in enumerate(texts) if "FAULT-KILL-NODE" in text]  # which agent became node `killed`
    assert len(lost) == 1, texts
    survivor = 1 - lost[0]
    assert (codes[survivor], codes[lost[0]]) == (0, -9), (codes, texts[survivor][-6000:])
    return survivor, texts[survivor], texts[lost[0]]


def _per_iteration(log: str, rank: int, attempt: int, first: int, per_step: int) -> dict[int, list[int]]:
    """iteration -> the sample indices `rank` read in it in `attempt`, from iteration `first` on."""
    batches = [list(map(int, m.group(3).split())) for m in SAMPLES_RE.finditer(log)
               if (int(m.group(1)), int(m.group(2))) == (rank, attempt)]
    return {first + k // per_step: sum(batches[k - k % per_step:k - k % per_step + per_step], [])
            for k in range(0, len(batches), per_step)}


@pytest.fixture(scope="module")
def shrink_reference(tmp_path_factory) -> tuple[dict, dict]:
    """(the losses of iterations 1-7 of a 4-rank run that saves iteration 7 to storage, the losses of a 2-rank
    run loading it into TP2 x DP1): what a shrink after iteration 7 must print, whichever node is lost."""
    ref = str(tmp_path_factory.mktemp("shrink_reference"))
    _, ref_log = torchrun(4, FLAGS + ["--save", ref, "--save-interval", "100", "--exit-interval", str(KILLED_AFTER)])
    before = losses(ref_log)
    _, ref_log = torchrun(2, FLAGS + ["--load", ref])
    after = losses(ref_log)
    assert sorted(after) == list(range(KILLED_AFTER + 1, ITERS + 1)), ref_log[-3000:]
    return before, after


def _assert_shrunk_exactly(work: str, survivor: int, log: str, lost: str, reference: tuple[dict, dict]) -> None:
    """The survivor's job went on as TP2 x DP1 from the memory tier's iteration 7, read into the new layout, at the
    exact sample, with the reference's losses bit for bit."""
    assert lost.count(f"after the memory checkpoint of iteration {KILLED_AFTER}") == 2, lost[-3000:]
    assert re.search(rf"RankFailure: rank \d: iteration {KILLED_AFTER + 1} did not finish: another rank died",
                     log), log[-6000:]
    assert "> world size 2: tensor-parallel 2, pipeline-parallel 1, data-parallel 1, 4 micro-batch(es)" in log
    # replication follows the world, said once (rank 0), and never fails the restart
    assert log.count("NOTICE: replication follows the world") == 1 and \
        "NOTICE: replication follows the world: 1 node of 2 ranks present, too few for --replication-factor 2 x " \
        "--replication-jump 2: no replication (storage holds what a lost node held)" in log, log[-6000:]
    resumed = re.findall(r"RESUMED from (.+?) at iteration (\d+), saved [\d.]+ s ago \((.*?)\); torchrun restart "
                         r"(\d) of 3: (\S+)", log)
    assert len(resumed) == 1 and resumed[0][:4] == ("the memory tier", str(KILLED_AFTER), "storage's newest: 5, "
                                                    "saved in TP2xPP1xDP2 of world size 4", "1"), log[-6000:]
    assert resumed[0][4] == os.path.join(work, f"mem{survivor}", "elastic-test", "before", "node_00000", "merged",
                                         f"iter_{KILLED_AFTER:07d}"), resumed
    assert f"resharded checkpoint {resumed[0][4]} from TP2xPP1xDP2 to TP2xPP1xDP1" in log
    # the parts set apart went with the rest of the tier when the job finished
    assert os.listdir(os.path.join(work, f"mem{survivor}")) == [], os.listdir(os.path.join(work, f"mem{survivor}"))
    assert f"> training done at iteration {ITERS}" in log

    # the data position: every iteration after the shrink reads, on its one DP rank (both TP ranks alike), the
    # samples the uninterrupted DP2 run reads in it (global ranks 0 and 2 before the kill, on either node)
    after = _per_iteration(log, 0, 1, KILLED_AFTER + 1, GBS // MBS)
    assert after == _per_iteration(log, 1, 1, KILLED_AFTER + 1, GBS // MBS)
    assert sorted(after) == list(range(KILLED_AFTER + 1, ITERS + 1)), after
    both = log + lost
    before = {it: sorted(a + b) for (it, a), b in zip(_per_iteration(both, 0, 0, 1, GBS // MBS // 2).items(),
                                                      _per_iteration(both, 2, 0, 1, GBS // MBS // 2).values())}
    for it, samples in after.items():
        assert samples == list(range((it - 1) * GBS, it * GBS)), (it, samples)  # no sample skipped or repeated
        if it in before:  # iteration 8 was in flight at DP2 when the node died
            assert sorted(samples) == before[it], (it, samples, before[it])

    # every loss before the loss is the reference 4-rank run's, every loss after it the 2-rank run's that loads
    # iteration 7 from storage into TP2 x DP1
    printed = {**losses(lost), **losses(log)}  # the last rank prints them: node 1's before the loss, the survivor's
    assert {it: loss for it, loss in printed.items() if it <= KILLED_AFTER} == reference[0], printed
    assert {it: loss for it, loss in printed.items() if it > KILLED_AFTER} == reference[1], (printed, reference[1])


def test_a_node_lost_for_good_the_survivor_goes_on_as_dp1_at_the_exact_sample(tmp_path, shrink_reference):
    work, ck = str(tmp_path), str(tmp_path / "ck")
    flags = FLAGS + ["--save", ck, "--load", ck, "--save-interval", str(STORAGE_EVERY), "--async-ckpt",
                     "--non-persistent-save-interval", "1", "--replication", "--replication-factor", "2"]
    store, endpoint = c10d_store()
    survivor, log, lost = _elastic_job(work, flags, endpoint)
    _assert_shrunk_exactly(work, survivor, log, lost, shrink_reference)


def test_the_first_node_lost_under_etcd_the_survivor_renumbered_goes_on_from_memory(tmp_path, shrink_reference):
    """The rendezvous on a service no node hosts, etcd (torchrun's etcd-v2 backend), and the node lost the one
    that started first and is node 0: under a c10d rendezvous hosted by an agent, the node holding the store, and
    here the node whose rank 0 holds the workers' own store. The other node's agent re-forms the job alone through
    etcd, as node 0 now: its machine takes the parts it held as node 1 as node 0's, and the job goes on as in the
    node-1 loss, exactly."""
    from etcd_server import EtcdServer
    work, ck = str(tmp_path), str(tmp_path / "ck")
    flags = FLAGS + ["--save", ck, "--load", ck, "--save-interval", str(STORAGE_EVERY), "--async-ckpt",
                     "--non-persistent-save-interval", "1", "--replication", "--replication-factor", "2"]
    with EtcdServer(work) as etcd:
        survivor, log, lost = _elastic_job(work, flags, etcd.endpoint, killed=0, backend="etcd-v2",
                                           rdzv_conf="keep_alive_interval=1")
    # node 0 is the lowest of the nodes' (address, pid): on one machine the agent started first
    assert survivor == 1, (survivor, log[-6000:])
    assert f"NOTICE: memory tier {os.path.join(work, 'mem1', 'elastic-test', 'node_00001')}: the parts this " \
           f"machine held as node 1 are node 0's now" in log, log[-6000:]
    _assert_shrunk_exactly(work, survivor, log, lost, shrink_reference)


def test_a_node_that_joins_grows_the_job_to_dp2_from_the_memory_tier(tmp_path):
    """One agent (node A) trains as TP2 x DP1; after its memory checkpoint of iteration 7 its ranks wait, a second
    agent (node B, an empty tier directory) joins, and A's agent restarts its workers into one job of both nodes:
    TP2 x DP2, 2 micro-batches a step, from the memory tier's iteration 7 (A's parts of the old layout, sent to B,
    resharded), whichever number the rendezvous gives each node. Checked as the shrink is: the resume line, every
    sample index after the growth, and the losses against a run loading iteration 7 from storage into DP2."""
    work, ck = str(tmp_path), str(tmp_path / "ck")
    flags = FLAGS + ["--save", ck, "--load", ck, "--save-interval", str(STORAGE_EVERY), "--async-ckpt",
                     "--non-persistent-save-interval", "1", "--replication", "--replication-factor", "2"]
    store, endpoint = c10d_store()
    conf = "is_host=false,last_call_timeout=2"
    grown = KILLED_AFTER
    first, first_log = _agent(0, endpoint, flags, work, {"FAULT_WAIT_AFTER_LOCAL": f"2:{grown}"}, conf)
    agents = [(first, first_log)]
    try:
        deadline = time.monotonic() + 300
        while "FAULT-WAIT" not in open(first_log).read():
            assert first.poll() is None and time.monotonic() < deadline, open(first_log).read()[-6000:]
            time.sleep(0.5)
        agents.append(_agent(1, endpoint, flags, work, {}, conf))
        codes = [proc.wait(timeout=400) for proc, _ in agents]
    finally:
        for proc, _ in agents:
            if proc.poll() is None:
                kill_tree(proc.pid)
    logs = [open(log).read() for _, log in agents]
    assert codes == [0, 0], (codes, logs[0][-6000:], logs[1][-6000:])
    log = logs[0] + logs[1]
    assert "> world size 2: tensor-parallel 2, pipeline-parallel 1, data-parallel 1, 4 micro-batch(es)" in log
    assert "> world size 4: tensor-parallel 2, pipeline-parallel 1, data-parallel 2, 2 micro-batch(es)" in log
    resumed = re.findall(r"RESUMED from (.+?) at iteration (\d+), saved [\d.]+ s ago \((.*?)\); torchrun restart "
                         r"(\d) of 3: (\S+)", log)
    assert resumed and {r[:2] for r in resumed} == {("the memory tier", str(grown))}, log[-6000:]
    assert re.search(rf"resharded checkpoint \S+/merged/iter_{grown:07d} from TP2xPP1xDP1 to TP2xPP1xDP2", log), \
        log[-6000:]
    assert re.search(r"rank \d: memory checkpoint of iteration 7 of rank [01] recovered from rank \d's replica", log), \
        log[-6000:]
    # every iteration after the growth reads its samples once, over both DP ranks (no sample skipped or repeated);
    # a restart for a joining node keeps torchrun's restart count: a rank's last micro-batches are the grown job's
    samples = {}
    for m in SAMPLES_RE.finditer(log):
        samples.setdefault(int(m.group(1)), []).append(list(map(int, m.group(3).split())))
    assert sorted(samples) == [0, 1, 2, 3], sorted(samples)
    per_dp = GBS // MBS // 2
    after = {r: batches[-(ITERS - grown) * per_dp:] for r, batches in samples.items()}
    for it in range(grown + 1, ITERS + 1):
        k = (it - grown - 1) * per_dp
        read = sorted(sum((sum(batches[k:k + per_dp], []) for batches in after.values()), []))
        assert read == sorted(list(range((it - 1) * GBS, it * GBS)) * 2), (it, read)  # each DP rank's TP pair
    # every loss after the growth equals that of a 4-rank run loading iteration 7, saved to storage by a 2-rank run
    ref = str(tmp_path / "ref")
    _, ref_log = torchrun(2, FLAGS + ["--save", ref, "--save-interval", "100", "--exit-interval", str(grown)])
    _, ref_log = torchrun(4, FLAGS + ["--load", ref])
    expected = losses(ref_log)
    assert sorted(expected) == list(range(grown + 1, ITERS + 1)), ref_log[-3000:]
    assert {it: loss for it, loss in losses(log).items() if it > grown} == expected, (losses(log), expected)
