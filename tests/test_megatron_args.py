"""Flag validation: inconsistent input fails with a clear message before any work starts (in-process, cheap)."""
import logging
import os

import pytest

from megatron.training.arguments import ArgumentError, parse_args
from megatron.training.argument_checks import validate_args

BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--micro-batch-size", "2", "--train-iters", "4", "--lr", "1e-3", "--mock-data"]


def check(extra, world=4):
    return validate_args(parse_args(argv=BASE + extra), world, cuda=False)


def test_valid_tp2_dp2():
    args = check(["--tensor-model-parallel-size", "2", "--global-batch-size", "8"])
    assert args.data_parallel_size == 2 and args.num_microbatches == 2 and args.ckpt_format == "datastates"


def test_world_not_divisible_by_tp_pp():
    with pytest.raises(ArgumentError, match="world size 4 is not divisible by .* 3"):
        check(["--tensor-model-parallel-size", "3"])


def test_heads_not_divisible_by_tp():
    with pytest.raises(ArgumentError, match="num-attention-heads 4 is not divisible by --tensor-model-parallel-size 8"):
        check(["--tensor-model-parallel-size", "8"], world=8)


def test_global_batch_not_divisible():
    with pytest.raises(ArgumentError, match="global-batch-size 6"):
        check(["--global-batch-size", "6"])


def test_load_points_at_nothing(tmp_path):
    with pytest.raises(ArgumentError, match="does not exist"):
        check(["--load", str(tmp_path / "nope")])
    (tmp_path / "empty").mkdir()
    with pytest.raises(ArgumentError, match="holds no checkpoint"):
        check(["--load", str(tmp_path / "empty")])
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "latest_checkpointed_iteration.txt").write_text("7")
    with pytest.raises(ArgumentError, match="iter_0000007 is missing"):
        check(["--load", str(tmp_path / "bad")])


def test_load_equal_save_starts_fresh(tmp_path):
    d = str(tmp_path / "ck")
    args = check(["--load", d, "--save", d, "--save-interval", "2"])
    assert args.load_exists is False


def test_cpu_only_flags():
    # what megatron-core trains on CPU ranks is accepted; what needs CUDA is refused naming the flag and why
    check(["--bf16", "--use-distributed-optimizer", "--tensor-model-parallel-size", "2", "--sequence-parallel"])
    check(["--pipeline-model-parallel-size", "2"])  # tied embeddings across stages
    check(["--fp16"])
    for flag in ("--overlap-grad-reduce", "--overlap-param-gather"):
        with pytest.raises(ArgumentError, match=f"{flag} needs CUDA: .*CUDA stream"):
            check([flag, "--use-distributed-optimizer"])
    for fmt in ("torch", "torch_dist"):  # another writer, synchronous here: never a silent sync under --async-ckpt
        with pytest.raises(ArgumentError, match=f"--async-ckpt is the datastates engine's lazy save; --ckpt-format {fmt}"):
            check(["--ckpt-format", fmt, "--async-ckpt"])
    with pytest.raises(ArgumentError, match="--use-distributed-optimizer with --ckpt-format torch"):
        check(["--ckpt-format", "torch", "--use-distributed-optimizer"])


def test_missing_required():
    with pytest.raises(ArgumentError, match="--train-iters"):
        i = BASE.index("--train-iters")
        validate_args(parse_args(argv=BASE[:i] + BASE[i + 2:]), 1, cuda=False)


def test_script_defaults_fill_only_flags_left_unset():
    from megatron.training.initialize import apply_args_defaults
    args = parse_args(argv=BASE + ["--seq-length", "64"])
    apply_args_defaults(args, {"seq_length": 128, "vocab_size": 512})
    assert (args.seq_length, args.vocab_size) == (64, 512)  # the command line wins, as in Megatron-LM
    with pytest.raises(ArgumentError, match="args_defaults names 'no_such_flag'"):
        apply_args_defaults(args, {"no_such_flag": 1})


def test_megatron_import_is_lazy():
    """`megatron.training` and its `arguments` import neither the trainer (`megatron.training.training`, imported
    by `pretrain` on its first call) nor megatron-core: checked in a fresh interpreter, whatever this process or
    earlier tests imported."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = ("import sys, megatron.training, megatron.training.arguments; "
              "print(megatron.training.__file__); "
              "print(sorted(m for m in ('megatron.training.training', 'megatron.core') if m in sys.modules))")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSAFEPATH")}
    r = subprocess.run([sys.executable, "-c", script], cwd=root, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    origin, eager = r.stdout.splitlines()
    assert origin == os.path.join(root, "megatron", "training", "__init__.py"), origin  # this repository's
    assert eager == "[]", f"importing megatron.training imported {eager}"


@pytest.mark.parametrize("policy", ["stop", "warn"])
def test_ckpt_on_failure_policy(tmp_path, policy):
    """A save that really fails in the engine: --ckpt-on-failure stop raises, warn logs and training goes on;
    either way the last published checkpoint stays the latest."""
    import torch

    from datastates import CheckpointError, paths, tracker
    from megatron.training.checkpointing import CheckpointManager

    save = tmp_path / "ckpt"
    args = check(["--save", str(save), "--save-interval", "1", "--async-ckpt", "--ckpt-on-failure", policy,
                  "--ckpt-host-buffer-gb", "0.001"], world=1)
    checkpoints = CheckpointManager(args, model=None, optimizer=None, scheduler=None)
    logged = []
    handler = logging.Handler()
    handler.emit = lambda record: logged.append(record.getMessage())
    logging.getLogger("megatron.training.checkpointing").addHandler(handler)
    try:
        engine = checkpoints.checkpoint_format.engine  # the manager's pending saves are its engine's
        good = engine.save({"w": torch.ones(8)}, paths.checkpoint_dir(str(save), 1))
        bad = engine.save({"w": torch.ones(8), "f": lambda: 0}, paths.checkpoint_dir(str(save), 2))
        good.join()
        bad.join()
        checkpoints.maybe_finalize()
        if policy == "stop":
            with pytest.raises(CheckpointError, match="iter_0000002.*not picklable"):
                checkpoints.agree_on_failures(3)
        else:
            checkpoints.agree_on_failures(3)
            assert any("checkpoint of iteration 2 failed, training goes on" in m for m in logged), logged
            assert engine.maybe_finalize() == [] and [r["iteration"] for r in checkpoints.records] == [1]
        assert tracker.read_latest(str(save)) == 1
    finally:
        logging.getLogger("megatron.training.checkpointing").removeHandler(handler)
        checkpoints.close()


@pytest.mark.parametrize("extra, message", [
    (["--non-persistent-save-interval", "0"], "--non-persistent-save-interval must be positive"),
    (["--non-persistent-save-interval", "1", "--non-persistent-ckpt-type", "global"], "only 'local'"),
    (["--non-persistent-save-interval", "1", "--ckpt-format", "torch_dist"], "needs --ckpt-format datastates"),
    (["--replication"], "--replication replicates the memory tier"),
    (["--ckpt-read-threads", "0"], "--ckpt-read-threads must be positive"),
    (["--non-persistent-save-interval", "1", "--replication", "--replication-factor", "3"],
     "must divide the world size 4"),
])
def test_memory_tier_flags(extra, message):
    with pytest.raises(ArgumentError, match=message):
        check(extra)


@pytest.mark.parametrize("world, extra, why", [
    (2, ["--tensor-model-parallel-size", "4"], r"world size 2 is not divisible by tensor-model-parallel-size 4 x "
                                               r"pipeline-model-parallel-size 1 = 4"),
    (6, ["--tensor-model-parallel-size", "2", "--global-batch-size", "8"],
     r"--global-batch-size 8 is not divisible by micro-batch-size 2 x data-parallel size 3 = 6"),
])
def test_a_torchrun_restart_on_a_world_the_layout_cannot_take_names_it(monkeypatch, tmp_path, world, extra, why):
    """An elastic job restarted by torchrun on nodes whose ranks its layout cannot divide (TP x PP, or the global
    batch by whole micro-batches of the new DP) fails with one error naming the restart, the world and the numbers,
    before anything is read or written: the checkpoint under --load is left as it was."""
    from megatron.training.initialize import initialize_megatron
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "latest_checkpointed_iteration.txt").write_text("5")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    monkeypatch.setenv("GROUP_WORLD_SIZE", str(world // 2))
    monkeypatch.setenv("WORLD_SIZE", str(world))
    with pytest.raises(ArgumentError, match=rf"^torchrun restart 1: the world of the {world // 2} node\(s\) present, "
                                            rf"{world} ranks, does not fit this job: {why}\. Nothing was loaded or "
                                            "written"):
        initialize_megatron(argv=BASE + extra + ["--save", str(ck), "--load", str(ck)])
    assert [p.name for p in ck.iterdir()] == ["latest_checkpointed_iteration.txt"]
    assert (ck / "latest_checkpointed_iteration.txt").read_text() == "5"
