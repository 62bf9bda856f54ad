"""Flag validation: inconsistent input fails with a clear message before any work starts (in-process, cheap)."""
import logging
import os
import re
import socket
import sys

import pytest

from megatron_helpers import ROOT
from megatron.training.arguments import ArgumentError, parse_args
from megatron.training.argument_checks import validate_args

sys.path.insert(0, ROOT)  # tools/, which --save-hf's checks import

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


def test_help_shows_every_flag_with_its_help_and_default_and_nothing_before_it():
    """`pretrain_gpt.py --help` prints the usage first (no import warnings before it); every flag has a help text,
    and each that takes a value and has a default shows it."""
    import subprocess
    import sys

    from megatron.training.arguments import build_parser
    r = subprocess.run([sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), "--help"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("usage: pretrain_gpt.py") and not r.stderr, r.stderr[-3000:]
    text = " ".join(r.stdout.split())
    actions = [a for a in build_parser()._actions if a.option_strings]
    assert [a.option_strings[0] for a in actions if not a.help] == []
    shown = [a for a in actions if a.nargs != 0 and a.default is not None]
    assert shown and [a.option_strings[0] for a in shown if f"[default: {a.default}]" not in text] == []


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


# ----- every checkpoint flag's bad combination: refused at start, before any work, writing nothing -----

CK, HF, MEM = "{tmp}/ck", "{tmp}/hf", "{tmp}/mem"
SAVE = ["--save", CK, "--save-interval", "2"]
TIER = SAVE + ["--non-persistent-save-interval", "1", "--non-persistent-local-ckpt-dir", MEM]
UNREACHABLE = {"AWS_ENDPOINT_URL": "{closed}"}  # a port bound without listening: the connection is refused
# (flags, the message's fragment the user reads, the environment's changes)
REFUSED = [
    # the format and its engine's settings
    (SAVE + ["--ckpt-format", "torch_dist", "--ckpt-compress", "zstd"],
     "--ckpt-compress zstd applies to --ckpt-format datastates only", {}),
    (SAVE + ["--ckpt-format", "torch", "--ckpt-compress", "auto"],
     "--ckpt-compress auto applies to --ckpt-format datastates only", {}),
    (SAVE + ["--ckpt-format", "torch_dcp"],
     "--ckpt-format torch_dcp: --use-torch-fsdp2 runs save lazily in the default datastates format here", {}),
    (SAVE + ["--ckpt-format", "torch_dist", "--async-ckpt"],
     "--async-ckpt is the datastates engine's lazy save; --ckpt-format torch_dist", {}),
    (SAVE + ["--ckpt-format", "torch", "--async-ckpt"],
     "--async-ckpt is the datastates engine's lazy save; --ckpt-format torch", {}),
    (SAVE + ["--ckpt-format", "torch", "--use-distributed-optimizer"],
     "--use-distributed-optimizer with --ckpt-format torch", {}),
    (SAVE + ["--ckpt-keep-last", "0"], "--ckpt-keep-last must be >= 1", {}),
    (SAVE + ["--ckpt-keep-last", "newest"], "--ckpt-keep-last must be an integer or 'all', got 'newest'", {}),
    (SAVE + ["--ckpt-host-buffer-gb", "0"], "--ckpt-host-buffer-gb, --ckpt-writer-threads and --ckpt-read-threads "
     "must be positive", {}),
    (SAVE + ["--ckpt-writer-threads", "0"], "--ckpt-writer-threads and --ckpt-read-threads must be positive", {}),
    (SAVE + ["--ckpt-read-threads", "0"], "--ckpt-read-threads must be positive", {}),
    # where checkpoints go and come from
    (["--save-interval", "2"], "--save-interval given without --save", {}),
    (["--save", CK, "--save-interval", "0"], "--save-interval must be positive, got 0", {}),
    (["--save", "/proc/nope/ck"], "--save '/proc/nope/ck' cannot be created or written: making a directory in "
     "'/proc' failed", {}),
    (["--save", "{tmp}/a-file/ck"], "--save '{tmp}/a-file/ck': '{tmp}/a-file' is a file, not a directory", {}),
    (["--save", "s3://bucket/run", "--ckpt-format", "torch"], "--save 's3://bucket/run': --ckpt-format torch "
     "writes local files", {}),
    (["--save", "s3://bucket/run", "--ckpt-format", "torch_dist"], "--ckpt-format torch_dist: megatron-core "
     "reaches object stores through multi-storage-client only", {}),
    (["--save", "msc://profile/run", "--disable-msc"], "--save 'msc://profile/run': msc:// paths are disabled by "
     "--disable-msc", {}),
    (["--save", "s3://bucket/run"], "--save 's3://bucket/run': cannot reach the S3 endpoint", UNREACHABLE),
    (["--save", "s3://{bucket}/run", "--save-hf", "/proc/nope/hf"], "--save-hf '/proc/nope/hf' cannot be created",
     {}),  # the bucket answered (listed), the destination of the export did not: nothing is written to either
    (["--load", "{tmp}/nothing"], "--load '{tmp}/nothing' does not exist or is not a directory", {}),
    (["--load", "{tmp}/empty"], "--load '{tmp}/empty': '{tmp}/empty' holds no checkpoint", {}),
    (["--load", "{tmp}/bad"], "iter_0000007 is missing", {}),
    (["--load", "{tmp}/nothing", "--pretrained-checkpoint", "{tmp}/empty"], "--pretrained-checkpoint '{tmp}/empty': "
     "'{tmp}/empty' holds no checkpoint: neither latest_checkpointed_iteration.txt nor a published iter_XXXXXXX "
     "directory (and --load '{tmp}/nothing' holds no checkpoint)", {}),
    (SAVE + ["--load", CK, "--ckpt-step", "3"], "--ckpt-step 3: '{tmp}/ck' holds no published checkpoint of "
     "that iteration (published: none)", {}),
    (["--ckpt-step", "3"], "--ckpt-step 3 needs --load or --pretrained-checkpoint", {}),
    (["--ckpt-step", "-1"], "--ckpt-step must be an iteration (0 or more), got -1", {}),
    (SAVE + ["--ckpt-format", "torch", "--verify-integrity"], "--verify-integrity: --ckpt-format torch saves no "
     "checksums here", {}),
    (SAVE + ["--save-after-load"], "--save-after-load needs both --load and --save", {}),
    (SAVE + ["--load", CK, "--save-after-load"], "--save-after-load: --save must be another directory than --load",
     {}),
    # --save-hf
    (["--save-hf", HF], "--save-hf needs --save (the model is exported from each published checkpoint)", {}),
    (SAVE + ["--save-hf", HF, "--ckpt-format", "torch_dist"], "--save-hf needs --ckpt-format datastates (got "
     "torch_dist)", {}),
    (SAVE + ["--save-hf", HF, "--save-hf-interval", "0"], "--save-hf-interval must be at least 1, got 0", {}),
    (SAVE + ["--save-hf", HF, "--save-hf-keep-last", "0"], "--save-hf-keep-last must be at least 1, got 0", {}),
    (SAVE + ["--save-hf", HF, "--save-hf-max-shard-size", "0"], "--save-hf-max-shard-size must be at least 1, got 0",
     {}),
    (SAVE + ["--save-hf", HF, "--save-hf-interval", "3"], "--save-hf-interval 3 is not a multiple of "
     "--save-interval 2", {}),
    (SAVE + ["--save-hf", HF, "--save-hf-tokenizer", "{tmp}/empty"], "--save-hf-tokenizer '{tmp}/empty' is not a "
     "directory holding any of the tokenizer files", {}),
    (SAVE + ["--save-hf", "/proc/nope/hf"], "--save-hf '/proc/nope/hf' cannot be created or written: making a "
     "directory in '/proc' failed", {}),
    (SAVE + ["--save-hf", "{tmp}/a-file/hf"], "--save-hf '{tmp}/a-file/hf': '{tmp}/a-file' is a file, not a "
     "directory", {}),
    (SAVE + ["--save-hf", "s3://bucket/hf"], "--save-hf 's3://bucket/hf': cannot reach the S3 endpoint", UNREACHABLE),
    (SAVE + ["--save-hf", "msc://profile/hf", "--disable-msc"], "--save-hf 'msc://profile/hf': msc:// paths are "
     "disabled by --disable-msc", {}),
    (SAVE + ["--save-hf", HF, "--position-embedding-type", "rope"], "no transformers architecture computes this "
     "model exactly", {}),
    (["--save-hf-keep-last", "1"], "--save-hf-keep-last given without --save-hf", {}),
    (["--save-hf-interval", "2"], "--save-hf-interval given without --save-hf", {}),
    # --publish-weights-dir: a version is the save of its iteration; a family without a mapping
    (SAVE + ["--publish-weights-dir", "{tmp}/v", "--publish-weights-interval", "3"], "--publish-weights-interval 3 "
     "is a multiple of neither --save-interval (2) nor --non-persistent-save-interval (None)", {}),
    (SAVE + ["--publish-weights-dir", "{tmp}/v"], "--publish-weights-dir needs --publish-weights-interval N", {}),
    (TIER + ["--publish-weights-dir", "{tmp}/v", "--publish-weights-interval", "1", "--position-embedding-type",
             "rope"], "no transformers architecture computes this model exactly", {}),
    (["--publish-weights-interval", "1"], "--publish-weights-interval given without --publish-weights-dir", {}),
    # the memory tier
    (SAVE + ["--non-persistent-save-interval", "0"], "--non-persistent-save-interval must be positive, got 0", {}),
    (TIER + ["--non-persistent-ckpt-type", "global"], "--non-persistent-ckpt-type global: only 'local'", {}),
    (TIER + ["--ckpt-format", "torch_dist"], "--non-persistent-save-interval needs --ckpt-format datastates", {}),
    (SAVE + ["--non-persistent-save-interval", "1", "--non-persistent-local-ckpt-dir", "/proc/nope/mem"],
     "--non-persistent-local-ckpt-dir '/proc/nope/mem' cannot be created or written", {}),
    (SAVE + ["--replication"], "--replication replicates the memory tier: it needs --non-persistent-save-interval",
     {}),
    (TIER + ["--replication", "--replication-factor", "1"], "--replication-factor must be >= 2 with --replication, "
     "got 1", {}),
    (TIER + ["--replication", "--replication-factor", "3"], "--replication-factor 3 x --replication-jump 4 (the "
     "ranks per node, 4, when not given) must divide the world size 4", {}),
    (TIER + ["--replication", "--replication-jump", "0"], "--replication-jump must be positive, got 0", {}),
    # restarts: the bounds that turn a lost or hung rank into a failure torchrun restarts
    (SAVE + ["--distributed-timeout-minutes", "0"], "--distributed-timeout-minutes must be positive, got 0", {}),
    (SAVE + ["--ckpt-publish-timeout-s", "-1"], "--ckpt-publish-timeout-s must be positive, got -1", {}),
]


def _tree(root) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, n), root) for d, dirs, files in os.walk(root) for n in dirs + files)


@pytest.fixture
def refusing(tmp_path, s3_server, monkeypatch):
    """The places a row names: a file where a directory would go, an empty directory, a tracker naming a missing
    checkpoint, a real bucket (SeaweedFS), a port that refuses connections; the store's variables set."""
    (tmp_path / "a-file").write_text("not a directory")
    (tmp_path / "empty").mkdir()
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "latest_checkpointed_iteration.txt").write_text("7")
    for k, v in {**s3_server.env(), "AWS_MAX_ATTEMPTS": "1"}.items():
        monkeypatch.setenv(k, v)
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    yield {"tmp": str(tmp_path), "bucket": s3_server.create_bucket(),
           "closed": f"http://127.0.0.1:{closed.getsockname()[1]}"}
    closed.close()


@pytest.mark.parametrize("flags, message, env", REFUSED, ids=[m.split(":")[0][:60] for _, m, _ in REFUSED])
def test_every_bad_checkpoint_flag_is_refused_at_start_writing_nothing(refusing, s3_server, monkeypatch, flags,
                                                                       message, env):
    """validate_args, which the trainer runs before any work, refuses each row naming the flag and the value;
    nothing appears on disk or in the bucket."""
    for k, v in env.items():
        monkeypatch.setenv(k, v.format(**refusing))
    before = _tree(refusing["tmp"])
    with pytest.raises(ArgumentError, match=re.escape(message.format(**refusing))):
        check([f.format(**refusing) for f in flags])
    assert _tree(refusing["tmp"]) == before
    assert s3_server.client().list_objects_v2(Bucket=refusing["bucket"]).get("KeyCount") == 0


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


def test_megatron_fsdp_on_cpu_ranks_is_refused_as_cuda_only_and_its_options_need_it():
    with pytest.raises(ArgumentError, match="--use-megatron-fsdp: Megatron-FSDP is a CUDA-only implementation .* use "
                                            "--use-torch-fsdp2 on CPU"):
        check(["--use-megatron-fsdp"])
    with pytest.raises(ArgumentError, match="--data-parallel-sharding-strategy is an option of --use-megatron-fsdp"):
        check(["--data-parallel-sharding-strategy", "optim"], world=2)


@pytest.mark.parametrize("extra,env,named", [
    (["--use-torch-fsdp2", "--untie-embeddings-and-output-weights"], {}, "--use-torch-fsdp2"),
    (["--ckpt-format", "torch_dist"], {}, "--ckpt-format torch_dist"),
    (["--save", "ckpt"], {}, "--save: the trainer's checkpoints of a Megatron-FSDP run are not wired yet"),
    ([], {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}, "CUDA_DEVICE_MAX_CONNECTIONS=1"),
])
def test_megatron_fsdp_on_cuda_refuses_what_upstream_refuses_beside_it(extra, env, named, monkeypatch):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ArgumentError, match=f"--use-megatron-fsdp with {re.escape(named)}"):
        validate_args(parse_args(argv=BASE + ["--use-megatron-fsdp", "--bf16"] + extra), 2, cuda=True)


def test_megatron_fsdp_on_cuda_takes_upstream_s_defaults_and_the_distributed_optimizer(monkeypatch):
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    args = validate_args(parse_args(argv=BASE + ["--use-megatron-fsdp", "--bf16", "--fsdp-double-buffer"]), 2,
                         cuda=True)
    assert (args.data_parallel_sharding_strategy, args.megatron_fsdp_main_params_dtype,
            args.megatron_fsdp_main_grads_dtype, args.fsdp_double_buffer, args.use_distributed_optimizer) == \
        ("optim_grads_params", "fp32", "auto", True, True)


def test_megatron_fsdp_dtype_options_need_the_megatron_core_that_has_them(monkeypatch):
    import dataclasses
    from megatron.core.distributed import DistributedDataParallelConfig
    if "megatron_fsdp_grad_comm_dtype" in {f.name for f in dataclasses.fields(DistributedDataParallelConfig)}:
        pytest.skip("this megatron-core (0.19+) has Megatron-FSDP's dtype settings")
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    with pytest.raises(ArgumentError, match="--megatron-fsdp-grad-comm-dtype needs megatron-core 0.19 or newer"):
        validate_args(parse_args(argv=BASE + ["--use-megatron-fsdp", "--megatron-fsdp-grad-comm-dtype", "bf16"]), 2,
                      cuda=True)
