"""Plain PyTorch FSDP2 (no Megatron) checkpointed lazily by datastates: a small MLP sharded with `fully_shard` over
gloo on CPU, AdamW, a save right after each checkpointed optimizer step and the fence right before the next one.

    torchrun --nproc-per-node 2 examples/fsdp2/train.py --save ckpt --iters 20 --save-interval 5
    torchrun --nproc-per-node 3 examples/fsdp2/train.py --save ckpt --load ckpt --iters 30   # 2 -> 3 ranks

The state is torch's own distributed state dict (`get_model_state_dict` / `get_optimizer_state_dict`: FQN-keyed
DTensors, Adam's `step`), wrapped in `GlobalState` so that it loads into any number of ranks (docs/fsdp2-plain.md).
"""
import argparse
import os

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from datastates import CheckpointEngine, GlobalState, PosixOptions
from datastates.paths import checkpoint_dir

BATCH = 12  # global batch; rank r takes rows r, r + world, ...


def build(sizes: list[int], lr: float = 1e-2, seed: int = 0):
    """The model (Linear+ReLU stack, each layer and then the whole a `fully_shard` unit) and its AdamW."""
    torch.manual_seed(seed)
    layers = []
    for a, b in zip(sizes[:-1], sizes[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers[:-1])
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=lr)


def state(model, optimizer, iteration: int) -> GlobalState:
    """What a checkpoint holds: the live DTensors themselves (nothing copied here) and the iteration."""
    return GlobalState({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer),
                        "iteration": iteration})


def resume(engine: CheckpointEngine, path: str, model, optimizer) -> int:
    """Load `path` (a save root's latest, or one checkpoint) in place, from any number of ranks; its iteration."""
    loaded = engine.load(path, template=state(model, optimizer, 0))
    set_model_state_dict(model, loaded["model"])
    set_optimizer_state_dict(model, optimizer, loaded["optim"])
    return loaded["iteration"]


def batch(iteration: int, width: int, out: int):
    """This rank's rows of the iteration's global batch (the same whatever the number of ranks)."""
    g = torch.Generator().manual_seed(1000 + iteration)
    x, y = torch.randn(BATCH, width, generator=g), torch.randn(BATCH, out, generator=g)
    return x[dist.get_rank()::dist.get_world_size()], y[dist.get_rank()::dist.get_world_size()]


def train(engine, model, optimizer, sizes, start: int, iters: int, save: str | None, interval: int) -> list[float]:
    """Iterations [start, iters); a checkpoint after every `interval`-th step. The losses, averaged over ranks."""
    losses = []
    for it in range(start, iters):
        x, y = batch(it, sizes[0], sizes[-1])
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        engine.wait_for_snapshot()  # the fence: the last save has copied the parameters and moments it reads
        optimizer.step()
        optimizer.zero_grad()
        if save and (it + 1) % interval == 0:
            engine.save(state(model, optimizer, it + 1), checkpoint_dir(save, it + 1))
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / dist.get_world_size())
        if dist.get_rank() == 0:
            print(f"iteration {it + 1} loss {losses[-1]:.6f}", flush=True)
    return losses


def main(argv=None) -> list[float]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="64,256,256,8", help="layer widths, input first")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--save", help="save root (checkpoints iter_NNNNNNN under it)")
    ap.add_argument("--save-interval", type=int, default=5)
    ap.add_argument("--load", help="resume from this save root's latest checkpoint (or one checkpoint)")
    a = ap.parse_args(argv)
    sizes = [int(n) for n in a.sizes.split(",")]
    dist.init_process_group("gloo")
    try:
        model, optimizer = build(sizes)
        with CheckpointEngine(host_buffer_bytes=64 << 20, storage=PosixOptions(writer_threads=2)) as engine:
            start = resume(engine, a.load, model, optimizer) if a.load and os.path.exists(a.load) else 0
            return train(engine, model, optimizer, sizes, start, a.iters, a.save, a.save_interval)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
