"""`CheckpointEngine.save(keep=)`: the staged bytes of chosen global tensors kept past the save (datastates/kept.py).

What is kept is the state of the save call (late, out-of-order copies; the live state changed after the fence),
chunked tensors larger than a staging slot included, whether the save staged through slots (compressed or not)
or wrote from the memory tier's pages; only the chosen tensors are kept, within the staging budget over every
save's kept bytes (a save that does not fit keeps nothing and says why, without waiting), and a release or a
failed save gives the bytes back.
"""
import pytest
import torch

from datastates import CheckpointEngine, CheckpointError, PosixOptions, paths
from datastates.providers import ProviderRegistry, StateProvider, default_registry
from datastates.storage import SharedMemoryStorage
from late_copies import LateCopyBackend
from memory_storage import MemoryStorage

MiB = 1 << 20


class Piece:
    """A shard of a global tensor at `offset`."""

    def __init__(self, name, data, offset, shape):
        self.name, self.data, self.offset, self.shape = name, data, offset, shape


class PieceProvider(StateProvider):
    def accepts(self, value):
        return isinstance(value, Piece)

    def flatten(self, value, path, ctx):
        return ctx.add_tensor(f"{value.name}@{value.offset}", value.data, scope="global", name=value.name,
                              global_shape=value.shape, global_offset=value.offset)


REGISTRY = ProviderRegistry(default_registry.providers)
REGISTRY.register(PieceProvider())


def _state():
    big = torch.arange(3 * MiB // 4, dtype=torch.float32).reshape(-1, 256)  # 3 MiB: chunked over several slots
    return {"model.w": Piece("model.w", big, (0, 0), (big.shape[0] * 2, 256)),
            "model.b": Piece("model.b", torch.randn(100).to(torch.bfloat16), (100,), (200,)),
            "optimizer.m": Piece("optimizer.m", torch.randn(1000), (0,), (1000,)), "step": 7}


def _engine(copy_backend=None, **kw):
    kw.setdefault("storage", PosixOptions(writer_threads=2))
    return CheckpointEngine(host_buffer_bytes=kw.pop("budget", 8 * MiB), rank=0, world_size=1, registry=REGISTRY,
                            copy_backend=copy_backend, **kw)


def _models(name: str) -> bool:
    return name.startswith("model.")


def _kept_by_name(handle, state) -> dict:
    return {name: handle.kept.tensor(f"{name}@{state[name].offset}") for name in ("model.w", "model.b")}


@pytest.mark.parametrize("compress", ["off", "zstd"])
def test_kept_bytes_are_the_save_call_s_state(tmp_path, compress):
    state = _state()
    expected = {n: state[n].data.clone() for n in ("model.w", "model.b")}
    with _engine(LateCopyBackend(seed=5), compress=compress) as eng:
        handle = eng.save(state, paths.checkpoint_dir(str(tmp_path), 1), keep=_models)
        eng.wait_for_snapshot()
        for piece in state.values():
            if isinstance(piece, Piece):
                piece.data.add_(1000)  # the optimizer step after the fence
        handle.wait()
        assert handle.kept.why is None
        assert sorted(handle.kept.ids()) == ["model.b@(100,)", "model.w@(0, 0)"]  # not the optimizer's
        for name, tensor in _kept_by_name(handle, state).items():
            assert tensor.dtype == expected[name].dtype and torch.equal(tensor, expected[name]), name
        assert eng.keep_budget.used > 0
        handle.kept.release()
        handle.kept.release()  # once
        assert eng.keep_budget.used == 0


def test_kept_from_the_memory_tier_s_pages(tmp_path):
    """A storage save written from the memory tier's pages keeps its tensors from those pages."""
    state = _state()
    expected = {n: state[n].data.clone() for n in ("model.w", "model.b")}
    memory = _engine(storage=SharedMemoryStorage(pinned=False, writer_threads=1), keep_last=2)
    with memory, _engine() as disk:
        memory_save = memory.save(state, paths.checkpoint_dir(str(tmp_path / "mem"), 2))
        handle = disk.save(state, paths.checkpoint_dir(str(tmp_path / "ck"), 2), from_save=memory_save,
                           keep=_models)
        memory.wait_for_snapshot()
        state["model.w"].data.zero_()
        handle.wait()
        for name, tensor in _kept_by_name(handle, state).items():
            assert torch.equal(tensor, expected[name]), name
        handle.kept.release()


def test_what_does_not_fit_the_budget_is_not_kept_and_a_release_makes_room(tmp_path):
    """The 8 MiB budget holds one save's 3 MiB of model weights twice, not three times: the third save keeps
    nothing (and says why) without waiting; once the first is released, the next save keeps again."""
    state = _state()
    with _engine() as eng:
        handles = [eng.save(state, paths.checkpoint_dir(str(tmp_path), it), keep=_models) for it in (1, 2, 3)]
        eng.wait()
        assert [h.kept.why is None for h in handles] == [True, True, False]
        assert "MiB of tensors to keep do not fit in the" in handles[2].kept.why
        assert handles[2].kept.ids() == []
        handles[0].kept.release()
        fourth = eng.save(state, paths.checkpoint_dir(str(tmp_path), 4), keep=_models)
        fourth.wait()
        assert fourth.kept.why is None and torch.equal(_kept_by_name(fourth, state)["model.w"], state["model.w"].data)


def test_a_failed_or_refused_save_gives_its_kept_bytes_back(tmp_path):
    """A save failing on a full store (ENOSPC mid-write) and one refused at the call keep nothing past it."""
    state = _state()
    with _engine(storage=MemoryStorage(capacity=MiB)) as eng:
        handle = eng.save(state, paths.checkpoint_dir("/ck", 1), keep=_models)
        with pytest.raises(CheckpointError, match=r"rank_00000\.data' no space left"):
            handle.wait()
        assert eng.keep_budget.used == 0 and handle.kept.ids() == []
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the save root should be")
    with _engine() as eng:
        with pytest.raises(CheckpointError, match=r"cannot prepare checkpoint .*blocked/iter_0000001.*Not a directory"):
            eng.save(state, paths.checkpoint_dir(str(blocked), 1), keep=_models)
        assert eng.keep_budget.used == 0


def test_a_released_buffer_is_the_next_save_s_and_what_is_held_stays_within_the_budget(tmp_path):
    """The next save copies into the pages the last one gave back (no fresh pages to fault in on the flusher), with
    its own bytes; a save keeping more than that buffer holds frees it first, so what is in use plus what waits
    idle never exceeds the staging budget."""
    state = _state()
    with _engine() as eng:
        first = eng.save(state, paths.checkpoint_dir(str(tmp_path), 1), keep=_models)
        first.wait()
        pages = first.kept.tensor("model.w@(0, 0)").data_ptr()
        first.kept.release()
        assert eng.keep_budget.used == 0 and eng.keep_budget.idle is not None
        state["model.w"].data.mul_(-1)
        second = eng.save(state, paths.checkpoint_dir(str(tmp_path), 2), keep=_models)
        second.wait()
        kept = _kept_by_name(second, state)
        assert kept["model.w"].data_ptr() == pages and eng.keep_budget.idle is None
        assert torch.equal(kept["model.w"], state["model.w"].data)
        second.kept.release()
        nothing = eng.save(state, paths.checkpoint_dir(str(tmp_path), 3), keep=lambda name: False)
        nothing.wait()
        nothing.kept.release()
        assert eng.keep_budget.idle.data_ptr() == pages  # a save keeping nothing leaves the buffer to the next
        state["model.w2"] = Piece("model.w2", torch.ones(MiB // 4), (0,), (MiB // 4,))  # 4 MiB to keep now
        third = eng.save(state, paths.checkpoint_dir(str(tmp_path), 4), keep=_models)
        third.wait()
        assert third.kept.why is None and third.kept.tensor("model.w@(0, 0)").data_ptr() != pages
        assert eng.keep_budget.idle is None and eng.keep_budget.used == third.kept.nbytes <= eng.keep_budget.budget_bytes
        third.kept.release()
        assert eng.keep_budget.used == 0 and eng.keep_budget.idle.numel() == third.kept.nbytes
