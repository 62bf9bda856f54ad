"""Checkpointing in the trainer, split by job:

- `state`: what a checkpoint holds (megatron-core's sharded state dicts, RNG states, the common state);
- `manager`: `CheckpointManager`, the lifecycle the training loop drives, and its `SaveMode`;
- `formats`: one `CheckpointFormat` per `--ckpt-format` (datastates, torch_dist, torch) behind one interface;
- `loading`: the load policy (memory tier or storage, --finetune / --no-load-*, the layout checks).
"""
from .manager import CheckpointManager, SaveMode  # noqa: F401
from .state import build_state, sharded_metadata  # noqa: F401
