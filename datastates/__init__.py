"""datastates: lazy asynchronous multi-level checkpointing for Megatron-style LLM training."""
from . import _native  # noqa: F401  (the native writer is required, never optional)
from .engine import CheckpointEngine, SaveHandle
from .errors import CheckpointCorruptError, CheckpointError, CheckpointTimeoutError
from .providers import ProviderRegistry, StateProvider, register_provider

__all__ = ["CheckpointEngine", "SaveHandle", "CheckpointError", "CheckpointCorruptError", "CheckpointTimeoutError",
           "ProviderRegistry", "StateProvider", "register_provider"]
