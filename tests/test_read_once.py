"""One reader per saved byte (`datastates.exchange`), across 4 real processes over gloo: DP4 and TP2xDP2 loads
are bit-exact with the exchange and without; with it the bytes read from storage, summed over the ranks, are the
checkpoint's unique bytes, without it every replica is read once per rank that holds it; a resharding load
(other TP, other flat ranges cutting checksum chunks) reads each chunk once; a chunk that one rank reads for the
others is damaged, or an object passed between ranks does not unpickle on one of them: every rank fails the load,
naming that rank and the cause, at once."""
import dataclasses
import datetime
import os
import time

import torch
import torch.distributed as dist

from test_multirank import spawn_ranks

WORLD = 4
OPT = 400  # elements of the flat, unique optimizer tensor, a quarter per rank when saved


def _worker(rank, root, port, errors):
    try:
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=120))
        dist.init_process_group("gloo", rank=rank, world_size=WORLD, store=store)
        _scenarios(rank, root)
    except BaseException as e:
        import traceback
        errors.put(f"rank {rank}: {traceback.format_exc()}")
        raise SystemExit(1) from e
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


class Shard:
    """A stand-in for a sharded tensor: the box `offset` of the global tensor `name`, written when `owner`."""

    def __init__(self, name, data, offset, shape, owner=True):
        self.name, self.data, self.offset, self.shape, self.owner = name, data, offset, shape, owner


@dataclasses.dataclass
class Pair:
    """An object of this module's own, unpickled only where `datastates.format.allow_unpickle` trusts it."""

    left: int
    right: int


class Shared:
    """A global object every rank holds; `owner` writes it."""

    def __init__(self, name, value, owner):
        self.name, self.value, self.owner = name, value, owner


def _registry():
    from datastates.providers import ProviderRegistry, StateProvider, default_registry

    class Provider(StateProvider):
        def accepts(self, value):
            return isinstance(value, (Shard, Shared))

        def flatten(self, value, path, ctx):
            if isinstance(value, Shared):
                return ctx.add_object(value.name, value.value, scope="global", name=value.name, write=value.owner)
            return ctx.add_tensor(f"{value.name}@{value.offset}", value.data, scope="global", name=value.name,
                                  global_shape=value.shape, global_offset=value.offset, write=value.owner)
    registry = ProviderRegistry(default_registry.providers)
    registry.register(Provider())
    return registry


def _full(name, shape):
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    return torch.randn(shape, generator=g)


def _state(rank, tp, opt_cuts=None, fill=True):
    """This rank's part of a TP x DP layout (DP = WORLD / tp): an embedding split by rows and layers split by
    columns across TP, each replicated across DP with its writer spread over the DP ranks; a norm and a common
    object replicated on every rank; a flat optimizer tensor cut at `opt_cuts`, its own piece on each rank."""
    dp = WORLD // tp
    tpr, dpr = rank % tp, rank // tp
    cuts = opt_cuts or [OPT * r // WORLD for r in range(WORLD + 1)]

    def shard(name, shape, axis, owner):
        full = _full(name, shape)
        n = shape[axis] // tp
        offset = tuple(tpr * n if a == axis else 0 for a in range(len(shape)))
        part = full.narrow(axis, tpr * n, n).clone()
        return Shard(name, part if fill else torch.zeros_like(part), offset, shape, owner)
    state = {"emb": shard("emb", (256, 64), 0, dpr == 0),
             "layers": [shard(f"l{i}", (48, 96), 1, dpr == (i + 1) % dp) for i in range(3)],
             "norm": Shard("norm", _full("norm", (96,)) if fill else torch.zeros(96), (0,), (96,), rank == WORLD - 1),
             "common": Shared("common", {"iteration": 7, "lr": 0.5} if fill else None, rank == 0)}
    lo, hi = cuts[rank], cuts[rank + 1]
    opt = _full("opt", (OPT,))[lo:hi]
    state["opt"] = Shard("opt", opt.clone() if fill else torch.zeros_like(opt), (lo,), (OPT,))
    return state


def _same(loaded, want):
    if isinstance(want, Shard):
        return torch.equal(loaded, want.data)
    if isinstance(want, Shared):
        return loaded == want.value
    if isinstance(want, dict):
        return all(_same(loaded[k], v) for k, v in want.items())
    return all(_same(a, b) for a, b in zip(loaded, want))


def _load(eng, path, rank, template, exchange):
    """Load `template` through the engine; this rank's (bytes read, requests) of the load."""
    stats = eng.checkpoint(path).stats
    before = dataclasses.replace(stats)
    loaded = eng.load(path, template, rank, exchange)
    return loaded, stats.bytes_read - before.bytes_read, stats.requests - before.requests


def _unique_bytes(eng, path):
    """The bytes of every saved item a template load reads (all but the rank-local state structures)."""
    from datastates import format as fmt
    checkpoint = eng.checkpoint(path)
    return sum(it.nbytes for r in range(checkpoint.world_size) for it in checkpoint.items(r).values()
               if it.write and it.id != fmt.SKELETON_ID)


def _replicated_bytes(eng, path, tp):
    """What a load without the exchange reads in all: each saved item once per rank that holds it."""
    from datastates import format as fmt
    checkpoint = eng.checkpoint(path)
    copies = {"opt": 1, "norm": WORLD, "common": WORLD}
    return sum(it.nbytes * copies.get(it.name, WORLD // tp) for r in range(checkpoint.world_size)
               for it in checkpoint.items(r).values() if it.write and it.id != fmt.SKELETON_ID)


def _fails_everywhere(eng, path, rank, template, exchange) -> str:
    """The load of `template` fails on every rank with the same message, well before the exchange's 60 s timeout;
    that message."""
    from datastates import CheckpointError
    t0 = time.monotonic()
    try:
        eng.load(path, template, rank, exchange)
        message = None
    except CheckpointError as e:
        message = str(e)
    gathered = [None] * WORLD
    dist.all_gather_object(gathered, message)
    assert all(m is not None and m == gathered[0] for m in gathered), gathered
    assert time.monotonic() - t0 < 30
    return message


def _scenarios(rank, root):
    from datastates import CheckpointEngine, PosixOptions, paths
    from datastates.exchange import Exchange

    eng = CheckpointEngine(host_buffer_bytes=64 << 10, storage=PosixOptions(writer_threads=2), registry=_registry(),
                           publish_timeout_s=60)
    exchange = Exchange(timeout_s=60)

    def totals(nbytes):
        gathered = [None] * WORLD
        dist.all_gather_object(gathered, nbytes)
        return sum(gathered)

    for tp in (1, 2):  # DP4, then TP2 x DP2
        path = paths.checkpoint_dir(root, tp)
        eng.save(_state(rank, tp), path)
        eng.wait()
        unique, replicated = _unique_bytes(eng, path), _replicated_bytes(eng, path, tp)
        for ex in (None, exchange):
            loaded, nbytes, _ = _load(eng, path, rank, _state(rank, tp, fill=False), ex)
            assert _same(loaded, _state(rank, tp)), (tp, ex)
            assert totals(nbytes) == (unique if ex else replicated), (tp, ex, totals(nbytes), unique, replicated)

    # a reshard with the exchange: TP2 x DP2 into DP4, the flat optimizer tensor cut mid-chunk elsewhere
    path = paths.checkpoint_dir(root, 2)
    cuts = [0, 130, 200, 330, OPT]
    loaded, nbytes, _ = _load(eng, path, rank, _state(rank, 1, cuts, fill=False), exchange)
    assert _same(loaded, _state(rank, 1, cuts))
    assert totals(nbytes) == _unique_bytes(eng, path)  # each saved chunk once, whatever cuts it

    _compressed_exchange(rank, root, exchange, totals)

    # a damaged chunk that one rank reads for all: every rank fails at once, naming it
    if rank == 0:
        checkpoint = eng.checkpoint(path)
        norm = next((r, it) for r in range(WORLD) for it in checkpoint.items(r).values()
                    if it.name == "norm" and it.write)
        with open(os.path.join(path, paths.data_file(norm[0])), "r+b") as f:
            f.seek(norm[1].offset)
            f.write(b"\xff" * 8)
    dist.barrier()
    eng.close()  # a fresh engine: no page or reader kept from before the damage
    eng = CheckpointEngine(host_buffer_bytes=64 << 10, storage=PosixOptions(writer_threads=2), registry=_registry())
    message = _fails_everywhere(eng, path, rank, _state(rank, 2, fill=False), exchange)
    assert "failed on 1 rank(s): rank " in message and "checksum mismatch" in message and "norm" in message, message

    # an object passed between ranks that one rank refuses to unpickle: every rank fails at once, naming it
    from datastates import format as fmt
    if rank != WORLD - 1:
        fmt.allow_unpickle(Pair.__module__, "Pair")
    state = _state(rank, 1)
    state["common"] = Shared("common", Pair(1, 2), rank == 0)
    path = paths.checkpoint_dir(root, 3)
    eng.save(state, path)
    eng.wait()
    message = _fails_everywhere(eng, path, rank, _state(rank, 1, fill=False), exchange)
    assert f"failed on 1 rank(s): rank {WORLD - 1}: " in message and "refusing to unpickle" in message, message
    eng.close()


def _compressed_exchange(rank, root, exchange, totals):
    """A compressed checkpoint (DP4: every tensor but `opt` wanted by all four ranks): the pieces pass between
    ranks as stored, so the bytes received, summed over the ranks, are 3 x the stored sizes of what is shared
    (fewer than the raw ones), each byte is still read once, and every rank decodes what it got bit-exact; a
    damaged compressed chunk that one rank reads for the others fails every rank, naming the chunk."""
    from datastates import CheckpointEngine, PosixOptions, paths
    from datastates import format as fmt
    path = paths.checkpoint_dir(root, 5)
    eng = CheckpointEngine(host_buffer_bytes=64 << 10, storage=PosixOptions(writer_threads=2), registry=_registry(),
                           publish_timeout_s=60, compress="bytegroup-zstd")
    eng.save(_state(rank, 1), path)
    eng.wait()
    checkpoint = eng.checkpoint(path)
    written = [(r, it) for r in range(WORLD) for it in checkpoint.items(r).values()
               if it.write and it.id != fmt.SKELETON_ID]
    shared = [it for _, it in written if it.name != "opt"]
    assert {it.codec for it in shared if it.kind.value == "tensor"} == {"bytegroup-zstd"}
    stored = sum(it.stored_bytes for it in shared)
    assert stored < sum(it.nbytes for it in shared)
    before = dataclasses.replace(checkpoint.stats)
    loaded, nbytes, _ = _load(eng, path, rank, _state(rank, 1, fill=False), exchange)
    assert _same(loaded, _state(rank, 1))
    received = checkpoint.stats.bytes_received - before.bytes_received
    sent = checkpoint.stats.bytes_sent - before.bytes_sent
    assert totals(received) == totals(sent) == 3 * stored, (totals(received), totals(sent), stored)
    assert totals(nbytes) == sum(it.stored_bytes for _, it in written)  # each stored byte read once

    if rank == 0:  # the first chunk of layer 1, which one rank reads and passes to the three others
        writer, layer = next((r, it) for r, it in written if it.name == "l1")
        with open(os.path.join(path, paths.data_file(writer)), "r+b") as f:
            f.seek(layer.offset + 4)
            f.write(b"\x00" * 8)
    dist.barrier()
    eng.close()
    eng = CheckpointEngine(host_buffer_bytes=64 << 10, storage=PosixOptions(writer_threads=2), registry=_registry())
    message = _fails_everywhere(eng, path, rank, _state(rank, 1, fill=False), exchange)
    assert "failed on 1 rank(s): rank " in message and "item 'l1@(0, 0)' chunk 0" in message, message
    eng.close()


def test_read_once_across_four_processes(tmp_path):
    spawn_ranks(_worker, WORLD, str(tmp_path))
