"""Every checkpoint flag of upstream's launch scripts is honoured or refused with its reason, never argparse's bare
"unrecognized arguments": upstream's checkpoint group of each pinned megatron-core release
(tests/fixtures/upstream_checkpoint_flags.json), checked against this trainer's parser and refusals. Where the
installed megatron-core ships upstream's own `megatron/training` (0.17 and later), its group is built by its own
parser here, so a release that adds a flag fails this test until the flag is placed."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from megatron.training.arguments import ArgumentError, build_parser, parse_args
from megatron.training.refused_flags import REFUSED
from megatron_helpers import ROOT

UPSTREAM = json.load(open(os.path.join(ROOT, "tests", "fixtures", "upstream_checkpoint_flags.json")))
# upstream's own parser, from site-packages only (this repository's megatron/training left off the path)
BUILD_UPSTREAM_GROUP = """
import argparse, json, os, sys
root = os.path.realpath(sys.argv[1])  # this repository (its own megatron/training), not the venv inside it
sys.path = [p for p in sys.path if p and os.path.realpath(p) != root]
import megatron.training.arguments as upstream
assert upstream.__file__.startswith(sys.argv[2]), upstream.__file__
parser = argparse.ArgumentParser(add_help=False)
upstream._add_checkpointing_args(parser)
print(json.dumps(sorted(o for a in parser._actions for o in a.option_strings)))
"""


def _known() -> set[str]:
    return {o for a in build_parser()._actions for o in a.option_strings}


@pytest.mark.parametrize("release", sorted(UPSTREAM["checkpointing"]))
def test_every_upstream_checkpoint_flag_is_honoured_or_refused(release):
    flags = UPSTREAM["checkpointing"][release] + UPSTREAM["elsewhere"]
    known = _known()
    assert [f for f in flags if f not in known and f not in REFUSED] == []
    assert [f for f in flags if f in known and f in REFUSED] == []  # never both


def test_a_refused_checkpoint_flag_names_its_reason_and_the_run_lists_them_all():
    with pytest.raises(ArgumentError) as e:
        parse_args(argv=["--save-retain-interval", "100", "--non-persistent-global-ckpt-dir", "/x", "--bogus"])
    text = str(e.value)
    assert "--save-retain-interval: retention of every N-th checkpoint is not built here; --ckpt-keep-last" in text
    assert "--non-persistent-global-ckpt-dir: belongs to --non-persistent-ckpt-type global" in text
    assert "unrecognized: --bogus" in text


def test_the_upstream_spellings_reach_the_same_settings():
    args = parse_args(argv=["--persistent-save-interval", "7", "--disable-ckpt-fully-parallel-save",
                            "--no-initialization", "--ckpt-step", "3", "--pretrained-checkpoint", "base"])
    assert (args.save_interval, args.ckpt_fully_parallel_save, args.perform_initialization) == (7, False, False)
    assert (args.ckpt_step, args.pretrained_checkpoint) == (3, "base")
    assert parse_args(argv=[]).perform_initialization is True


def test_the_list_is_the_installed_megatron_cores_own():
    """The installed release's group, built by upstream's parser, is the fixture's list of that release."""
    import megatron.core
    from megatron.core.package_info import __version__
    release = __version__.split("+")[0]
    site = os.path.dirname(os.path.dirname(os.path.dirname(megatron.core.__file__)))
    if not os.path.isfile(os.path.join(site, "megatron", "training", "arguments.py")):
        pytest.skip(f"megatron-core {__version__} ships no megatron/training (its list is the fixture's)")
    out = subprocess.run([sys.executable, "-c", BUILD_UPSTREAM_GROUP, ROOT, site], cwd="/", capture_output=True,
                         text=True, timeout=300, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert out.returncode == 0, out.stderr[-3000:]
    installed = json.loads(out.stdout.splitlines()[-1])
    assert release in UPSTREAM["checkpointing"], f"add megatron-core {release}'s list to the fixture: {installed}"
    assert installed == UPSTREAM["checkpointing"][release]
