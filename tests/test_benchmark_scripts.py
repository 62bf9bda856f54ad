"""Every benchmark script's quick mode (benchmarks/README.md, "Quick modes"), run as a user runs it, with its
output checked: the result files and tables hold the rows and figures a full run's would, only smaller. So a
refactor cannot break a benchmark unseen (memory_tier.py once died after its loops with no test to see it).

In-process through `main(argv)` where a script allows it; as a process where it spawns workers that import it
by name (read_once.py, worker.py), reads its argv itself (gpu_figures.py), or sets the AWS variables of the
SeaweedFS it starts in its own environment (compression.py --engine, object_store*.py). A script is skipped
only where it needs an optional package this venv lacks, named in the skip (matplotlib draws the figures of
run_all.py, report.py and scale.py; object_store.py's peers need s3fs and s3torchconnector).

The scripts that start the trainer or a campaign of several systems (run_all, read_once and the compression
measurements on its checkpoint, memory_tier, restart, trainer_syscalls, hf_export, and scale's simulated world
of 16 with its torch_dist peer) take about 6 minutes in all on a 2-core machine, beyond CI's budget: they run
with DS_TEST_ALL_BENCHMARKS=1.
"""
import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmarks")
NUM = r"(\d+\.\d+)"
# the scripts that start the trainer or a whole campaign: minutes, so behind a flag
slow = pytest.mark.skipif(os.environ.get("DS_TEST_ALL_BENCHMARKS") != "1",
                          reason="starts the trainer or a campaign several times (minutes): DS_TEST_ALL_BENCHMARKS=1")


def script(name):
    """benchmarks/<name>.py imported as a module (its `main(argv)` then runs in this process)."""
    if BENCH not in sys.path:
        sys.path.insert(0, BENCH)  # the scripts import their helpers (common, syscalls, deps) by name
    spec = importlib.util.spec_from_file_location(f"bench_{name}", os.path.join(BENCH, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(name, *args, timeout=600):
    """benchmarks/<name>.py as a process; its output (stdout and stderr), having checked it exited 0."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
               PYTHONWARNINGS="ignore")
    r = subprocess.run([sys.executable, os.path.join(BENCH, f"{name}.py"), *map(str, args)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"{name}.py exited {r.returncode}:\n{(r.stdout + r.stderr)[-4000:]}"
    return r.stdout + r.stderr


def table_rows(text, first_cell):
    """The Markdown table rows whose first cell is `first_cell`, as lists of cells."""
    return [[c.strip() for c in line.strip().strip("|").split("|")] for line in text.splitlines()
            if line.startswith(f"| {first_cell} |")]


@pytest.fixture(scope="module")
def worker_out(tmp_path_factory):
    """worker.py on one small configuration, as run_all.py --quick starts it (save, restore and loop phases)."""
    out = tmp_path_factory.mktemp("worker")
    cfg = {"tag": "s0p01gb_r1", "size_gb": 0.01, "ranks": 1, "port": 0, "ckpt_dir": str(out / "ckpt"),
           "out": str(out), "systems": ["torch_save", "engine_sync", "engine_lazy"], "warmup": 1, "reps": 1,
           "restore_reps": 1, "engine_buffer_bytes": 64 << 20, "engine_writer_threads": 2, "loop_iters": 2,
           "loop_compute_s": 0.05, "loop_intervals": [1], "loop_rounds": 1, "loop_systems": None, "device": "cpu",
           "raw_reads": ["stream"]}
    from s3_store import ClaimedPorts
    with ClaimedPorts(1) as port:
        cfg["port"] = port.numbers[0]
        run("worker", json.dumps(cfg))
    return out


def test_worker(worker_out):
    with open(worker_out / "raw" / "s0p01gb_r1.json") as f:
        res = json.load(f)
    assert not res["errors"], res["errors"]
    assert set(res["save"]) == {"torch_save", "engine_sync", "engine_lazy"}
    for name, rec in res["save"].items():
        assert rec["durable_s"]["median"] > 0, (name, rec)
        assert res["restore"][name]["verified"] is True, (name, res["restore"][name])
    assert res["restore_raw"], "no raw read yardstick"
    assert {r["system"] for r in res["loop"]["runs"] if r.get("total_s")} == set(res["save"])
    assert res["loop"]["baseline_s"] > 0
    floor_inputs = res["loop"]["floor_inputs"]
    assert floor_inputs["copy_s"] > 0 and floor_inputs["write_s"] > 0
    for r in res["loop"]["runs"]:  # the floor holds the last checkpoint's drain at least; each run held its own
        assert r["floor_s"] >= res["loop"]["baseline_s"] + max(floor_inputs.values()), r
        assert r["drain_s"] > 0 and r["blocked_s"] == r["fence_s"] + r["call_s"] + r["wait_s"], r


def test_gpu_figures(worker_out, tmp_path):
    """The GPU check's line from two run_all outputs (here the same CPU one twice): both engine modes saved,
    the lazy engine's checkpoint loaded back bit for bit, its loop ran."""
    out = run("gpu_figures", worker_out, worker_out, "--json", tmp_path / "figures.json")
    assert "SUMMARY PASS" in out, out
    with open(tmp_path / "figures.json") as f:
        fig = json.load(f)
    assert fig["systems"]["engine_lazy"]["restored_bit_exact"] is True
    assert fig["systems"]["engine_lazy"]["loop_ratio"] > 0 and fig["systems"]["engine_lazy"]["loop_floor_ratio"] > 0
    assert fig["systems"]["engine_lazy"]["snapshot_first_gbps"] > 0
    assert fig["large"]["restored_bit_exact"] is True


def test_report(worker_out, tmp_path):
    pytest.importorskip("matplotlib", reason="report.py draws its figures with matplotlib (the bench extra)")
    md = tmp_path / "RESULTS.md"
    script("report").main(["--out", str(worker_out), "--results-md", str(md)])
    with open(worker_out / "results.csv") as f:
        csv = f.read()
    assert all(name in csv for name in ("torch_save", "engine_sync", "engine_lazy")), csv
    assert "## Side by side" in md.read_text()
    assert os.listdir(worker_out / "figures")


@slow
def test_run_all(tmp_path):
    pytest.importorskip("matplotlib", reason="run_all.py requires matplotlib (the bench extra) for its figures")
    run("run_all", "--quick", "--systems", "engine_sync,engine_lazy,torch_save", "--out", tmp_path)
    with open(tmp_path / "results.json") as f:
        rows = json.load(f)
    assert {"engine_sync", "engine_lazy", "torch_save"} <= {r["system"] for r in rows}, rows
    assert (tmp_path / "RESULTS.md").exists() and (tmp_path / "results.csv").exists()


def test_backpressure(tmp_path, capsys):
    assert script("backpressure").main(["--quick", "--dir", str(tmp_path / "bp")]) == 0
    out = capsys.readouterr().out
    assert "5 saves back to back" in out, out
    assert json.loads(out.strip().splitlines()[-1]) == {
        "no deadlock": True, "staging <= budget": True, "RSS bounded": True, "published in order": True,
        "latest bit-exact": True}


@pytest.fixture(scope="module")
def read_once_out(tmp_path_factory):
    """read_once.py --quick; its checkpoint (bf16 weights, fp32 main params and Adam moments through
    megatron-core's ShardedTensors) is what compression.py reads below."""
    d = tmp_path_factory.mktemp("read_once")
    return d, run("read_once", "--quick", "--dir", d)


@slow
def test_read_once(read_once_out):
    _, out = read_once_out
    rows = {r[1]: r for r in table_rows(out, "2")}
    assert set(rows) == {"off", "on"}, out
    # with the exchange every byte is read from storage once; without, the replicated weights twice
    assert float(rows["on"][5]) == pytest.approx(1.0, abs=0.01), rows
    assert float(rows["off"][5]) > 1.05, rows


@slow
def test_compression(read_once_out, tmp_path, capsys):
    ckpt = read_once_out[0] / "w2" / "iter_0000001"
    script("compression").main([str(ckpt), "--quick", "--json", str(tmp_path / "c.json")])
    with open(tmp_path / "c.json") as f:
        rows = json.load(f)
    kinds = {r["kind"] for r in rows}
    assert {"bf16 weights", "fp32 main params", "Adam exp_avg (fp32)", "Adam exp_avg_sq (fp32)", "all"} <= kinds
    engine = {r["kind"]: r for r in rows if r["codec"] == "bytegroup-zstd (engine)"}
    assert engine["bf16 weights"]["ratio"] > 1.1 and engine["all"]["compress_gbps"] > 0, engine


@slow
def test_compression_engine(read_once_out):
    out = run("compression", read_once_out[0] / "w2" / "iter_0000001", "--quick", "--engine", "--link-mbps", "400")
    levels = ("file system", "memory tier", "SeaweedFS", "link of 400 MB/s to SeaweedFS")
    rows = {(r[0], r[1]): r for level in levels for r in table_rows(out, level)}
    assert set(rows) == {(s, c) for s in levels for c in ("off", "bytegroup-zstd")}, out
    for (_, compress), r in rows.items():
        assert (float(r[3]) > 1.05) == (compress != "off"), r  # stored fewer bytes only when compressed
        assert all(float(x) > 0 for x in r[4:]), r


def test_object_store_raw():
    out = run("object_store_raw", "--quick")
    for client in ("boto3", "s3transfer", "msc"):  # the others are reported as failed where not installed
        assert re.search(rf"^{client}\s+{NUM}\s+{NUM}$", out, re.M), out


def test_object_store():
    for module in ("s3fs", "s3torchconnector"):
        pytest.importorskip(module, reason=f"object_store.py's peers need {module}, not installed here")
    out = run("object_store", "--quick")
    for name in ("raw multipart PUT / ranged GET (boto3)", "datastates lazy", "datastates sync"):
        assert re.search(rf"^{re.escape(name)}\s+{NUM}", out, re.M), out


@slow
def test_scale(tmp_path):
    pytest.importorskip("matplotlib", reason="scale.py requires matplotlib (the bench extra) for scale.png")
    run("scale", "--quick", "--out", tmp_path)
    with open(tmp_path / "scale.json") as f:
        res = json.load(f)
    assert [r["world"] for r in res["datastates"]] == [16] and res["datastates"][0]["load_s"] > 0
    assert [r["world"] for r in res["torch_dist"]] == [2] and res["torch_dist"][0]["save_s"] > 0
    assert (tmp_path / "scale.png").exists()


@slow
def test_scale_fsdp2(tmp_path):
    """FSDP2's uneven DTensors over a 16-rank mesh: one collective at the first save (the structure's boxes
    learned), none at the second, rank 1's shards loaded back bit for bit (scale.py asserts it)."""
    pytest.importorskip("matplotlib", reason="scale.py requires matplotlib (the bench extra) for its figure")
    run("scale", "--fsdp2", "--worlds", "16", "--out", tmp_path)
    with open(tmp_path / "scale_fsdp2.json") as f:
        res = json.load(f)
    (row,) = res["datastates"]
    assert row["world"] == 16 and row["c10d_calls"] == [1, 0] and row["load_s"] > 0 and row["manifest_bytes_r1"] > 0
    assert res["torch_dist"] == [] and (tmp_path / "scale_fsdp2.png").exists()


@slow
def test_memory_tier(tmp_path):
    script("memory_tier").main(["--quick", "--out", str(tmp_path / "out"), "--memory-dir", str(tmp_path / "mem")])
    with open(tmp_path / "out" / "memory_tier.json") as f:
        res = json.load(f)
    assert res["restart"]["memory"]["iteration"] >= 7, res["restart"]  # killed after its memory checkpoint of 7
    assert res["restart"]["storage"]["iteration"] == 4, res["restart"]  # storage every 4
    assert set(res["loop"]) == {"no checkpoint", "storage every iteration", "memory every iteration",
                                "memory every iteration, storage every 10"}
    assert all(v["total_s"] > 0 for v in res["loop"].values())
    assert set(res["save"]) == {"staged", "mapped"} and all(v["durable_s"] > 0 for v in res["save"].values())


@slow
def test_restart(tmp_path):
    script("restart").main(["--quick", "--out", str(tmp_path)])
    with open(tmp_path / "restart.json") as f:
        res = json.load(f)
    memory, storage = res["runs"]["memory tier every iteration + storage"], res["runs"]["storage only"]
    assert memory[0]["level"] == "memory tier" and storage[0]["level"] == "storage", res
    # storage every 3, the kill after 5: storage resumes from 3, the memory tier from a newer iteration
    assert storage[0]["resumed_from"] == 3 and memory[0]["resumed_from"] > 3, res
    assert res["target_s"] > 0 and res["cold_start_s"][0] > 0


@slow
def test_elastic():
    """A node lost after iteration 7, the survivor resumed from the memory tier: one iteration trained again (the
    one in flight), timed from the kill."""
    (row,) = script("elastic").main(["--quick"])
    assert (row["resumed_from"], row["resumed_at"], row["trained_again"]) == ("the memory tier", 7, 1), row
    assert row["loss_to_first_iteration_s"] > 0 and row["load_s"] > 0, row


@slow
def test_trainer_syscalls(tmp_path, capsys):
    script("trainer_syscalls").main(["--quick", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    lines = re.findall(rf"^rank (\d): +{NUM} file-metadata syscalls per checkpoint .* (\d+) JSON file\(s\) opened$",
                       out, re.M)
    assert [r for r, _, _ in lines] == ["0", "1", "2", "3"], out
    assert all(float(steady) > 0 for _, steady, _ in lines), out


@slow
def test_hf_export(tmp_path, capsys):
    script("hf_export").main(["--quick", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert re.search(r"^exports: 4; median export \d+ ms", out, re.M), out  # 8 iterations, one every 2
    assert re.search(rf"^loop: median iteration {NUM} ms with, {NUM} ms without", out, re.M), out
    assert re.search(rf"^offline converter on the last checkpoint: {NUM} s as a process", out, re.M), out
    floor = re.search(rf"^storage floor: the same (\d+) safetensors files \((\d+) MiB\) written and fsynced here in "
                      rf"{NUM} s by 1 writer", out, re.M)
    assert floor and int(floor[1]) > 1 and int(floor[2]) > 0, out  # the model's files of 4 MiB, probed


def test_rl_device_on_host_buffers(tmp_path):
    """rl_device.py's steps (a CUDA machine's part of gpu_check.sh (g)) on host buffers: every byte of the
    version counted, each figure a time."""
    import torch
    from safetensors.torch import save_file
    save_file({"a": torch.randn(64, 32).bfloat16(), "b": torch.randn(100)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {"a": "model.safetensors", "b": "model.safetensors"}}))
    r = script("rl_device").measure(str(tmp_path), reps=2, device="cpu")
    assert r["bytes"] == 64 * 32 * 2 + 100 * 4 and r["nccl_broadcast_ms"] is None
    assert r["plain_pinned_copy_ms"] > 0 and r["reader_to_device_ms"] > 0
