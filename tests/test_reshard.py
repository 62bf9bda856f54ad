"""Resharding on load, end to end through pretrain_gpt.py: a checkpoint saved with one TP/PP/DP layout loads
into another, model AND optimizer state (Adam moments, step), scheduler, iteration and consumed samples.

One uninterrupted TP2xPP2 run (4 ranks, 2N iterations, checkpoint at N) is both the source checkpoint and the
reference loss curve. Each target layout then runs `pretrain_gpt.py --load <source iter N> --save-after-load`:
the state it loaded is written back out at iteration N in the target layout, and training goes on to 2N.

- every full (unsharded) tensor of the target's iteration-N checkpoint equals the source's bit for bit (a
  reshard is a copy), and so does the common state (iteration, consumed samples, scheduler, optimizer
  hyper-parameters and step); the full tensors are assembled here with the engine's own reader
  (`CheckpointEngine.load` with a whole-tensor template per global name, from the manifests), no tools/ needed;
- the resumed losses N+1..2N match the uninterrupted TP2xPP2 run within float tolerance (TP and PP change the
  order of reductions, so not bit for bit);
- the per-rank RNG states of another layout are not loaded (a notice says so, RNGs are re-seeded); dropout is
  off so that the losses do not depend on them.

Layouts: TP2xPP2 -> TP1xPP1, TP2xPP2 -> TP1xPP2, TP2xPP2 -> TP2xPP1xDP2, and TP1 -> TP2 (from the TP1xPP1
checkpoint written by the first target into TP2xPP1).
"""
from __future__ import annotations

import json
import os

import pytest
import torch

from megatron_helpers import losses, torchrun

N = 3
# 4 layers so that PP2 splits 2/2; vocab 128 padded to a multiple of 64 * TP = 128 under TP1 and TP2 alike (the
# padded vocabulary is part of the model's function: the softmax runs over it).
FLAGS = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--vocab-size", "128", "--make-vocab-size-divisible-by", "64", "--micro-batch-size", "2",
         "--global-batch-size", "8", "--lr", "1e-3", "--mock-data", "--seed", "1234",
         "--untie-embeddings-and-output-weights", "--hidden-dropout", "0", "--attention-dropout", "0",
         "--train-iters", str(2 * N), "--no-ckpt-fsync"]


def layout(tp: int, pp: int) -> list[str]:
    return ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp)]


def iter_dir(root: str, it: int) -> str:
    return os.path.join(root, f"iter_{it:07d}")


# ----- full tensors of a datastates checkpoint, with the engine's own reader -----

class _Whole:
    """The whole of a global item: a tensor of its global shape at offset 0, or a named object."""

    def __init__(self, name: str, tensor: torch.Tensor | None = None):
        self.name, self.tensor = name, tensor


def _registry():
    from datastates.providers import (ContainerProvider, ObjectProvider, ProviderRegistry, StateProvider,
                                      TensorProvider)

    class WholeProvider(StateProvider):
        def accepts(self, value):
            return isinstance(value, _Whole)

        def flatten(self, value, path, ctx):
            if value.tensor is None:
                return ctx.add_object(value.name, None, scope="global", name=value.name)
            t = value.tensor
            return ctx.add_tensor(value.name, t, scope="global", name=value.name, global_shape=tuple(t.shape),
                                  global_offset=(0,) * t.dim())

    return ProviderRegistry([WholeProvider(), ContainerProvider(), TensorProvider(), ObjectProvider()])


def global_items(ckpt: str) -> dict[str, dict]:
    """name -> a manifest entry of every global item written into the checkpoint (any rank)."""
    meta = json.load(open(os.path.join(ckpt, "metadata.json")))
    out = {}
    for r in range(meta["world_size"]):
        doc = json.load(open(os.path.join(ckpt, f"rank_{r:05d}.manifest.json")))
        for it in doc["items"]:
            if it.get("scope") == "global" and it.get("write", True):
                prev = out.setdefault(it["name"], it)
                if it["kind"] == "tensor":
                    assert prev["global_shape"] == it["global_shape"] and prev["dtype"] == it["dtype"], it["name"]
    return out


def read_full(ckpt: str) -> tuple[dict[str, torch.Tensor], dict[str, object]]:
    """(every global tensor assembled whole, every global object) of a published datastates checkpoint."""
    from datastates import CheckpointEngine, PosixOptions
    from datastates.schema import dtype_from_name
    items = global_items(ckpt)
    template = {}
    for name, it in items.items():
        if it["kind"] == "tensor":
            template[name] = _Whole(name, torch.full(tuple(it["global_shape"]), float("nan"),
                                                     dtype=dtype_from_name(it["dtype"])))
        else:
            template[name] = _Whole(name)
    with CheckpointEngine(host_buffer_bytes=64 << 20, storage=PosixOptions(writer_threads=2), rank=0, world_size=1,
                          registry=_registry()) as engine:
        loaded = engine.load(ckpt, template=template, rank=0)
    tensors = {k: v for k, v in loaded.items() if items[k]["kind"] == "tensor"}
    objects = {k: v for k, v in loaded.items() if items[k]["kind"] == "object"}
    return tensors, objects


def _comparable_objects(objects: dict) -> dict:
    """The common state that must survive a reshard unchanged: all but args and the per-rank RNG states."""
    return {k: v for k, v in objects.items() if k != "common:args" and not k.startswith("rng_state")}


def _plain(x):
    """Objects as comparable values (tensors inside scheduler/optimizer state become lists)."""
    if isinstance(x, torch.Tensor):
        return ("tensor", str(x.dtype), x.tolist())
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x


def assert_same_tensors(st: dict, dt: dict, src: str, dst: str) -> int:
    """Every full tensor of `dst` (model, fp32 main params, moments) equals `src`'s, bit for bit. Returns #."""
    assert sorted(st) == sorted(dt), (sorted(set(st) ^ set(dt)))
    assert any(k.startswith("optimizer.state.exp_avg.") for k in st), sorted(st)
    assert any(k.startswith("optimizer.state.exp_avg_sq.") for k in st), sorted(st)
    for name in st:
        a, b = st[name], dt[name]
        assert a.dtype == b.dtype and a.shape == b.shape, (name, a.dtype, a.shape, b.dtype, b.shape)
        assert not torch.isnan(a).any(), f"{name}: not fully covered in {src}"
        assert torch.equal(a, b), f"{name} differs between {src} and {dst}"
    return len(st)


def assert_same_state(src: str, dst: str) -> int:
    """Every full tensor and every common object of `dst` equals `src`'s, bit for bit. Returns #tensors."""
    st, so = read_full(src)
    dt, do = read_full(dst)
    n = assert_same_tensors(st, dt, src, dst)
    sc, dc = _comparable_objects(so), _comparable_objects(do)
    assert sorted(sc) == sorted(dc), sorted(set(sc) ^ set(dc))
    for name in ("common:iteration", "common:train_state", "common:opt_param_scheduler",
                 "common:optimizer/state/common_step", "common:optimizer/param_groups/0/lr"):
        assert name in sc, sorted(sc)
    for name in sc:
        assert _plain(sc[name]) == _plain(dc[name]), (name, sc[name], dc[name])
    return n


def assert_close_losses(got: dict, ref: dict, iters, what: str):
    assert sorted(got) == list(iters), (what, got)
    for i in iters:
        assert float(got[i]) == pytest.approx(float(ref[i]), rel=1e-4, abs=1e-6), (what, i, got[i], ref[i])


# ----- the runs -----

@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """Uninterrupted TP2xPP2 run of 2N iterations that saves at N (lazy async): reference losses + checkpoint."""
    root = str(tmp_path_factory.mktemp("reshard") / "tp2pp2")
    _, log = torchrun(4, FLAGS + layout(2, 2) + ["--save", root, "--save-interval", str(N), "--async-ckpt"])
    ref = losses(log)
    assert sorted(ref) == list(range(1, 2 * N + 1)), log[-3000:]
    assert os.path.isfile(os.path.join(iter_dir(root, N), "metadata.json"))
    return root, ref


def _reshard(nproc: int, tp: int, pp: int, load: str, save: str) -> str:
    _, log = torchrun(nproc, FLAGS + layout(tp, pp) + ["--load", load, "--save", save, "--save-after-load"])
    assert f"at iteration {N}" in log, log[-3000:]
    assert os.path.isfile(os.path.join(iter_dir(save, N), "metadata.json")), log[-3000:]
    return log


@pytest.mark.parametrize("nproc,tp,pp", [(1, 1, 1), (2, 1, 2), (4, 2, 1)],
                         ids=["tp2pp2-to-tp1pp1", "tp2pp2-to-tp1pp2", "tp2pp2-to-tp2pp1dp2"])
def test_reshard_from_tp2pp2(tmp_path, source, nproc, tp, pp):
    root, ref = source
    dst = str(tmp_path / "dst")
    log = _reshard(nproc, tp, pp, iter_dir(root, N), dst)
    assert "RNGs re-seeded" in log, log[-3000:]
    assert f"from TP2xPP2xDP1 to TP{tp}xPP{pp}xDP{nproc // (tp * pp)}" in log, log[-3000:]
    n = assert_same_state(iter_dir(root, N), iter_dir(dst, N))
    assert n > 20
    assert_close_losses(losses(log), ref, range(N + 1, 2 * N + 1), f"TP{tp}xPP{pp} after TP2xPP2")
    if (tp, pp) == (1, 1):
        # chain: this TP1 checkpoint into TP2 (TP1 -> TP2), again exact state and matching losses
        dst2 = str(tmp_path / "tp2")
        log2 = _reshard(2, 2, 1, iter_dir(dst, N), dst2)
        assert "RNGs re-seeded" in log2
        assert_same_state(iter_dir(root, N), iter_dir(dst2, N))
        assert_close_losses(losses(log2), ref, range(N + 1, 2 * N + 1), "TP2xPP1 after TP1xPP1")


def test_padded_vocab_shape_mismatch(tmp_path):
    """megatron-core marks the (TP-padded) vocabulary tensors `allow_shape_mismatch`: a checkpoint with another
    padded vocabulary size loads into the overlap, the rest zeroed, in both directions and on every TP rank."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from datastates import CheckpointEngine, PosixOptions
    from datastates.megatron import load_sharded, make_registry, save_sharded

    def shard(key, data, rank, tp):
        return ShardedTensor.from_rank_offsets(key, data, (0, rank, tp), replica_id=0, allow_shape_mismatch=True) \
            if tp > 1 else ShardedTensor.from_rank_offsets(key, data, allow_shape_mismatch=True)

    full = torch.randn(128, 8)
    other = torch.randn(4)
    path = str(tmp_path / "iter_0000001")
    with CheckpointEngine(host_buffer_bytes=1 << 20, storage=PosixOptions(writer_threads=1), rank=0, world_size=1,
                          registry=make_registry()) as eng:
        save_sharded(eng, {"emb": shard("emb", full.clone(), 0, 1),
                           "b": ShardedTensor.from_rank_offsets("b", other.clone())}, path).wait()
        # 128 saved rows -> 256 rows over TP2: rank 0 gets rows 0..127, rank 1 (rows 128..255) only zeros
        for rank in range(2):
            dst = torch.full((128, 8), 7.0)
            b = torch.zeros(4)
            out = load_sharded(eng, {"emb": shard("emb", dst, rank, 2),
                                     "b": ShardedTensor.from_rank_offsets("b", b)}, path)
            assert out["emb"] is dst and out["b"] is b and torch.equal(b, other)
            assert torch.equal(dst, full if rank == 0 else torch.zeros(128, 8))
        # 128 saved rows -> 64 rows (a smaller padding): the first 64 rows
        dst = torch.zeros(64, 8)
        assert load_sharded(eng, {"emb": shard("emb", dst, 0, 1)}, path)["emb"] is dst
        assert torch.equal(dst, full[:64])
        # without allow_shape_mismatch a different global shape stays an error
        with pytest.raises(Exception, match="global shape"):
            load_sharded(eng, {"b": ShardedTensor.from_rank_offsets("b", torch.zeros(8))}, path)


def test_save_after_load_flag_validation(tmp_path):
    from megatron.training.arguments import ArgumentError, parse_args
    from megatron.training.argument_checks import validate_args
    base = FLAGS + ["--save-after-load"]
    with pytest.raises(ArgumentError, match="needs both --load and --save"):
        validate_args(parse_args(argv=base + ["--save", str(tmp_path)]), 1, cuda=False)
    with pytest.raises(ArgumentError, match="another directory"):
        validate_args(parse_args(argv=base + ["--save", str(tmp_path), "--load", str(tmp_path)]), 1, cuda=False)
