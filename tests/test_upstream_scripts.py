"""Upstream Megatron-LM's launch scripts (their flags rebuilt in tests/upstream_scripts.py): every flag is
honoured or refused before any work with its reason, never unrecognized or silently dropped; the counts per
script are the ones docs/from-megatron-lm.md publishes. In-process: parsing and validation only, at 4 CPU ranks,
with tiny tokenizer files built here."""
import os
import re

import pytest

from corpus import gpt2_bpe, hf_dir, sentencepiece_model
from megatron_helpers import ROOT
from upstream_scripts import SCRIPTS, argv

from megatron.training.arguments import ArgumentError, build_parser, parse_args
from megatron.training.argument_checks import validate_args

DOC = os.path.join(ROOT, "docs", "from-megatron-lm.md")
ROW_RE = re.compile(r"^\| `(\w+)` \| (\d+) \| (\d+) \| (\d+) \|", re.M)


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    d = tmp_path_factory.mktemp("upstream")
    vocab, merge = gpt2_bpe(str(d / "bpe"))
    return {"save": str(d / "ckpt"), "tensorboard": str(d / "tb"), "cache": str(d / "cache"),
            "data": str(d / "corpus_text_document"), "vocab": vocab, "merge": merge,
            "hf": hf_dir(str(d / "hf")), "sp": sentencepiece_model(str(d / "sp"))}


def script_argv(name: str, paths: dict, sides=None) -> list[str]:
    tokenizer = paths["sp"] if name == "mixtral_8x7b" else paths["hf"]
    return argv(name, *(SCRIPTS[name].default_sides if sides is None else sides), tokenizer=tokenizer, **paths)


def flags_of(words: list[str]) -> list[str]:
    return [w for w in words if w.startswith("--")]


def without(words: list[str], drop: set[str]) -> list[str]:
    """`words` without the flags in `drop` and their values."""
    out, dropping = [], False
    for w in words:
        if w.startswith("--"):
            dropping = w in drop
        if not dropping:
            out.append(w)
    return out


def classify(words: list[str]) -> tuple[list[str], dict[str, str]]:
    """(the flags honoured, {flag refused: the reason given}) for one command line at 4 CPU ranks: the refusals
    at parsing all at once, then validation's one by one (each names its flag first)."""
    refused = {}
    try:
        parse_args(argv=words)
    except ArgumentError as e:
        for line in str(e).splitlines()[1:]:
            flag, reason = line.strip().split(": ", 1)
            refused[flag] = reason
    remaining = without(words, set(refused))
    while True:
        try:
            validate_args(parse_args(argv=remaining), 4, cuda=False)
            break
        except ArgumentError as e:
            flag = re.match(r"(--[a-z0-9-]+)", str(e))
            assert flag and flag.group(1) in flags_of(remaining), f"a refusal that names no flag first: {e}"
            refused[flag.group(1)] = str(e)
            remaining = without(remaining, {flag.group(1)})
    return [f for f in dict.fromkeys(flags_of(words)) if f not in refused], refused


@pytest.mark.parametrize("name", SCRIPTS)
def test_every_flag_of_every_side_is_known_or_refused_with_a_reason(name, paths):
    """No flag of any branch of the script is unknown to this trainer (argparse's 'unrecognized')."""
    from megatron.training.refused_flags import REFUSED
    known = {o for a in build_parser()._actions for o in a.option_strings}
    spec = SCRIPTS[name]
    every = set(spec.flags) | {f for side in spec.sides.values() for f in side}
    assert sorted(every - known - set(REFUSED)) == []


@pytest.mark.parametrize("name", SCRIPTS)
def test_the_script_as_launched_is_honoured_or_refused_flag_by_flag(name, paths):
    honoured, refused = classify(script_argv(name, paths))
    for flag, reason in refused.items():
        assert len(reason) > 30, (flag, reason)  # a reason, not a bare "no"
    counts = {m.group(1): tuple(int(g) for g in m.groups()[1:]) for m in ROW_RE.finditer(open(DOC).read())}
    assert counts[name] == (len(honoured) + len(refused), len(honoured), len(refused)), \
        f"{name}: honoured {honoured}\nrefused {sorted(refused)}"


def test_a_refused_flag_stops_the_run_before_any_work_naming_every_refusal(capsys):
    with pytest.raises(ArgumentError) as e:
        parse_args(argv=["--fp8-format", "hybrid", "--init-model-with-meta-device", "--num-layers", "2"])
    lines = str(e.value).splitlines()
    assert [line.split(":")[0].strip() for line in lines[1:]] == ["--fp8-format", "--init-model-with-meta-device"]
    with pytest.raises(SystemExit) as e:  # a flag upstream does not have either is argparse's own error
        parse_args(argv=["--no-such-flag"])
    assert e.value.code == 2 and "unrecognized arguments: --no-such-flag" in capsys.readouterr().err
