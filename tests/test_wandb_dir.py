"""W&B's run directory: under --save/wandb for a local --save, a local ./wandb when --save is a URL or unset (never
a local path named after the URL); offline without a key (in-process, wandb's real offline run)."""
import os

import pytest

from megatron.training.arguments import parse_args
from megatron.training.metrics import _wandb_run


@pytest.mark.parametrize("save", ["s3://bucket/run", None, "local"])
def test_the_wandb_directory_is_local(tmp_path, monkeypatch, save):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    args = parse_args(argv=["--wandb-project", "p"] + (["--save", save] if save else []))
    run = _wandb_run(args)
    try:
        where = os.path.realpath(run.dir)
    finally:
        run.finish()
    expected = tmp_path / ("local/wandb" if save == "local" else "wandb")
    assert where.startswith(os.path.realpath(expected) + os.sep), where
    assert not (tmp_path / "s3:").exists()
