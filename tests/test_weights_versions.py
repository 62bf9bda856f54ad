"""Published weight versions and their readers' leases (datastates.weights, weights_versions.VersionRoot), without
a trainer: versions written through --save-hf's writer into a root, a real reader process holding one.

A version a reader holds is never freed, however far publication goes on, and publication never waits for it;
once the reader is SIGKILLed the next publication frees it. A retired or unpublished version asked for by number,
and a model the version does not fit, get a clear error. A reader k versions behind reaches the newest through the
deltas exactly to the bit, reading a fraction of the bytes; one whose chain was retired is told so, untouched.
"""
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors import safe_open

from megatron_helpers import ROOT
from rank_launcher import environment

from datastates import storage_for
from datastates.hf.writer import Planned, ShardedWriter
from datastates.weights import WeightsError, WeightsReader
from megatron.training.checkpointing.weights_versions import NotNewer, VersionRoot

HOLD = """
import sys, time
from datastates.weights import WeightsReader
version = WeightsReader(sys.argv[1]).open(int(sys.argv[2]))
name, tensor = next(version.tensors())
print("HELD", float(tensor[0, 0]), flush=True)
time.sleep(600)
"""


def publish(root: VersionRoot, iteration: int, tensors: dict | None = None, config: dict | None = None,
            files: int = 1) -> None:
    """A version of `tensors` (by default one, `w`, full of the iteration) in `files` safetensors files (the
    tensors dealt among them in turn), as the trainer's export writes one."""
    tensors = tensors or {"w": torch.full((4, 4), float(iteration))}
    directory = root.stage(root.path(iteration))
    planned = [Planned(n, tuple(t.shape), t.dtype) for n, t in tensors.items()]
    shards = [planned[i::files] for i in range(files)]
    writer = ShardedWriter(root.storage, directory, shards)
    for p in (p for shard in shards for p in shard):
        writer.write(p.name, tensors[p.name])
    writer.close()
    root.storage.write_bytes(os.path.join(directory, "config.json"), json.dumps(config or {}).encode())
    root.publish(directory, iteration, shards)


def held(root: str) -> list[str]:
    return sorted(n for n in os.listdir(root) if n.startswith("iter_"))


def test_a_held_version_stays_until_its_reader_dies_and_publication_never_waits(tmp_path):
    path = str(tmp_path / "versions")
    os.makedirs(path)
    root = VersionRoot(storage_for(path), path, keep_last=1)
    publish(root, 1)
    holder = subprocess.Popen([sys.executable, "-c", HOLD, path, "1"], cwd=ROOT, env=environment(),
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().split() == ["HELD", "1.0"]
        t0 = time.monotonic()
        for it in (2, 3):
            publish(root, it)
        assert time.monotonic() - t0 < 5  # never waited for the reader
        assert held(path) == ["iter_0000001", "iter_0000003"]  # 2 freed (no reader), 1 held
        reader = WeightsReader(path)
        with reader.newest() as newest:
            assert newest.iteration == 3 and torch.equal(dict(newest.tensors())["w"], torch.full((4, 4), 3.0))
        with pytest.raises(WeightsError, match=r"version 2 under .* is not held: it was retired \(the versions held "
                                               r"now: \[1, 3\]\)"):
            reader.open(2)
        with pytest.raises(WeightsError, match=r"version 9 under .* is not held: it is not published"):
            reader.open(9)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    publish(root, 4)  # the dead reader holds nothing: 1 goes now
    assert held(path) == ["iter_0000004"]
    assert open(os.path.join(path, "latest")).read() == "iter_0000004\n"


def test_a_model_the_version_does_not_fit_and_a_pointer_to_nothing_are_refused(tmp_path):
    path = str(tmp_path / "versions")
    os.makedirs(path)
    publish(VersionRoot(storage_for(path), path, keep_last=1), 1)
    with WeightsReader(path).newest() as version:
        with pytest.raises(WeightsError, match=r"'w' is \(4, 4\) in the version, \(4, 3\) in the model"):
            version.load_into(torch.nn.ParameterDict({"w": torch.nn.Parameter(torch.zeros(4, 3))}))
        with pytest.raises(WeightsError, match=r"the version has no tensor for the model's b"):
            version.load_into(torch.nn.ParameterDict({"w": torch.nn.Parameter(torch.zeros(4, 4)),
                                                      "b": torch.nn.Parameter(torch.zeros(4))}))
    with pytest.raises(WeightsError, match="read after close"):
        next(version.tensors())
    with open(os.path.join(path, "latest"), "w") as f:  # a pointer to nothing (a root damaged by hand)
        f.write("iter_0000009\n")
    with pytest.raises(WeightsError, match=r"latest names version 9, which is not there"):
        WeightsReader(path).newest()


def test_a_reader_versions_behind_reaches_the_newest_through_deltas_exactly(tmp_path):
    """bf16 tensors of which about 1% of the elements change per version (-0.0 and NaN among them: compared by
    their bits), and one whose every element changes (sent whole); a reader holding version 1 is brought to 3,
    then 2 versions behind to 5, bit for bit the full version; a copy left at 1 once the delta to 2 is retired,
    and one whose deltas would take more bytes than the full version, are told to load it, untouched."""
    path = str(tmp_path / "versions")
    os.makedirs(path)
    root = VersionRoot(storage_for(path), path, keep_last=1, deltas=3)
    g = torch.Generator().manual_seed(0)
    tensors = {"a": torch.randn(300, 200, generator=g).bfloat16(), "b": torch.randn(1000, generator=g).bfloat16(),
               "c": torch.zeros(64, dtype=torch.bfloat16)}  # every element changes: sent whole
    publish(root, 1, tensors)
    reader = WeightsReader(path)
    with reader.open(1) as version:
        held = dict(version.tensors())  # the reader's own copy (an engine's weights)
    for it in range(2, 6):
        tensors = {k: v.clone() for k, v in tensors.items()}
        tensors["c"].fill_(it)
        for t in (tensors["a"], tensors["b"]):
            flat = t.view(-1)
            flat[torch.randperm(flat.numel(), generator=g)[:flat.numel() // 100]] += 0.5
        tensors["b"][0], tensors["b"][1] = -0.0 if it % 2 else 0.0, float("nan") if it == 5 else 1.0
        publish(root, it, tensors)
        if it == 3:
            behind = {k: v.clone() for k, v in held.items()}  # stays at 1
            assert reader.catch_up(held, 1)[0] == 3
    before = {k: v.clone() for k, v in behind.items()}
    with pytest.raises(WeightsError, match=r"no delta to version 2 under .*: version 1 cannot be brought to 5 by "
                                           r"deltas; load the full version"):
        reader.catch_up(behind, 1)  # deltas=3: the delta to 2 is retired
    assert all(torch.equal(behind[k].view(torch.int16), before[k].view(torch.int16)) for k in behind)  # untouched
    newest, nbytes = reader.catch_up(held, 3)  # 2 versions behind: the deltas to 4 and 5
    assert newest == 5
    with reader.open(5) as version:
        full = dict(version.tensors())
        assert nbytes * 10 < version.nbytes
    assert all(torch.equal(held[k].view(torch.int16), full[k].view(torch.int16)) for k in full)
    with safe_open(os.path.join(path, "deltas", "iter_0000005.safetensors"), framework="pt") as f:
        assert sorted(f.keys()) == ["a:index", "a:value", "b:index", "b:value", "c:full"]
    assert sorted(os.listdir(os.path.join(path, "deltas"))) == [f"iter_000000{i}.safetensors" for i in (3, 4, 5)]
    for it in (6, 7):  # every element changes: two deltas take more bytes than one full version
        publish(root, it, {k: torch.randn(v.shape, generator=g).bfloat16() for k, v in tensors.items()})
    before = {k: v.clone() for k, v in held.items()}
    with pytest.raises(WeightsError, match=r"the deltas from version 5 to 7 under .* take more bytes than the full "
                                           r"version: version 5 cannot be brought to 7 by deltas"):
        reader.catch_up(held, 5)
    assert all(torch.equal(held[k].view(torch.int16), before[k].view(torch.int16)) for k in held)


def test_a_restarted_publisher_goes_on_from_latest_and_never_goes_back(tmp_path):
    """Versions 1-3, then a restart (a new root, as a new job's rank 0 makes it, a killed version's `.partial`
    left): it starts from `latest` (3). A version at or below it (a trainer resumed from an older checkpoint) is
    refused and version 2's bytes stay; version 4's delta chains from 3, and a reader's copy of 3 reaches 4
    through it exactly."""
    def weights(it: float) -> dict:  # one element of 4096 changes from a version to the next
        w = torch.zeros(64, 64)
        w[0, 0] = it
        return {"w": w}
    path = str(tmp_path / "versions")
    os.makedirs(path)
    first = VersionRoot(storage_for(path), path, keep_last=2, deltas=2)
    for it in (1, 2, 3):
        publish(first, it, weights(it))
    os.makedirs(os.path.join(path, "iter_0000004.partial"))  # a version the killed trainer was writing
    with WeightsReader(path).open(3) as version:
        copy = {n: t.clone() for n, t in version.tensors()}
    root = VersionRoot(storage_for(path), path, keep_last=2, deltas=2)
    root.start()
    assert root.named == 3 and held(path) == ["iter_0000002", "iter_0000003"]
    with pytest.raises(NotNewer, match=r"version 2 is not newer than version 3, which .*/latest names \(a trainer "
                                       r"resumed from before it\): versions go on after it"):
        publish(root, 2, weights(20))
    root.discard(os.path.join(path, "iter_0000002.partial"))  # as the export discards a version refused
    root.name(2)  # an earlier run's version, exported again: `latest` stays
    reader = WeightsReader(path)
    assert reader.pointed() == 3
    with reader.open(2) as version:
        assert torch.equal(dict(version.tensors())["w"], weights(2)["w"])
    publish(root, 4, weights(4))
    with safe_open(os.path.join(path, "deltas", "iter_0000004.safetensors"), framework="pt") as f:
        assert f.metadata()["from"] == "3"
    assert reader.catch_up(copy, 3)[0] == 4 and torch.equal(copy["w"], weights(4)["w"])
    assert held(path) == ["iter_0000003", "iter_0000004"]


def file_tensors(directory: str) -> dict[str, torch.Tensor]:
    """A version's Hugging Face tensors, read by the test with safetensors itself."""
    out = {}
    for name in os.listdir(directory):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(directory, name), framework="pt") as f:
                out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def rank_of(hf: dict, config: dict, size: int, rank: int) -> dict[str, torch.Tensor]:
    """What rank `rank` of `size` of vLLM holds, packed, rebuilt by the test from the full tensors with torch.chunk
    and torch.cat (its own reading of vLLM's QKVParallelLinear, MergedColumnParallelLinear, RowParallelLinear,
    VocabParallelEmbedding and FusedMoE)."""
    kv = config["num_key_value_heads"]
    mine = lambda t: t.chunk(size)[rank]  # noqa: E731 (a column-parallel block)
    kv_of = (mine if size <= kv else lambda t: t.chunk(kv)[rank // (size // kv)])
    out = {}
    for name, t in hf.items():
        if ".self_attn.q_proj." in name:
            k, v = (hf[name.replace("q_proj", p)] for p in ("k_proj", "v_proj"))
            out[name.replace("q_proj", "qkv_proj")] = torch.cat([mine(t), kv_of(k), kv_of(v)])
        elif ".mlp.gate_proj." in name:
            out[name.replace("gate_proj", "gate_up_proj")] = torch.cat([mine(t), mine(hf[name.replace("gate", "up")])])
        elif m := re.fullmatch(r"(.+\.)experts\.0\.(gate_proj|w1)\.weight", name):  # Mixtral: w1, w3, w2
            at, parts = m[1], ("gate_proj", "up_proj", "down_proj") if m[2] == "gate_proj" else ("w1", "w3", "w2")
            count = sum(1 for n in hf if n.startswith(at + "experts.") and n.endswith(f".{parts[0]}.weight"))
            e = [tuple(hf[f"{at}experts.{i}.{p}.weight"] for p in parts) for i in range(count)]
            out[at + "experts.w13_weight"] = torch.stack([torch.cat([mine(g), mine(u)]) for g, u, _ in e])
            out[at + "experts.w2_weight"] = torch.stack([d.chunk(size, dim=1)[rank] for _, _, d in e])
        elif name.endswith(("o_proj.weight", "down_proj.weight")) and ".experts." not in name:
            out[name] = t.chunk(size, dim=1)[rank]
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            per_rank = -(-t.shape[0] // 64) * 64 // size  # the vocabulary padded to 64 rows, over the ranks
            out[name] = t[rank * per_rank:(rank + 1) * per_rank]
        elif not any(f".{p}_proj." in name for p in ("k", "v", "up")) and ".experts." not in name:
            out[name] = t
    return out


def reassembled(ranks: list[dict], full: dict) -> dict[str, torch.Tensor]:
    """The full tensors from every rank's slices (unpacked, the heads split, not replicated), by their shapes
    alone: the same on every rank, or concatenated along the dimension the ranks' slices add up to."""
    out = {}
    for name, t in full.items():
        parts = [r[name] for r in ranks]
        if all(p.shape == t.shape for p in parts):
            assert all(same(p, parts[0]) for p in parts), name
            out[name] = parts[0]
        else:
            dim = 0 if sum(p.shape[0] for p in parts) == t.shape[0] else 1
            out[name] = torch.cat(parts, dim=dim)
    return out


def test_a_reader_takes_the_packed_layout_and_its_tensor_parallel_slices_exactly(tmp_path):
    """A transformers Qwen2 (GQA: 4 query heads, 2 key/value heads; q/k/v biases) in bf16, published in 2 files:
    packed (qkv_proj, gate_up_proj) it is torch.cat of the tensors the test reads itself; each rank of TP 2 (the
    key/value heads split) and TP 4 (replicated) holds what the test rebuilds with torch.chunk; the two TP2 ranks'
    slices, unpacked, reassembled are the full tensors bit for bit, and a model loaded from them computes the
    logits of the version loaded whole."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen2Config(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                      tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(config).to(torch.bfloat16).eval()
    path = str(tmp_path / "versions")
    os.makedirs(path)
    publish(VersionRoot(storage_for(path), path, keep_last=1), 1, {n: t.contiguous() for n, t in
                                                                  model.state_dict().items()},
            json.loads(config.to_json_string()), files=2)
    with WeightsReader(path).open(1) as version:
        hf = file_tensors(version.path)
        cfg = version.config
        packed = dict(version.tensors(packed=True))
        assert "model.layers.1.self_attn.qkv_proj.bias" in packed and "model.layers.0.mlp.gate_up_proj.weight" in packed
        one = rank_of(hf, cfg, 1, 0)
        assert packed.keys() == one.keys() and all(same(packed[n], one[n]) for n in one)
        for size in (2, 4):
            for rank in range(size):
                got, want = dict(version.tensors(packed=True, tp_rank=rank, tp_size=size)), rank_of(hf, cfg, size, rank)
                assert got.keys() == want.keys() and all(same(got[n], want[n]) for n in want), (size, rank)
        ranks = [dict(version.tensors(tp_rank=r, tp_size=2)) for r in range(2)]
        assert ranks[0]["model.layers.0.self_attn.k_proj.weight"].shape == (16, 64)  # one of the 2 kv heads
        whole = reassembled(ranks, hf)
        assert whole.keys() == hf.keys() and all(same(whole[n], hf[n]) for n in hf)
        in_place = transformers.Qwen2ForCausalLM(config).to(torch.bfloat16).eval()
        version.load_into(in_place)
    from_slices = transformers.Qwen2ForCausalLM(config).to(torch.bfloat16).eval()
    from_slices.load_state_dict(whole, strict=True)
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(from_slices(tokens).logits, in_place(tokens).logits)


MOE_CONFIG = {"model_type": "qwen3_moe", "num_attention_heads": 4, "num_key_value_heads": 2, "num_experts": 3}


def moe_layer(g: torch.Generator) -> dict[str, torch.Tensor]:
    """A Qwen3-MoE layer of 3 experts and a 100-row vocabulary in bf16 (MOE_CONFIG's)."""
    rnd = lambda *shape: torch.randn(*shape, generator=g).bfloat16()  # noqa: E731
    at = "model.layers.0."
    tensors = {"model.embed_tokens.weight": rnd(100, 32), "lm_head.weight": rnd(100, 32), "model.norm.weight": rnd(32),
               at + "self_attn.q_proj.weight": rnd(64, 32), at + "self_attn.k_proj.weight": rnd(32, 32),
               at + "self_attn.v_proj.weight": rnd(32, 32), at + "self_attn.o_proj.weight": rnd(32, 64),
               at + "self_attn.q_norm.weight": rnd(16), at + "mlp.gate.weight": rnd(3, 32)}
    for e in range(3):
        tensors.update({f"{at}mlp.experts.{e}.gate_proj.weight": rnd(24, 32),
                        f"{at}mlp.experts.{e}.up_proj.weight": rnd(24, 32),
                        f"{at}mlp.experts.{e}.down_proj.weight": rnd(32, 24)})
    return tensors


@pytest.mark.parametrize("layout", [dict(packed=True, tp_size=2, tp_rank=1), dict(tp_size=2, tp_rank=0),
                                    dict(packed=True, tp_size=2, tp_rank=1, ep_size=2, ep_rank=1)],
                         ids=["packed-tp2", "tp2", "packed-tp2-ep2"])
def test_a_ranks_packed_slices_reach_the_newest_through_deltas_exactly(tmp_path, layout):
    """A rank's own tensors (its packed slices, its experts) of version 1 brought to 3 through the deltas (1% of
    the elements changing a version, the norm whole) equal what it reads of version 3, bit for bit."""
    path = str(tmp_path / "versions")
    os.makedirs(path)
    root = VersionRoot(storage_for(path), path, keep_last=1, deltas=2)
    g = torch.Generator().manual_seed(2)
    tensors = moe_layer(g)
    publish(root, 1, tensors, MOE_CONFIG, files=2)
    reader = WeightsReader(path)
    with reader.open(1) as version:
        held = dict(version.tensors(**layout))
    for it in (2, 3):
        tensors = {k: v.clone() for k, v in tensors.items()}
        for t in tensors.values():
            flat = t.view(-1)
            flat[torch.randperm(flat.numel(), generator=g)[:max(1, flat.numel() // 100)]] += 0.5
        tensors["model.norm.weight"].fill_(it)  # every element: sent whole
        publish(root, it, tensors, MOE_CONFIG, files=2)
    assert reader.catch_up(held, 1, **layout)[0] == 3
    with reader.open(3) as version:
        want = dict(version.tensors(**layout))
    assert held.keys() == want.keys() and all(same(held[n], want[n]) for n in want)


def test_stacked_experts_and_a_vocabulary_padded_for_the_ranks(tmp_path):
    """A Qwen3-MoE layer's 3 experts, stacked as FusedMoE holds them (w13: gate then up rows; w2: down columns) for
    each rank of TP 2, and a 100-row vocabulary, padded to 128 and split 64 + 36; bf16, in 3 files. Under expert
    parallelism (2 ranks, each placement), a rank holds its experts whole, the rest as under TP."""
    at = "model.layers.0."
    tensors, config = moe_layer(torch.Generator().manual_seed(1)), MOE_CONFIG
    path = str(tmp_path / "versions")
    os.makedirs(path)
    publish(VersionRoot(storage_for(path), path, keep_last=1), 1, tensors, config, files=3)
    with WeightsReader(path).open(1) as version:
        hf = file_tensors(version.path)
        for rank in range(2):
            got, want = dict(version.tensors(packed=True, tp_rank=rank, tp_size=2)), rank_of(hf, config, 2, rank)
            assert got.keys() == want.keys() and all(same(got[n], want[n]) for n in want), rank
            assert got[at + "mlp.experts.w13_weight"].shape == (3, 24, 32)
            assert got[at + "mlp.experts.w2_weight"].shape == (3, 32, 12)
            assert got["lm_head.weight"].shape == ((64, 32), (36, 32))[rank]
        ranks = [dict(version.tensors(tp_rank=r, tp_size=2)) for r in range(2)]
        whole = reassembled(ranks, hf)
        assert all(same(whole[n], hf[n]) for n in hf)
        # expert parallelism (vLLM's --enable-expert-parallel, TP 2 x EP 2): whole experts, 3 over 2 ranks
        for placement, held in (("linear", ([0, 1], [2])), ("round_robin", ([0, 2], [1]))):
            for rank in range(2):
                got = dict(version.tensors(packed=True, tp_rank=rank, tp_size=2, ep_rank=rank, ep_size=2,
                                           ep_placement=placement))
                want = {n: t for n, t in rank_of(hf, config, 2, rank).items() if ".experts." not in n}
                experts = [[hf[f"{at}mlp.experts.{e}.{p}_proj.weight"] for p in ("gate", "up", "down")]
                           for e in held[rank]]
                want[at + "mlp.experts.w13_weight"] = torch.stack([torch.cat([g_, u]) for g_, u, _ in experts])
                want[at + "mlp.experts.w2_weight"] = torch.stack([d for _, _, d in experts])
                assert got.keys() == want.keys() and all(same(got[n], want[n]) for n in want), (placement, rank)
                plain = {n for n in dict(version.tensors(ep_rank=rank, ep_size=2, ep_placement=placement))
                         if ".experts." in n}
                assert plain == {f"{at}mlp.experts.{e}.{p}_proj.weight" for e in held[rank]
                                 for p in ("gate", "up", "down")}, (placement, rank)
        with pytest.raises(WeightsError, match="3 experts \\(config.json\\) over 4 expert-parallel ranks"):
            next(version.tensors(ep_rank=0, ep_size=4))


@pytest.mark.parametrize("config, size, named", [
    ({"num_attention_heads": 4, "num_key_value_heads": 2, "ffn": 48}, 3,
     r"model.layers.0.self_attn.q_proj.weight: its 4 query heads do not divide among 3 tensor-parallel ranks"),
    ({"num_attention_heads": 6, "num_key_value_heads": 3}, 2,
     r"model.layers.0.self_attn.k_proj.weight: 3 key/value heads and 2 tensor-parallel ranks: one must divide the "
     r"other"),
    ({"num_attention_heads": 4, "num_key_value_heads": 4, "ffn": 30}, 4,
     r"model.layers.0.mlp.gate_proj.weight: its 30 rows do not divide among 4 tensor-parallel ranks"),
    ({"model_type": "gpt2", "num_attention_heads": 4}, 2,
     r"model_type 'gpt2' has no packed or tensor-parallel layout here \(these have: llama, mixtral, qwen2, qwen3, "
     r"qwen3_moe\); read its Hugging Face tensors whole"),
    ({"num_attention_heads": 4, "num_key_value_heads": 2}, 0, r"tensor-parallel rank 0 of 0"),
], ids=["query-heads", "key-value-heads", "rows", "family", "no-ranks"])
def test_a_tensor_parallelism_the_engine_refuses_is_a_clear_error_naming_the_tensor(tmp_path, config, size, named):
    """Before any tensor is handed out; the version stays readable whole."""
    heads, kv, ffn = config["num_attention_heads"], config.get("num_key_value_heads", 4), config.get("ffn", 32)
    at = "model.layers.0."
    tensors = {at + "self_attn.q_proj.weight": torch.zeros(heads * 8, 16), at + "self_attn.k_proj.weight":
               torch.zeros(kv * 8, 16), at + "mlp.gate_proj.weight": torch.zeros(ffn, 16)}
    path = str(tmp_path / "versions")
    os.makedirs(path)
    publish(VersionRoot(storage_for(path), path, keep_last=1), 1, tensors, {"model_type": "llama", **config})
    with WeightsReader(path).open(1) as version:
        with pytest.raises(WeightsError, match=f"{version.path}: {named}"):
            next(version.tensors(packed=True, tp_rank=0, tp_size=size))
        assert len(dict(version.tensors())) == 3
