"""--save-hf: transformers models published while training (megatron/training/checkpointing/hf_publish.py).

A TP2 x PP2 run publishes a model at every checkpoint: each is byte for byte what `convert_checkpoint.py --to hf`
writes from the checkpoint of the same iteration, transformers loads the newest and computes megatron-core's
logits, `latest` names the newest, --save-hf-keep-last retires the oldest; built from the weights the saves
staged, passed between the ranks, no process of the job (strace) opens a checkpoint's data file to read it, also
when storage is written from the memory tier's pages. Weights that do not fit in the staging budget drop that
export (a warning), and the run's last model is then read back, from a compressed checkpoint; compressed
checkpoints export the same bytes as the offline tool. An EP2 run publishes to s3:// (SeaweedFS)
the same bytes. A job SIGKILLed in the middle of an export leaves `latest` naming the previous complete model, and
the next start removes the leftovers. What the offline tool refuses is refused at start-up
(tests/test_megatron_args.py's table of refusals).
"""
import itertools
import json
import os
import re
import shutil
import subprocess
import tempfile

import pytest
import torch
from safetensors.torch import save_file

from megatron_helpers import ROOT, TINY, torchrun, torchrun_command

pytest.importorskip("transformers")

from hf_helpers import TRAIN, assert_computes_as_megatron_core, convert, hf_model, reference  # noqa: E402
from test_hf import tiny_tokenizer  # noqa: E402
from test_weights_versions import file_tensors, rank_of, reassembled, same  # noqa: E402

from datastates.weights import WeightsReader  # noqa: E402

MODEL = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--vocab-size", "128", "--make-vocab-size-divisible-by", "32", "--hidden-dropout", "0",
         "--attention-dropout", "0", "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
         "--ffn-hidden-size", "96", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
         "--group-query-attention", "--num-query-groups", "2"]


SHARD = "100000"  # bytes: several safetensors files, written by different ranks


def files_of(directory: str) -> dict[str, bytes]:
    out = {}
    for name in sorted(os.listdir(directory)):
        with open(os.path.join(directory, name), "rb") as f:
            out[name] = f.read()
    return out


def assert_same_bytes(a: str, b: str) -> None:
    fa, fb = files_of(a), files_of(b)
    assert sorted(fa) == sorted(fb), (sorted(fa), sorted(fb))
    assert sum(n.endswith(".safetensors") for n in fa) >= 2
    for name in fa:
        assert fa[name] == fb[name], f"{name} differs between {a} and {b}"


def codecs_of(ckpt: str) -> set:
    """The codecs a checkpoint's saved tensors were written with (None: uncompressed)."""
    index = json.load(open(os.path.join(ckpt, "metadata.json")))
    return {it.get("codec") for r in index["ranks"].values() for it in r["items"] if it["kind"] == "tensor"}


DATA_FILE = re.compile(r'"(?P<path>[^"]*/rank_\d+\.data)"')


def traced_torchrun(nproc: int, flags: list[str], trace: str) -> tuple[str, list[str]]:
    """A real torchrun of the job with every open of every process recorded (strace); its output, and the data
    files under --save that any process opened for reading."""
    cmd, env = torchrun_command(nproc, flags)
    run = subprocess.run(["strace", "-f", "-qq", "--seccomp-bpf", "-e", "trace=open,openat", "-o", trace, *cmd],
                         env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=400)
    assert run.returncode == 0, run.stdout[-6000:]
    save = os.path.abspath(flags[flags.index("--save") + 1])
    with open(trace) as f:
        read = [m["path"] for line in f if "O_RDONLY" in line and (m := DATA_FILE.search(line))
                and m["path"].startswith(save + os.sep)]
    return run.stdout, read


def test_models_published_during_training_are_the_offline_tool_s(tmp_path):
    save, hf, tok = str(tmp_path / "ckpt"), str(tmp_path / "hf"), str(tmp_path / "tok")
    tiny_tokenizer(tok)
    train = TRAIN[:TRAIN.index("--train-iters")] + ["--train-iters", "6"]
    log, read = traced_torchrun(4, MODEL + train + [
        "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--save", save,
        "--save-interval", "2", "--async-ckpt", "--save-hf", hf, "--save-hf-tokenizer", tok, "--save-hf-keep-last",
        "2", "--save-hf-max-shard-size", SHARD], str(tmp_path / "opens"))
    assert "published the Hugging Face model of iteration 6" in log, log[-3000:]
    assert read == [], f"the job read checkpoint data back: {read}"  # the weights came from the saves' staging
    # keep-last 2: iteration 2's model retired, 4 and 6 complete, latest names 6, nothing else left
    assert sorted(os.listdir(hf)) == ["iter_0000004", "iter_0000006", "latest"], os.listdir(hf)
    assert open(os.path.join(hf, "latest")).read() == "iter_0000006\n"
    for it in (4, 6):
        offline = str(tmp_path / f"offline_{it}")
        convert("--from", "datastates", "--to", "hf", "--input", os.path.join(save, f"iter_{it:07d}"),
                "--output", offline, "--tokenizer", tok, "--max-shard-size", SHARD)
        assert_same_bytes(os.path.join(hf, f"iter_{it:07d}"), offline)
    ref = reference(save, str(tmp_path / "reference.pt"), MODEL + TRAIN)  # the newest checkpoint: 6
    assert_computes_as_megatron_core(hf_model(os.path.join(hf, "iter_0000006")), ref)


def test_storage_written_from_the_memory_tier_exports_from_memory(tmp_path):
    """PP2 with the memory tier every iteration: storage saves write from the tier's pages, and the export takes
    the weights from there (no data file of the checkpoint is opened to read); each model is the tool's bytes."""
    save, hf = str(tmp_path / "ckpt"), str(tmp_path / "hf")
    train = TRAIN[:TRAIN.index("--train-iters")] + ["--train-iters", "4"]
    log, read = traced_torchrun(2, MODEL + train + [
        "--pipeline-model-parallel-size", "2", "--save", save, "--save-interval", "2", "--async-ckpt",
        "--non-persistent-save-interval", "1", "--non-persistent-local-ckpt-dir", str(tmp_path / "tier"),
        "--save-hf", hf, "--save-hf-max-shard-size", SHARD], str(tmp_path / "opens"))
    assert "published the Hugging Face model of iteration 4" in log, log[-3000:]
    assert read == [], f"the job read checkpoint data back: {read}"
    for it in (2, 4):
        offline = str(tmp_path / f"offline_{it}")
        convert("--from", "datastates", "--to", "hf", "--input", os.path.join(save, f"iter_{it:07d}"),
                "--output", offline, "--max-shard-size", SHARD)
        assert_same_bytes(os.path.join(hf, f"iter_{it:07d}"), offline)
    assert_each_stage_writes_its_own_layers(os.path.join(save, "iter_0000004"))


def written_pieces(ckpt: str) -> list:
    """Every rank's written model weights in the checkpoint's index, as the export's `Piece`s (what the saves kept)."""
    from datastates import Box, CheckpointReader
    from datastates.schema import Kind
    from megatron.training.checkpointing.hf_staged import Piece
    from datastates.hf.export import is_model_tensor
    with CheckpointReader.open(ckpt) as reader:
        opened = reader.checkpoint
        return [Piece(r, it.id, it.name, it.dtype, Box(tuple(it.global_offset), tuple(it.shape)),
                      tuple(it.global_shape)) for r in range(opened.world_size) for it in opened.items(r).values()
                if it.kind == Kind.TENSOR and it.write and it.name and is_model_tensor(it.name)]


def bytes_passed(plan, shards: list, layout, owners: list[int]) -> int:
    """The bytes of the units a file's rank does not keep itself: what passes between the ranks."""
    file_of = {e.name: k for k, shard in enumerate(shards) for e in shard}
    total = 0
    for rule, index in plan.units():
        name, at = rule.megatron, tuple(rule.at) + tuple(index)
        for dst in {owners[file_of[x]] for x in rule.names(index)}:
            total += sum(box.volume() * layout.tensors[name][1].itemsize
                         for piece, box in layout.overlaps(name, layout.unit(name, at)) if piece.rank != dst)
    return total


def assert_each_stage_writes_its_own_layers(ckpt: str) -> None:
    """The files' ranks (`Pieces.owners`) on the run's real layout (PP2: each rank keeps its stage's layers): as
    many files a rank as round robin gives, and the fewest bytes passed between the ranks of any such choice
    (fewer than round robin's)."""
    from megatron.training.checkpointing.hf_staged import Pieces
    from datastates.hf.export import plan_export
    plan = plan_export("datastates", ckpt, drop_mtp=True)
    try:
        shards = plan.shards(int(SHARD))
        layout = Pieces(written_pieces(ckpt))
        owners = layout.owners(plan, shards, 2)
        assert sorted(owners.count(r) for r in (0, 1)) == sorted([len(shards) // 2, len(shards) - len(shards) // 2])
        balanced = [list(a) for a in itertools.product((0, 1), repeat=len(shards))
                    if abs(2 * a.count(0) - len(shards)) <= 1]
        fewest = min(bytes_passed(plan, shards, layout, a) for a in balanced)
        assert len(shards) >= 4 and fewest < bytes_passed(plan, shards, layout, [k % 2 for k in range(len(shards))])
        assert bytes_passed(plan, shards, layout, owners) == fewest, (fewest, owners)
    finally:
        plan.close()


def assert_replicas_written_where_their_files_are(ckpt: str, log: str) -> None:
    """DP2 (EP2 at 2 ranks: the dense weights replicated on both): every unit of a replicated weight that lies in
    one safetensors file was written, in the checkpoint, by the rank that writes that file, and what the export
    reports passing between the ranks is what the layout implies (the units that span files, the experts)."""
    from megatron.training.checkpointing.hf_staged import Pieces
    from datastates.hf.export import plan_export
    plan = plan_export("datastates", ckpt, drop_mtp=True)
    try:
        shards = plan.shards(int(SHARD))
        layout = Pieces(written_pieces(ckpt))
        owners = layout.owners(plan, shards, 2)
        file_of = {e.name: k for k, shard in enumerate(shards) for e in shard}
        checked = 0
        for rule, index in plan.units():
            files = {file_of[x] for x in rule.names(index)}
            if ".experts." in rule.megatron or len(files) != 1:
                continue
            name, at = rule.megatron, tuple(rule.at) + tuple(index)
            ranks = {piece.rank for piece, _ in layout.overlaps(name, layout.unit(name, at))}
            assert ranks == {owners[files.pop()]}, (name, index, ranks, owners)
            checked += 1
        assert checked >= 10 and len(set(owners)) == 2, (checked, owners)
        iteration = re.search(r"iter_(\d+)", ckpt)[1].lstrip("0")
        passed = re.search(rf"published the Hugging Face model of iteration {iteration}: .* bytes passed between "
                           r"ranks: (\d+)", log)
        assert passed and int(passed[1]) == bytes_passed(plan, shards, layout, owners), (passed, log[-3000:])
    finally:
        plan.close()


def test_weights_beyond_the_staging_budget_drop_the_export_and_the_last_is_read_back(tmp_path):
    """A staging budget smaller than the model's weights: no save can keep them, so the exports of iterations 2
    and 4 are dropped (a warning naming the model that stays newest, training goes on under --ckpt-on-failure
    stop), and the run's last checkpoint, 6, saved compressed, is exported from storage (decoded): the tool's
    bytes."""
    save, hf = str(tmp_path / "ckpt"), str(tmp_path / "hf")
    train = TRAIN[:TRAIN.index("--train-iters")] + ["--train-iters", "6"]
    _, log = torchrun(1, MODEL + train + ["--save", save, "--save-interval", "2", "--async-ckpt",
                                          "--ckpt-host-buffer-gb", "0.0002", "--ckpt-compress", "bytegroup-zstd",
                                          "--save-hf", hf,
                                          "--save-hf-max-shard-size", SHARD])
    for it in (2, 4):
        assert (f"the Hugging Face export of iteration {it} was dropped, training goes on: no weights were kept for "
                f"it (rank 0: its ") in log, log[-3000:]
    assert "MiB staging budget); there is no Hugging Face model yet" in log, log[-3000:]
    assert "published the Hugging Face model of iteration 6" in log and "training done at iteration 6" in log
    assert sorted(os.listdir(hf)) == ["iter_0000006", "latest"], os.listdir(hf)
    assert codecs_of(os.path.join(save, "iter_0000006")) == {"bytegroup-zstd"}
    offline = str(tmp_path / "offline")
    convert("--from", "datastates", "--to", "hf", "--input", save, "--output", offline, "--max-shard-size", SHARD)
    assert_same_bytes(os.path.join(hf, "iter_0000006"), offline)


LARGER = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8", "--seq-length", "32",
          "--vocab-size", "8000", "--micro-batch-size", "1", "--global-batch-size", "1", "--lr", "1e-3",
          "--mock-data", "--seed", "1234", "--position-embedding-type", "rope", "--normalization", "RMSNorm",
          "--swiglu", "--ffn-hidden-size", "512", "--disable-bias-linear", "--untie-embeddings-and-output-weights"]


@pytest.mark.parametrize("point", ["first-file", "index", "pointer"])
def test_a_job_killed_at_each_point_of_an_export_leaves_the_previous_model_newest(tmp_path, point):
    """SIGKILL (tests/fault_launcher.py) at a named point of the export of iteration 4, the run's last: `latest`
    still names iteration 2's complete model. Killed before the model was complete, the next start (a resume with
    --save-hf) removes what it left before any export; killed before `latest` named it, the model is complete (the
    offline tool's bytes) and stays unnamed, `latest` still naming iteration 2's. No polling: the kill is at the
    point."""
    save, hf = str(tmp_path / "ckpt"), str(tmp_path / "hf")
    flags = MODEL + TRAIN[:TRAIN.index("--train-iters")] + [
        "--train-iters", "4", "--save", save, "--save-interval", "2", "--async-ckpt", "--no-save-optim",
        "--save-hf", hf, "--save-hf-max-shard-size", SHARD]
    rc, log = torchrun(1, flags, env={"FAULT_KILL_IN_EXPORT": f"4:{point}"}, check=False, faults=True)
    assert rc != 0 and f"FAULT-KILL-EXPORT iteration 4 at {point}: " in log, log[-3000:]
    assert open(os.path.join(hf, "latest")).read() == "iter_0000002\n"
    assert os.path.isfile(os.path.join(hf, "iter_0000002", "model.safetensors.index.json"))
    left = sorted(n for n in os.listdir(hf) if n.startswith("iter_0000004"))
    assert left == (["iter_0000004"] if point == "pointer" else ["iter_0000004.partial"]), os.listdir(hf)
    _, out = torchrun(1, flags + ["--load", save, "--no-load-optim", "--no-load-rng"])  # nothing left to train
    if point != "pointer":
        assert f"removed the leftovers of an unfinished export: {os.path.join(hf, left[0])}" in out, out[-3000:]
    assert sorted(os.listdir(hf)) == ["iter_0000002"] + (["iter_0000004"] if point == "pointer" else []) + ["latest"]
    assert open(os.path.join(hf, "latest")).read() == "iter_0000002\n", out[-3000:]
    if point == "pointer":
        offline = str(tmp_path / "offline")
        convert("--from", "datastates", "--to", "hf", "--input", save, "--output", offline, "--max-shard-size", SHARD)
        assert_same_bytes(os.path.join(hf, "iter_0000004"), offline)


def test_a_job_killed_between_latest_and_retention_leaves_latest_naming_a_whole_model(tmp_path):
    """--save-hf-keep-last 1, SIGKILL after `latest` names iteration 4's model and before retention retires
    iteration 2's (the one order of every root: commit, pointer, retention): `latest` names a whole model, the
    offline tool's bytes, and the one before is still whole too (retention had not touched it)."""
    save, hf = str(tmp_path / "ckpt"), str(tmp_path / "hf")
    flags = MODEL + TRAIN[:TRAIN.index("--train-iters")] + [
        "--train-iters", "4", "--save", save, "--save-interval", "2", "--async-ckpt", "--no-save-optim",
        "--save-hf", hf, "--save-hf-max-shard-size", SHARD, "--save-hf-keep-last", "1"]
    rc, log = torchrun(1, flags, env={"FAULT_KILL_IN_EXPORT": "4:retention"}, check=False, faults=True)
    assert rc != 0 and "FAULT-KILL-EXPORT iteration 4 at retention: " in log, log[-3000:]
    assert open(os.path.join(hf, "latest")).read() == "iter_0000004\n"
    assert sorted(os.listdir(hf)) == ["iter_0000002", "iter_0000004", "latest"], os.listdir(hf)
    offline = str(tmp_path / "offline")
    convert("--from", "datastates", "--to", "hf", "--input", save, "--output", offline, "--max-shard-size", SHARD)
    assert_same_bytes(os.path.join(hf, "iter_0000004"), offline)
    assert os.path.isfile(os.path.join(hf, "iter_0000002", "model.safetensors.index.json"))


@pytest.mark.parametrize("policy", ["warn", "stop"])
def test_the_store_stopped_during_an_export_fails_it_under_ckpt_on_failure(s3_server, tmp_path, policy):
    """Checkpoints on a file system, models on SeaweedFS, stopped (tests/fault_launcher.py, FAULT_STORE_DOWN) once
    the first part of the first file of iteration 4's model is up: that export, the run's last, fails; `warn` ends
    the run (exit 0) saying so, `stop` ends it with an error; either way `latest` names iteration 2's model, and
    the next start, the store back, removes what the failed export left."""
    from test_s3_trainer import faulted_run, stored
    save, root = str(tmp_path / "ckpt"), f"s3://{s3_server.create_bucket()}/hf"
    flags = MODEL + TRAIN[:TRAIN.index("--train-iters")] + [
        "--train-iters", "4", "--save", save, "--save-interval", "2", "--async-ckpt", "--no-save-optim",
        "--save-hf", root, "--save-hf-max-shard-size", "300000", "--ckpt-on-failure", policy]  # files of parts
    env = {**s3_server.env(), "FAULT_STORE_DOWN": "4:99", "FAULT_CONTROL_DIR": str(tmp_path), "AWS_MAX_ATTEMPTS": "2"}
    rc, log = faulted_run(s3_server, str(tmp_path), nproc=1, args=flags, env=env)
    assert "FAULT-STORE-DOWN" in log and f"{root}/iter_0000004/model-" in log, log[-3000:]
    if policy == "warn":
        assert rc == 0 and "training done at iteration 4" in log, log[-3000:]
        assert ("the Hugging Face export of iteration 4 failed, training goes on (--ckpt-on-failure warn); the newest "
                f"Hugging Face model is still {root}/iter_0000002") in log, log[-3000:]
    else:
        assert rc != 0 and "rank 0: stopping at iteration 4: a checkpoint failed (--ckpt-on-failure stop)" in log, \
            log[-3000:]
        assert f"cannot reach the S3 endpoint for {root}/iter_0000004/model-00001-of-00002.safetensors" in log
    bucket, prefix = root[len("s3://"):].split("/", 1)
    latest = s3_server.client().get_object(Bucket=bucket, Key=f"{prefix}/latest")["Body"].read()
    assert latest == b"iter_0000002\n" and f"{prefix}/iter_0000002/model.safetensors.index.json" in stored(s3_server, root)[0]
    left = stored(s3_server, f"{root}/iter_0000004")  # what the store's stop kept the export from removing
    assert left != ([], []) and f"{prefix}/iter_0000004/model.safetensors.index.json" not in left[0], left
    _, out = torchrun(1, flags + ["--load", save, "--no-load-optim", "--no-load-rng"], env=s3_server.env())
    assert (f"removed the leftovers of an unfinished export: {root} (an open multipart upload of "
            f"{prefix}/iter_0000004/model-00001-of-00002.safetensors)") in out, out[-3000:]
    assert stored(s3_server, f"{root}/iter_0000004") == ([], []), out[-3000:]


def download(s3_server, bucket: str, prefix: str, target: str) -> list[str]:
    """Every object under `prefix` into `target` (the transformers side reads files); the keys, relative."""
    client = s3_server.client()
    keys = [o["Key"][len(prefix):] for o in client.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", [])]
    for key in keys:
        os.makedirs(os.path.dirname(os.path.join(target, key)), exist_ok=True)
        client.download_file(bucket, prefix + key, os.path.join(target, key))
    return sorted(keys)


def test_an_ep2_mixtral_in_bf16_saved_synchronously_published_to_s3(s3_server, tmp_path):
    """Experts spread over 2 ranks (EP2, distributed optimizer), bf16 weights, a synchronous save, the models
    published to s3:// (SeaweedFS), each replicated (dense) weight written in the checkpoint by the rank that writes
    its file: what a killed export left there (a model without its index, an open multipart
    upload) is removed at start, --save-hf-keep-last 1 retires iteration 2's model, and iteration 4's is the
    offline tool's bytes, a bf16 MixtralForCausalLM once downloaded. The same saves publish weight versions
    (--publish-weights-dir): the last is the same bytes; a TP2 engine's ranks read it packed (q/k/v fused, the
    experts stacked as FusedMoE holds them) as the test rebuilds it with torch.cat, and unpacked, reassembled,
    it computes the logits of the downloaded model bit for bit."""
    from test_hf_moe import MIXTRAL
    save, bucket, versions = str(tmp_path / "ckpt"), s3_server.create_bucket(), str(tmp_path / "versions")
    client = s3_server.client()
    client.put_object(Bucket=bucket, Key="hf/iter_0000001/model-00001-of-00002.safetensors", Body=b"half")
    client.create_multipart_upload(Bucket=bucket, Key="hf/iter_0000001/model-00002-of-00002.safetensors")
    train = TRAIN[:TRAIN.index("--train-iters")] + ["--train-iters", "4"]
    _, log = torchrun(2, MIXTRAL + train + ["--expert-model-parallel-size", "2", "--use-distributed-optimizer",
                                            "--bf16", "--save", save, "--save-interval", "2",
                                            "--save-hf", f"s3://{bucket}/hf", "--save-hf-keep-last", "1",
                                            "--save-hf-max-shard-size", SHARD, "--publish-weights-dir",
                                            versions, "--publish-weights-interval", "2"], env=s3_server.env())
    assert f"removed the leftovers of an unfinished export: s3://{bucket}/hf/iter_0000001" in log, log[-3000:]
    assert not client.list_multipart_uploads(Bucket=bucket).get("Uploads")
    published = str(tmp_path / "published")
    keys = download(s3_server, bucket, "hf/", published)
    assert keys[-1] == "latest" and all(k.startswith("iter_0000004/") for k in keys[:-1]), keys
    assert open(os.path.join(published, "latest")).read() == "iter_0000004\n"
    offline = str(tmp_path / "offline")
    convert("--from", "datastates", "--to", "hf", "--input", save, "--output", offline, "--max-shard-size", SHARD)
    assert_same_bytes(os.path.join(published, "iter_0000004"), offline)
    assert_replicas_written_where_their_files_are(os.path.join(save, "iter_0000004"), log)
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(os.path.join(published, "iter_0000004"))
    assert type(model).__name__ == "MixtralForCausalLM" and model.dtype == torch.bfloat16
    with WeightsReader(versions).newest() as version:
        assert version.iteration == 4
        assert_same_bytes(version.path, offline)
        full, config = file_tensors(version.path), version.config
        for r in range(2):
            packed = dict(version.tensors(packed=True, tp_rank=r, tp_size=2))
            want = rank_of(full, config, 2, r)
            assert packed.keys() == want.keys() and all(same(packed[n], want[n]) for n in want)
            assert packed["model.layers.0.block_sparse_moe.experts.w13_weight"].shape == (4, 96, 64)
        whole = reassembled([dict(version.tensors(tp_rank=r, tp_size=2)) for r in range(2)], full)
    from_slices = str(tmp_path / "from_slices")
    os.makedirs(from_slices)
    save_file(whole, os.path.join(from_slices, "model.safetensors"))
    shutil.copy(os.path.join(offline, "config.json"), from_slices)
    tokens = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(hf_model(from_slices)(tokens).logits, hf_model(offline)(tokens).logits)


def test_a_failed_export_warns_and_training_goes_on(tmp_path):
    """--ckpt-on-failure warn: iteration 4's model cannot be published (a file already holds its name), so its
    export fails; training goes on, the warning names the model that stays newest, iteration 6's is published, and
    nothing of the failed export is left."""
    save, hf = str(tmp_path / "ckpt"), str(tmp_path / "hf")
    os.makedirs(hf)
    open(os.path.join(hf, "iter_0000004"), "w").close()
    _, log = torchrun(1, TINY + ["--train-iters", "6", "--global-batch-size", "2", "--save", save,
                                 "--save-interval", "2", "--async-ckpt", "--ckpt-on-failure", "warn", "--save-hf", hf,
                                 "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
                                 "--disable-bias-linear"])
    assert ("the Hugging Face export of iteration 4 failed, training goes on (--ckpt-on-failure warn); the newest "
            f"Hugging Face model is still {os.path.join(hf, 'iter_0000002')}") in log, log[-3000:]
    assert "training done at iteration 6" in log
    assert sorted(os.listdir(hf)) == ["iter_0000002", "iter_0000004", "iter_0000006", "latest"]
    assert open(os.path.join(hf, "latest")).read() == "iter_0000006\n"
    assert os.path.isfile(os.path.join(hf, "iter_0000004"))  # the file is as it was; no .partial left


def test_ckpt_keep_last_1_retires_checkpoints_whose_export_is_still_to_come(tmp_path):
    """--ckpt-keep-last 1 and a model at every save: each checkpoint is retired as soon as the next one is
    published, often before its own export starts (the exports queue behind each other); the export reads no file
    of the checkpoint, so every model is still published, and each is the tool's bytes of the checkpoint of its
    iteration (from a second run of the same job keeping every checkpoint: the same seed, the same weights). The
    checkpoints are compressed: the models are built from the weights as staged, before encoding."""
    save, kept_all, hf = str(tmp_path / "ckpt"), str(tmp_path / "ckpt_all"), str(tmp_path / "hf")
    job = MODEL + TRAIN[:TRAIN.index("--train-iters")] + [
        "--train-iters", "4", "--pipeline-model-parallel-size", "2", "--save-interval", "1", "--async-ckpt",
        "--ckpt-compress", "bytegroup-zstd"]
    _, log = torchrun(2, job + ["--save", save, "--ckpt-keep-last", "1", "--save-hf", hf,
                                "--save-hf-max-shard-size", SHARD])
    assert sorted(os.listdir(save)) == ["iter_0000004", "latest_checkpointed_iteration.txt"], os.listdir(save)
    assert codecs_of(os.path.join(save, "iter_0000004")) == {"bytegroup-zstd"}
    assert sorted(os.listdir(hf)) == [f"iter_000000{it}" for it in (1, 2, 3, 4)] + ["latest"], log[-3000:]
    torchrun(2, job + ["--save", kept_all])
    for it in (1, 2, 3, 4):
        offline = str(tmp_path / f"offline_{it}")
        convert("--from", "datastates", "--to", "hf", "--input", os.path.join(kept_all, f"iter_{it:07d}"),
                "--output", offline, "--max-shard-size", SHARD)
        assert_same_bytes(os.path.join(hf, f"iter_{it:07d}"), offline)


@pytest.mark.parametrize("where", ["another-storage", "the-checkpoints-storage"])
def test_a_failed_checkpoint_publishes_no_model(tmp_path, where, request):
    """Rank 1's save of iteration 2 fails when its data file is closed, 2 s after every byte of it (its kept
    weights too) was written. On another storage than the checkpoints' (/dev/shm) the export writes its files
    while the checkpoint is written, and publishes only once it is: the model's files are written by then, and
    removed. On the checkpoints' own storage the export starts once the save has ended: it writes nothing. Either
    way no model of iteration 2 is ever named, nothing is reported for its export (the save's failure is, under
    --ckpt-on-failure warn), and the next checkpoints' models are published as usual."""
    save = str(tmp_path / "ckpt")
    if where == "another-storage":
        if not os.path.isdir("/dev/shm") or os.stat("/dev/shm").st_dev == os.stat(tmp_path).st_dev:
            pytest.skip("no /dev/shm on another device than the test's directory")
        hf = tempfile.mkdtemp(dir="/dev/shm", prefix="hf-publish-")
        request.addfinalizer(lambda: shutil.rmtree(hf, ignore_errors=True))
    else:
        hf = str(tmp_path / "hf")
    job = MODEL + TRAIN[:TRAIN.index("--train-iters")] + [
        "--train-iters", "4", "--pipeline-model-parallel-size", "2", "--save-interval", "1", "--async-ckpt",
        "--ckpt-on-failure", "warn", "--save", save, "--save-hf", hf, "--save-hf-max-shard-size", SHARD]
    _, log = torchrun(2, job, faults=True, env={"FAULT_FAIL_CLOSE": "1:2:2"})
    assert "checkpoint of iteration 2 failed, training goes on" in log, log[-4000:]
    assert "injected failure closing" in log, log[-4000:]
    removed = "the checkpoint of iteration 2 failed: the model files written beside it are removed"
    if where == "another-storage":
        assert f"--save-hf: {hf} is on another storage than --save" in log and removed in log, log[-4000:]
    else:
        assert f"--save-hf: {hf} shares the storage of --save" in log and removed not in log, log[-4000:]
    assert "Hugging Face export of iteration 2" not in log, log[-4000:]
    assert sorted(os.listdir(hf)) == ["iter_0000001", "iter_0000003", "iter_0000004", "latest"], log[-3000:]
    assert open(os.path.join(hf, "latest")).read() == "iter_0000004\n"
    assert not os.path.exists(os.path.join(save, "iter_0000002"))
