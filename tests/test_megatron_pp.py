"""Pipeline parallelism on CPU: PP2 trains (GPipe over gloo send/recv), its per-stage sharded state dicts save
and resume, and the PP2 checkpoint reshards into a PP1 (single rank) model that continues with the same losses.
Dropout is off so that PP1 and PP2 compute the same function (their RNG streams differ per stage). With a
multi-token prediction layer (megatron-core puts it on the last stage), its losses continue the same way too."""
import pytest

from megatron_helpers import TINY, losses, torchrun
from test_deepseek import MTP_FLAGS, mtp_losses

FLAGS = TINY + ["--global-batch-size", "4", "--train-iters", "6", "--untie-embeddings-and-output-weights",
                "--hidden-dropout", "0", "--attention-dropout", "0"]


@pytest.mark.parametrize("model", [[], ["--position-embedding-type", "rope", *MTP_FLAGS]], ids=["gpt", "mtp"])
def test_pp2_save_resume_and_reshard_to_pp1(tmp_path, model):
    ck, other = str(tmp_path / "pp2"), str(tmp_path / "pp1")
    flags = FLAGS + model
    pp2 = flags + ["--pipeline-model-parallel-size", "2", "--save", ck, "--load", ck, "--save-interval", "3",
                   "--async-ckpt"]
    _, log1 = torchrun(2, pp2 + ["--exit-interval", "3"])
    assert sorted(losses(log1)) == [1, 2, 3]
    # reshard: the PP2 checkpoint (layer 0 on stage 0, layer 1 on stage 1) into one rank holding both layers
    _, log_pp1 = torchrun(1, flags + ["--load", ck, "--save", other, "--save-interval", "3"])
    assert "at iteration 3" in log_pp1
    # resume PP2 from its own checkpoint
    _, log2 = torchrun(2, pp2)
    assert "at iteration 3" in log2
    pairs = {"lm": (losses(log2), losses(log_pp1))}
    if model:
        pairs["mtp_1"] = (mtp_losses(log2), mtp_losses(log_pp1))
    for kind, (a, b) in pairs.items():
        assert sorted(a) == sorted(b) == [4, 5, 6], (kind, a, b)
        for i in a:
            assert float(a[i]) == pytest.approx(float(b[i]), rel=1e-5, abs=1e-6), (kind, i, a[i], b[i])
