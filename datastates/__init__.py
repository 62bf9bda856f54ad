"""datastates: lazy asynchronous multi-level checkpointing for Megatron-style LLM training."""
from . import _native  # noqa: F401  (the native writer is required, never optional)
from .audit import Audit, audit_checkpoint
from .engine import CheckpointEngine, SaveHandle
from .errors import CheckpointCorruptError, CheckpointError, CheckpointTimeoutError
from .problems import Problem, Problems
from .providers import ProviderRegistry, StateProvider, register_provider
from .restore import CheckpointReader

__all__ = ["CheckpointEngine", "SaveHandle", "CheckpointReader", "Audit", "audit_checkpoint", "Problem", "Problems",
           "CheckpointError", "CheckpointCorruptError", "CheckpointTimeoutError", "ProviderRegistry",
           "StateProvider", "register_provider"]
