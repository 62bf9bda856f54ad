"""datastates: lazy asynchronous multi-level checkpointing for Megatron-style LLM training.

The public API is what `__all__` names, plus three public modules: `datastates.megatron` (the adapter to
megatron-core's sharded state dicts), `datastates.names` (how that adapter names items, without megatron-core)
and `datastates.logs`. Every other module is the engine's own and may change (docs/architecture.md, "Public API";
tests/test_import_contract.py holds the tools to it).
"""
from . import _native  # noqa: F401  (the native writer is required, never optional)
from .audit import RANK_FILE_RE, Audit, NotACheckpointError, audit_checkpoint, box_str
from .engine import CheckpointEngine
from .pipeline import SaveHandle, SaveStats
from .errors import CheckpointCorruptError, CheckpointError, CheckpointTimeoutError
from .layout import (DELETING, METADATA, PARTIAL, TRACKER, checkpoint_dir, iteration_of, manifest_file,
                     partial_dir)
from .problems import Problem, Problems
from .providers import ProviderRegistry, StateProvider, register_provider
from .restore import CheckpointReader
from .schema import Box, dtype_from_name
from .copies import built_on_copy
from .layout import normalize as normalize_path, scheme as url_scheme
from .storage import PosixOptions, Storage, read_index, read_json, storage_for
from .storage.posix import fsync_dir, write_file
from .tracker import Latest, find_latest, is_published, write_latest

__all__ = [
    # saving and loading
    "CheckpointEngine", "PosixOptions", "SaveHandle", "SaveStats", "ProviderRegistry", "StateProvider",
    "register_provider",
    "built_on_copy",
    # reading and checking one checkpoint
    "CheckpointReader", "Audit", "audit_checkpoint", "Problem", "Problems", "Box", "box_str", "dtype_from_name",
    # errors
    "CheckpointError", "CheckpointCorruptError", "CheckpointTimeoutError", "NotACheckpointError",
    # a save root's layout: iteration directories, the tracker, a checkpoint's files
    "checkpoint_dir", "iteration_of", "partial_dir", "is_published", "find_latest", "Latest", "write_latest",
    "TRACKER", "PARTIAL", "DELETING", "METADATA", "manifest_file", "RANK_FILE_RE", "read_index",
    # small files written durably (the tools' other formats), JSON read with a clear error
    "write_file", "fsync_dir", "read_json",
    # where checkpoints live: the backend a path or URL names (s3://, msc://, a file system), paths and URLs alike
    "storage_for", "Storage", "url_scheme", "normalize_path",
]
