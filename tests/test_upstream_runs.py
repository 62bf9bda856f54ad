"""Upstream's GPT-3, Llama-3 (the bf16 variant of its fp8 script) and Mixtral launch scripts, scaled to 4 CPU
ranks, run 8 iterations with --async-ckpt on a real blended corpus with their real tokenizer kind, save, and
resume exactly: the flags refused on CPU ranks are left out, and named here (GPT-3's script has none: its
--step-batch-size-schedule runs, and the resume lands where the batch size grows)."""
import pytest

from corpus import documents, gpt2_bpe, hf_dir, preprocess, sentencepiece_model, write_jsonl
from megatron_helpers import torchrun
from test_data_resume import iterations
from test_upstream_scripts import classify, without
from upstream_scripts import argv

REFUSED_ON_CPU = {
    "gpt3_175b": set(),
    "llama3_8b_fp8": {"--attention-backend", "--apply-layernorm-1p", "--cross-entropy-loss-fusion",
                      "--empty-unused-memory-level", "--overlap-grad-reduce", "--overlap-param-gather", "--profile",
                      "--vocab-size"},  # its real-data branch passes one with a tokenizer that has its own
    "mixtral_8x7b": {"--moe-grouped-gemm", "--overlap-grad-reduce", "--overlap-param-gather"},
}


def tokenizer(name: str, directory: str) -> tuple[dict, list[str]]:
    """(argv's tokenizer placeholders, the preprocessing tool's tokenizer flags) of the script's kind."""
    if name == "gpt3_175b":
        vocab, merge = gpt2_bpe(directory)
        return {"vocab": vocab, "merge": merge}, ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab,
                                                  "--merge-file", merge]
    if name == "mixtral_8x7b":
        model = sentencepiece_model(directory)
        return {"tokenizer": model}, ["--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model", model]
    model = hf_dir(directory)
    return {"tokenizer": model}, ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", model]


@pytest.mark.parametrize("name", ["gpt3_175b", "llama3_8b_fp8", "mixtral_8x7b"])
def test_upstream_script_runs_saves_and_resumes_exactly(name, tmp_path):
    placeholders, tokenizer_flags = tokenizer(name, str(tmp_path / "tokenizer"))
    blend = []
    for seed, (part, weight) in enumerate((("a", "0.4"), ("b", "0.6"))):
        jsonl = write_jsonl(str(tmp_path / f"{part}.jsonl"), documents(100, seed=20 + seed))
        rc, out = preprocess(jsonl, str(tmp_path / part), tokenizer_flags, "--append-eod")
        assert rc == 0, out[-3000:]
        blend += [weight, str(tmp_path / f"{part}_text_document")]
    sides = ("real_data",) if name == "llama3_8b_fp8" else ()  # the bf16 variant: without the fp8 side

    def command(save: str) -> list[str]:
        words = argv(name, *sides, save=save, tensorboard=str(tmp_path / "tb"), cache=str(tmp_path / "cache"),
                     data=blend, **placeholders)
        _, refused = classify(words)
        assert set(refused) == REFUSED_ON_CPU[name], refused
        # the documented change besides --async-ckpt: a script's --ckpt-format torch_dist goes (Llama-3's); and
        # Mixtral's script loads weights only (--no-load-optim --no-load-rng, for converted weights): an exact
        # resume loads everything
        dropped = {"--ckpt-format", "--no-load-optim", "--no-load-rng"}
        return without(words, set(refused) | dropped) + ["--async-ckpt", "--no-ckpt-fsync"]

    _, straight = torchrun(4, command(str(tmp_path / "straight")), timeout=600)
    ck = str(tmp_path / "ck")
    _, first = torchrun(4, command(ck) + ["--exit-interval", "4"], timeout=600)
    _, resumed = torchrun(4, command(ck), timeout=600)
    assert f"successfully loaded checkpoint from {ck} (datastates) at iteration 4" in resumed, resumed[-3000:]
    straight, first, resumed = iterations(straight), iterations(first), iterations(resumed)
    assert sorted(straight) == list(range(1, 9)) and sorted(first) == [1, 2, 3, 4]
    assert sorted(resumed) == [5, 6, 7, 8]
    if name == "gpt3_175b":  # "0:1 128:2 384:4" in tokens of 64: batch 1, 2 from 2 samples on, 4 from 6 on
        assert [straight[i][2] for i in range(1, 9)] == ["1", "1", "2", "2", "4", "4", "4", "4"]
    assert {**first, **resumed} == straight  # samples, learning rate, batch size and loss, bit for bit
