"""Shared by the Hugging Face tests (test_hf.py, test_hf_moe.py, test_hf_deepseek.py, test_hf_qwen.py): run the
converter and tests/hf_reference.py, load what they write with transformers, compare tensors bit for bit, and the
trainer's first global batch."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from argparse import Namespace

import torch
from safetensors.torch import load_file

from megatron_helpers import ROOT, losses, torchrun
from rank_launcher import environment, run_python

TRAIN = ["--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-3", "--mock-data", "--seed", "1234",
         "--train-iters", "2"]


def run_script(script: str, *args: str, check: bool = True, fresh: bool = False) -> tuple[int, str]:
    """`python script args`: forked from the test launcher (torch, megatron-core, transformers imported), or in a
    `fresh` process (for what measures the process's own memory)."""
    if fresh:
        p = subprocess.run([sys.executable, script, *args], cwd=ROOT, env=environment(),
                           capture_output=True, text=True, timeout=300)
        rc, out = p.returncode, p.stdout + p.stderr
    else:
        rc, out = run_python(script, *args)
    assert not check or rc == 0, out[-4000:]
    return rc, out


def convert(*args: str, check: bool = True) -> tuple[int, str]:
    return run_script("tools/convert_checkpoint.py", *args, check=check)


def reference(ckpt: str, out: str, flags: list[str]) -> dict:
    """megatron-core's tokens, labels, logits and per-token losses on the first micro-batch (hf_reference.py)."""
    run_script("tests/hf_reference.py", ckpt, out, *flags)
    return torch.load(out)


def finetune_flags(convert_output: str) -> list[str]:
    """The `pretrain_gpt.py --finetune --load CKPT <model flags>` line `--from hf` printed, without the script."""
    flags = convert_output.split("fine-tune with: ", 1)[1].split("\n", 1)[0].split()
    assert flags[:3] == ["pretrain_gpt.py", "--finetune", "--load"], flags
    return flags[1:]


def hf_model(directory: str):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


def hf_loss(model, tokens: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        logits = model(tokens).logits
    return logits, torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def hf_tensors(directory: str) -> dict[str, torch.Tensor]:
    index = json.load(open(os.path.join(directory, "model.safetensors.index.json")))
    out = {}
    for file in sorted(set(index["weight_map"].values())):
        out.update(load_file(os.path.join(directory, file)))
    assert set(out) == set(index["weight_map"])
    return out


def assert_bit_equal(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
        assert torch.equal(a[name].view(torch.uint8), b[name].view(torch.uint8)), name


def no_leftovers(parent: str) -> bool:
    return not [n for n in os.listdir(parent) if ".partial" in n]


def first_global_batch(flags: list[str], micro_batches: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, labels) of a run's first global batch of `micro_batches` micro-batches, from the trainer's own
    data set built on one rank (`flags` without a parallel layout)."""
    from megatron.training.arguments import parse_args
    from megatron.training.argument_checks import validate_args
    from megatron.training.data import MicroBatches, build_train_valid_test_datasets
    from megatron.training.initialize import setup_data_and_schedule
    args = validate_args(parse_args(argv=flags), 1)
    tokenizer = setup_data_and_schedule(args, 0)
    batches = MicroBatches(build_train_valid_test_datasets(args, tokenizer)[0], 0, args.micro_batch_size, 0, 1,
                           vocab_size=vocab)
    first = [next(batches) for _ in range(micro_batches)]
    return torch.cat([b["tokens"] for b in first]), torch.cat([b["labels"] for b in first])


def assert_round_trip(source: str, work: str, vocab: int, fmt: str = "datastates",
                      ckpt: str | None = None) -> dict[str, torch.Tensor]:
    """The transformers model at `source` imported into `ckpt` (default `work`/ckpt; an s3:// URL works too) as
    `fmt` and exported back to `work`/back: every tensor bit-equal and the same logits (token ids below `vocab`);
    the source's tensors."""
    ckpt, back = ckpt or os.path.join(work, "ckpt"), os.path.join(work, "back")
    convert("--from", "hf", "--to", fmt, "--input", source, "--output", ckpt)
    convert("--from", fmt, "--to", "hf", "--input", ckpt, "--output", back)
    original = load_file(os.path.join(source, "model.safetensors"))
    assert_bit_equal(original, hf_tensors(back))
    tokens = torch.arange(64).reshape(2, 32) % vocab
    assert torch.equal(hf_loss(hf_model(source), tokens, tokens)[0], hf_loss(hf_model(back), tokens, tokens)[0])
    return original


def assert_import_refused(source: str, work: str, message: str, fmt: str = "datastates") -> None:
    """`--from hf --to fmt` of `source` exits 1 saying `message`, and writes nothing at `work`/ckpt."""
    ckpt = os.path.join(work, "ckpt")
    rc, log = convert("--from", "hf", "--to", fmt, "--input", source, "--output", ckpt, check=False)
    assert rc == 1 and message in log, log[-3000:]
    assert not os.path.exists(ckpt)


def assert_computes_as_megatron_core(model, ref: dict) -> None:
    """The transformers `model`'s logits and loss on `reference`'s micro-batch (2 x 32 tokens, vocabulary 128)
    equal megatron-core's in fp32: logits within 1e-4 of their largest magnitude, the loss within 1e-4."""
    logits, loss = hf_loss(model, ref["tokens"], ref["labels"])
    megatron_logits = ref["logits"][..., :logits.shape[-1]]
    assert logits.shape == megatron_logits.shape == (2, 32, 128)
    assert (logits - megatron_logits).abs().max() <= 1e-4 * megatron_logits.abs().max()
    assert math.isclose(loss.item(), ref["losses"].mean().item(), rel_tol=1e-4)


def assert_finetune_starts_from_transformers(source: str, ckpt: str, printed: set[str], layout: list[str],
                                             save: str | None = None) -> list[str]:
    """The transformers model at `source` (vocabulary 128) imported to `ckpt` and fine-tuned on 2 ranks in `layout`
    (its last iteration saved under `save`, if given): the printed flags include `printed`, and the trainer's first
    loss is transformers' loss on that global batch. Returns the model and training flags of the run."""
    _, out = convert("--from", "hf", "--to", "datastates", "--input", source, "--output", ckpt,
                     "--make-vocab-size-divisible-by", "64")
    flags = finetune_flags(out)
    assert printed <= set(flags), flags
    flags += ["--seq-length", "32", "--hidden-dropout", "0", "--attention-dropout", "0", *TRAIN]
    _, log = torchrun(2, flags + layout + (["--save", save, "--save-interval", "2"] if save else []))
    assert "for fine-tuning from iteration 0" in log, log[-3000:]
    tokens, labels = first_global_batch(flags, 2, 128)  # DP 2: one micro-batch of 2 a rank
    _, expected = hf_loss(hf_model(source), tokens, labels)
    assert math.isclose(float(losses(log)[1]), expected.item(), rel_tol=1e-5), (losses(log), expected.item())
    return flags[3:]  # without --finetune --load CKPT


def export_refusal(flags: list[str], shapes: dict | None = None, **changes) -> str:
    """The message with which the export refuses a checkpoint saved with `flags` (as pretrain_gpt.py saves them),
    with `changes`, whose tensors have `shapes` (none by default: the flags are refused first)."""
    import pytest
    sys.path.insert(0, ROOT)
    from megatron.training.arguments import parse_args
    from datastates.hf import HFError
    from datastates.hf.arch import geometry_from_args
    with pytest.raises(HFError) as e:
        geometry_from_args(Namespace(**{**vars(parse_args(argv=flags)), **changes}), shapes or {}, "ckpt")
    return str(e.value)


def tiny_llama(directory: str, vocab: int, seed: int = 0, **overrides) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = dict(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=32, rope_theta=10000.0, tie_word_embeddings=False)
    LlamaForCausalLM(LlamaConfig(**{**cfg, **overrides})).save_pretrained(directory)
