"""Hugging Face in and out (datastates.hf, tools/hf, `convert_checkpoint.py --to hf / --from hf`), checked by transformers itself.

Tiny models trained with TP2 x PP2 (Llama-style untied with GQA, Llama-style tied with biases, the default GPT as
GPT-2) are exported and loaded with AutoModelForCausalLM; their logits and loss on the trainer's first
micro-batch equal megatron-core's (tests/hf_reference.py) in fp32. Models built with transformers go through
this project and back bit for bit, and one is fine-tuned from: the trainer's first loss is transformers' loss.
An export and an import of a state larger than their memory budget stay within it (peak RSS), and bad input is
refused with nothing written.
"""
import json
import math
import os
import shutil
import sys

import pytest
import torch

from megatron_helpers import ROOT, losses, torchrun

pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402

from hf_helpers import (TRAIN, assert_bit_equal, assert_computes_as_megatron_core, assert_import_refused,  # noqa: E402
                        assert_round_trip, convert, finetune_flags, first_global_batch, hf_loss, hf_model, hf_tensors,
                        no_leftovers, reference, run_script, tiny_llama)
from test_hf_qwen import tiny_qwen  # noqa: E402

MODEL = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--vocab-size", "128", "--make-vocab-size-divisible-by", "32", "--hidden-dropout", "0",
         "--attention-dropout", "0"]
LLAMA = ["--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu", "--ffn-hidden-size", "96"]
ARCHS = {"llama-untied-gqa": LLAMA + ["--disable-bias-linear", "--untie-embeddings-and-output-weights",
                                      "--group-query-attention", "--num-query-groups", "2"],
         "llama-tied-bias": LLAMA,
         "gpt2": []}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """arch -> (save root, model flags) of a TP2 x PP2 run of 2 iterations; the GPT-2 run names a transformers
    tokenizer (--tokenizer-type HuggingFaceTokenizer), which its export carries."""
    tokenizer = str(tmp_path_factory.mktemp("tokenizer"))
    tiny_tokenizer(tokenizer)
    out = {}
    for arch, flags in ARCHS.items():
        save = str(tmp_path_factory.mktemp(arch) / "ckpt")
        model = MODEL + flags
        if arch == "gpt2":  # the tokenizer's 128 words are the vocabulary
            at = model.index("--vocab-size")
            model = model[:at] + model[at + 2:] + ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
                                                   tokenizer]
        torchrun(4, model + TRAIN + ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                                     "--save", save, "--save-interval", "2"])
        out[arch] = (save, model)
    return out


@pytest.mark.parametrize("arch", list(ARCHS))
def test_export_computes_what_megatron_core_computes(trained, tmp_path, arch):
    save, flags = trained[arch]
    out = str(tmp_path / "hf")
    convert("--from", "datastates", "--to", "hf", "--input", save, "--output", out)
    assert {"config.json", "model.safetensors.index.json"} <= set(os.listdir(out)) and no_leftovers(str(tmp_path))
    ref = reference(save, str(tmp_path / "reference.pt"), flags + TRAIN)
    model = hf_model(out)
    expected = "GPT2LMHeadModel" if arch == "gpt2" else "LlamaForCausalLM"
    assert type(model).__name__ == expected
    assert_computes_as_megatron_core(model, ref)


def test_export_from_torch_dist_equals_export_from_datastates(trained, tmp_path):
    save, _ = trained["llama-untied-gqa"]
    convert("--from", "datastates", "--to", "torch_dist", "--input", save, "--output", str(tmp_path / "td"))
    convert("--from", "torch_dist", "--to", "hf", "--input", str(tmp_path / "td"), "--output", str(tmp_path / "a"))
    convert("--from", "datastates", "--to", "hf", "--input", save, "--output", str(tmp_path / "b"),
            "--max-shard-size", "40000")
    assert len(set(json.load(open(tmp_path / "b" / "model.safetensors.index.json"))["weight_map"].values())) > 3
    assert_bit_equal(hf_tensors(str(tmp_path / "a")), hf_tensors(str(tmp_path / "b")))


def tiny_gpt2(directory: str, **overrides) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(1)
    cfg = dict(vocab_size=100, n_embd=64, n_layer=2, n_head=4, n_positions=32, activation_function="gelu")
    GPT2LMHeadModel(GPT2Config(**{**cfg, **overrides})).save_pretrained(directory)


@pytest.mark.parametrize("build,fmt", [(tiny_llama, "datastates"), (tiny_gpt2, "datastates"),
                                       (tiny_llama, "torch_dist"), (tiny_llama, "torch_dcp")],
                         ids=["llama", "gpt2", "llama-torch_dist", "llama-torch_dcp"])
def test_round_trip_through_this_project_is_bit_exact(tmp_path, build, fmt):
    source = str(tmp_path / "source")
    build(source, **({"vocab": 100} if build is tiny_llama else {}))  # 100 rows: padded to 128 on the way
    assert_round_trip(source, str(tmp_path), 100, fmt)


def test_finetune_from_a_transformers_model(tmp_path):
    """Through torch_dist, which the trainer loads with megatron-core's own reader (the Mixtral fine-tune of
    test_hf_moe.py goes through datastates)."""
    source, ckpt = str(tmp_path / "source"), str(tmp_path / "ckpt")
    tiny_llama(source, vocab=128, seed=3, num_hidden_layers=4)
    _, out = convert("--from", "hf", "--to", "torch_dist", "--input", source, "--output", ckpt,
                     "--make-vocab-size-divisible-by", "64", "--tensor-model-parallel-size", "2")
    flags = finetune_flags(out) + ["--seq-length", "32", "--hidden-dropout", "0", "--attention-dropout", "0", *TRAIN]
    _, log = torchrun(4, flags + ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"])
    assert "for fine-tuning from iteration 0" in log, log[-3000:]
    tokens, labels = first_global_batch(flags, 2, 128)  # DP 1: 2 micro-batches of 2
    _, expected = hf_loss(hf_model(source), tokens, labels)
    assert math.isclose(float(losses(log)[1]), expected.item(), rel_tol=1e-5), (losses(log), expected.item())


MEASURE = """
import os, sys, resource
sys.path.insert(0, {root!r})
import safetensors, tqdm, torch
from tools import convert_checkpoint
from datastates.hf import export, source, writer
{preload}
def status(key):
    return int(next(l for l in open("/proc/self/status") if l.startswith(key)).split()[1]) * 1024
base = status("VmRSS:")
rc = convert_checkpoint.main(sys.argv[1:])
print("RSS", base, status("VmHWM:"), rc)
"""


def measured(tmp_path, *args: str, preload: str = "") -> int:
    """Peak RSS growth of a conversion run in a fresh process, past the modules it imports (`preload`)."""
    script = tmp_path / "measure.py"
    script.write_text(MEASURE.format(root=ROOT, preload=preload))
    _, out = run_script(str(script), *args, fresh=True)
    base, peak, rc = (int(x) for x in out.split("RSS ", 1)[1].split()[:3])
    assert rc == 0, out[-3000:]
    return peak - base


def larger_than(budget: int, directory: str, family: str) -> int:
    """A model of about 300 MB in fp32 built in `directory` (Llama: 6 layers, hidden 1024; Qwen3-MoE: 4 layers of
    8 experts, hidden 1024); its bytes."""
    if family == "llama":
        tiny_llama(directory, vocab=512, hidden_size=1024, intermediate_size=2816, num_attention_heads=8,
                   num_key_value_heads=8, num_hidden_layers=6)
    else:
        tiny_qwen(family, directory, vocab_size=512, hidden_size=1024, num_attention_heads=8, num_key_value_heads=8,
                  head_dim=128, num_hidden_layers=4, num_experts=8, moe_intermediate_size=704)
    state = sum(t.numel() * t.element_size() for t in load_file(os.path.join(directory, "model.safetensors")).values())
    assert state > 2 * budget
    return state


# what each measured conversion imports before its data: megatron-core, transformers' reading and writing
PRELOAD = {"datastates": "import megatron.training.arguments, datastates.megatron\nfrom tools.hf import load_hf, import_ckpt",
           "torch_dist": "import megatron.training.arguments, datastates.megatron, torch.distributed.checkpoint\n"
                         "from megatron.core import dist_checkpointing\n"
                         "from tools.hf import load_hf, import_ckpt\nfrom tools.checkpoint import torch_dist_writer"}


@pytest.mark.parametrize("fmt, family", [("datastates", "llama"), ("torch_dist", "llama"), ("datastates", "qwen3_moe")])
def test_import_and_export_of_a_model_larger_than_the_budget_stay_within_it(tmp_path, fmt, family):
    """In: one layer of the largest tensor (Llama's fc1: 23 MB; one expert's fc1 and a layer's qkv for Qwen3-MoE)
    and its pieces, beside the engine's 32 MiB staging (datastates) or one chunk being written (torch_dist). Out:
    one unit's tensors and the shard being written."""
    source, ckpt = str(tmp_path / "source"), str(tmp_path / "ckpt")
    budget = 128 << 20
    state = larger_than(budget, source, family)
    peak_in = measured(tmp_path, "--from", "hf", "--to", fmt, "--input", source, "--output", ckpt,
                       preload=PRELOAD[fmt])
    peak_out = measured(tmp_path, "--from", fmt, "--to", "hf", "--input", ckpt, "--output", str(tmp_path / "hf"),
                        preload=PRELOAD[fmt])
    assert peak_in < budget and peak_out < budget, (peak_in, peak_out, budget, state)
    assert_bit_equal(load_file(os.path.join(source, "model.safetensors")), hf_tensors(str(tmp_path / "hf")))


def tiny_tokenizer(directory: str) -> None:
    """A word-level tokenizer of 128 words (the trainer's mock data needs its end-of-document token), built here
    (tests never fetch from a hub)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    words = {f"w{i}": i for i in range(126)} | {"</s>": 126, "[UNK]": 127}
    tok = Tokenizer(models.WordLevel(words, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="</s>").save_pretrained(directory)


def test_export_carries_the_tokenizer(trained, tmp_path):
    """The run's own transformers tokenizer (GPT-2's run), or the one --tokenizer names (Llama's run had none)."""
    from transformers import AutoTokenizer
    tiny_tokenizer(str(tmp_path / "tok"))
    for arch, more in (("gpt2", ()), ("llama-tied-bias", ("--tokenizer", str(tmp_path / "tok")))):
        out = str(tmp_path / arch)
        convert("--from", "datastates", "--to", "hf", "--input", trained[arch][0], "--output", out, *more)
        assert AutoTokenizer.from_pretrained(out)("w5 w7 w125")["input_ids"] == [5, 7, 125]
        assert hf_model(out).config.vocab_size == 128
    convert("--from", "datastates", "--to", "hf", "--input", trained["llama-untied-gqa"][0], "--output",
            str(tmp_path / "none"))
    assert not [n for n in os.listdir(tmp_path / "none") if n.startswith("tokenizer")]


def _flip_byte_of(ckpt: str, tensor: str) -> None:
    """Corrupt one byte of the first written shard of `tensor` in its rank's data file."""
    meta_path = [os.path.join(ckpt, d, "metadata.json") for d in os.listdir(ckpt) if d.startswith("iter_")][0]
    meta = json.load(open(meta_path))
    rank, item = next((int(r), it) for r, doc in meta["ranks"].items() for it in doc["items"]
                      if it.get("name") == tensor and it.get("write", True))
    data = os.path.join(os.path.dirname(meta_path), f"rank_{rank:05d}.data")
    with open(data, "r+b") as f:
        f.seek(item["offset"] + 8)
        byte = f.read(1)
        f.seek(item["offset"] + 8)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_a_failed_export_leaves_nothing_behind(trained, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    shutil.copytree(trained["llama-untied-gqa"][0], ckpt)
    _flip_byte_of(ckpt, "output_layer.weight")  # the last tensor read: every shard before it is written
    out = tmp_path / "out" / "hf"
    rc, log = convert("--from", "datastates", "--to", "hf", "--input", ckpt, "--output", str(out), check=False)
    assert rc == 1 and "checksum mismatch" in log and "output_layer.weight" in log, log[-3000:]
    assert not out.exists() and no_leftovers(str(out.parent))

    out.mkdir()
    (out / "keep.txt").write_text("mine")
    rc, log = convert("--from", "datastates", "--to", "hf", "--input", trained["gpt2"][0], "--output", str(out),
                      check=False)
    assert rc == 1 and "already exists and is not empty" in log and os.listdir(out) == ["keep.txt"]
    rc, log = convert("--from", "datastates", "--to", "hf", "--input", trained["gpt2"][0], "--output",
                      str(tmp_path / "o2"), "--tokenizer", str(tmp_path), check=False)
    assert rc == 1 and "none of the tokenizer files" in log and not (tmp_path / "o2").exists()


@pytest.mark.parametrize("build, overrides, message", [
    (tiny_llama, {"vocab": 100, "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}},
     "rope_type 'linear'"),
    (tiny_llama, {"vocab": 100, "hidden_act": "gelu"}, "hidden_act is 'gelu' (needs 'silu')"),
    (tiny_gpt2, {"activation_function": "gelu_new"}, "activation_function is 'gelu_new' (needs 'gelu')"),
], ids=["llama-rope-scaling", "llama-gelu", "gpt2-gelu-new"])
def test_an_import_with_no_exact_equivalent_is_refused(tmp_path, build, overrides, message):
    build(str(tmp_path / "source"), **overrides)
    assert_import_refused(str(tmp_path / "source"), str(tmp_path), message)


@pytest.mark.parametrize("fmt", ["datastates", "torch_dist"])
def test_an_unreadable_import_leaves_nothing_behind(tmp_path, fmt):
    source = tmp_path / "source"
    tiny_llama(str(source), vocab=100)
    weights = source / "model.safetensors"
    os.truncate(weights, weights.stat().st_size - 1000)  # the header promises bytes the file lacks
    assert_import_refused(str(source), str(tmp_path), "model.safetensors", fmt)


def test_an_export_with_no_exact_equivalent_is_refused():
    from argparse import Namespace
    sys.path.insert(0, ROOT)
    from datastates.hf import HFError
    from datastates.hf.arch import geometry_from_args
    args = Namespace(position_embedding_type="rope", rotary_percent=1.0, normalization="LayerNorm", swiglu=False,
                     disable_bias_linear=False, group_query_attention=False, num_attention_heads=4, hidden_size=64,
                     kv_channels=None)
    with pytest.raises(HFError) as e:
        geometry_from_args(args, {}, "ckpt")
    assert "Llama (LlamaForCausalLM) differs: --normalization is 'LayerNorm' (needs 'RMSNorm'); --swiglu is " \
           "False (needs True)" in str(e.value)
    assert "GPT-2 (GPT2LMHeadModel) differs: --position-embedding-type is 'rope' (needs 'learned_absolute')" \
           in str(e.value)
    with pytest.raises(HFError, match="has no saved `args`"):
        geometry_from_args(None, {}, "ckpt")
    llama = {**vars(args), "normalization": "RMSNorm", "swiglu": True}  # Llama's flags, but a zero-centred gamma
    with pytest.raises(HFError, match="--apply-layernorm-1p: its norms scale by 1 \\+ weight"):
        geometry_from_args(Namespace(**llama, apply_layernorm_1p=True), {}, "ckpt")
    with pytest.raises(HFError, match="Mixtral \\(MixtralForCausalLM\\) differs: --normalization is 'LayerNorm'"):
        geometry_from_args(Namespace(**vars(args), num_experts=8), {}, "ckpt")


def _odd_tensors() -> dict:
    """Tensors whose sizes are no multiple of a block: every one after the first starts off a block boundary."""
    g = torch.Generator().manual_seed(5)
    return {"a.weight": torch.randn(3, 1000, generator=g), "b.bias": torch.randn(777, generator=g).to(torch.bfloat16),
            "c.weight": torch.randn(1 << 18, generator=g), "d.weight": torch.randn(5, 333, generator=g).t()}


def _write(storage, directory: str, tensors: dict, max_bytes: int, in_flight_bytes: int) -> None:
    from datastates.hf.writer import Planned, ShardedWriter, plan_shards
    shards = plan_shards([Planned(n, tuple(t.shape), t.dtype) for n, t in tensors.items()], max_bytes)
    writer = ShardedWriter(storage, directory, shards, in_flight_bytes=in_flight_bytes)
    try:
        for name, t in tensors.items():
            writer.write(name, t)
    except BaseException:
        writer.abort()
        raise
    writer.close()


@pytest.mark.parametrize("in_flight_bytes", [0, 1 << 20], ids=["one-at-a-time", "in-flight"])
def test_sharded_files_load_as_written_with_their_data_on_a_block(tmp_path, in_flight_bytes):
    """Odd sizes, bf16 beside fp32, a transposed (strided) tensor, files of one tensor and of several, writes one
    at a time or several in flight: safetensors loads every tensor as written, and each file's data starts on a
    4 KiB boundary (what lets O_DIRECT write a tensor from its pages)."""
    from datastates import storage_for
    tensors = _odd_tensors()
    out = str(tmp_path / "hf")
    os.makedirs(out)
    _write(storage_for(out), out, tensors, 20_000, in_flight_bytes)
    index = json.load(open(os.path.join(out, "model.safetensors.index.json")))
    files = sorted(set(index["weight_map"].values()))
    assert len(files) == 3
    loaded = {}
    for name in files:
        with open(os.path.join(out, name), "rb") as f:
            assert (8 + int.from_bytes(f.read(8), "little")) % 4096 == 0, name
        loaded.update(load_file(os.path.join(out, name)))
    assert loaded.keys() == tensors.keys()
    for name, t in tensors.items():
        assert loaded[name].dtype == t.dtype and torch.equal(loaded[name], t), name


def test_a_failure_while_writes_are_in_flight_ends_them_and_is_raised(tmpfs):
    """A 2 MiB disk has room for the first of three 1 MiB files: opening the second fails while the first's writes
    may still be in flight. The disk's error is raised, naming the second file, once every write handed over has
    ended: the first file holds all its bytes."""
    import errno
    from datastates import storage_for
    mnt = tmpfs("2m")
    storage = storage_for(str(mnt))
    tensors = {f"t{k}": torch.full((1 << 18,), float(k + 1)) for k in range(3)}
    with pytest.raises(OSError) as failure:
        _write(storage, str(mnt), tensors, 1 << 20, 8 << 20)
    assert failure.value.errno == errno.ENOSPC and "model-00002-of-00003.safetensors" in str(failure.value)
    assert torch.equal(load_file(str(mnt / "model-00001-of-00003.safetensors"))["t0"], tensors["t0"])
    storage.close()


def test_two_exports_to_one_output_never_share_a_file_and_the_later_is_refused(tmp_path):
    """Two conversions to one output, interleaved as two processes may run them: both pass the check at start,
    both write their whole model, then the first commits. Each wrote under a name of its own, so the output holds
    the first's tensors exactly; the second is refused naming the output, and leaves nothing behind."""
    from datastates import storage_for
    from datastates.hf import HFError
    from datastates.hf.writer import OutputDirectory
    storage, out = storage_for(str(tmp_path)), str(tmp_path / "hf")
    first, second = _odd_tensors(), {n: t * 2 for n, t in _odd_tensors().items()}
    a, b = OutputDirectory(storage, out), OutputDirectory(storage, out)
    a.__enter__()
    b.__enter__()
    _write(storage, a.path, first, 20_000, 0)
    _write(storage, b.path, second, 20_000, 0)
    a.__exit__(None, None, None)
    with pytest.raises(HFError, match="already exists and is not empty"):
        b.__exit__(None, None, None)
    loaded = {}
    for name in sorted(os.listdir(out)):
        if name.endswith(".safetensors"):
            loaded.update(load_file(os.path.join(out, name)))
    assert loaded.keys() == first.keys() and all(torch.equal(loaded[n], t) for n, t in first.items())
    assert os.listdir(tmp_path) == ["hf"]
    storage.close()
