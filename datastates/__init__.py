"""datastates: lazy asynchronous multi-level checkpointing for Megatron-style LLM training.

The public API is what `__all__` names, plus the public modules: `datastates.paths` (what a save root and a
checkpoint hold: its names, and paths and URLs alike), `datastates.megatron` (the adapter to megatron-core's
sharded state dicts), `datastates.names` (how that adapter names items, without megatron-core), `datastates.logs`,
`datastates.dtensors` (torch DTensors: a rank's shard and its box, and their providers), `datastates.weights`
(the readers of the policy versions a trainer publishes: rl-weights.md),
and the Hugging Face library `datastates.hf` (transformers in and out). Every other module is the engine's own and
may change (docs/architecture.md, "Public API"; tests/test_import_contract.py holds the trainer, the tools and
the benchmarks to it).
"""
from . import _native  # noqa: F401  (the native writer is required, never optional)
from .audit import Audit, NotACheckpointError, audit_checkpoint, box_str
from .codecs import AUTO as AUTO_CODEC, SETTINGS as CODEC_SETTINGS
from .coordination import Coordinator, default_store
from .dtensors import GlobalState
from .engine import CheckpointEngine
from .exchange import Exchange
from .pipeline import SaveHandle, SaveStats
from .errors import CheckpointCorruptError, CheckpointError, CheckpointTimeoutError
from .memory_tier import LocalTier, check_fits, fitted_replication, job_id, node_of
from .problems import Problems
from .providers import ProviderRegistry, StateProvider, default_registry, register_provider
from .load_reads import LoadStats
from .reader import CheckpointReader
from .save_root import DIRECTORY_TEXT, ITERATION_TEXT, SaveRoot, holds_dcp, holds_legacy
from .save_plan import aligned_empty
from .schema import Box, dtype_from_name, dtype_name
from .copies import built_on_copy
from .storage import DEFAULT_READ_THREADS, PosixOptions, Storage, read_index, read_json, storage_for
from .storage.posix import fsync_dir
from .tracker import clean_leftovers, find_latest, is_published, published_iterations, read_latest, write_latest

__all__ = [
    # saving and loading
    "CheckpointEngine", "PosixOptions", "SaveHandle", "SaveStats", "ProviderRegistry", "StateProvider",
    "register_provider",
    "default_registry",  # the built-in providers, which one engine's own registry extends (ProviderRegistry(...))
    # a torch.distributed state dict (FSDP2's DTensors, Adam's step) saved and loaded as global items, any layout
    "GlobalState",
    "built_on_copy",
    # what CheckpointEngine(compress=) takes, and the codec `auto` picks (the trainer's --ckpt-compress and its help)
    "CODEC_SETTINGS", "AUTO_CODEC",
    # a client of the default process group's store, and the ranks' agreement through it (report, wait for every
    # rank's report): the engine's own, which the trainer's Hugging Face export agrees through too
    "default_store", "Coordinator",
    # a load's reads passed between ranks (--ckpt-fully-parallel-load: load_sharded's exchange), and what a load read
    "Exchange", "LoadStats",
    # reading and checking one checkpoint
    "CheckpointReader", "Audit", "audit_checkpoint", "Problems", "Box", "box_str", "dtype_from_name",
    "dtype_name",  # and back: the name an index gives a dtype (the trainer's --save-hf plans from model shapes)
    # errors
    "CheckpointError", "CheckpointCorruptError", "CheckpointTimeoutError", "NotACheckpointError",
    # a save root's checkpoints (their names: `datastates.paths`): which one a load resumes from, published or not,
    # the tracker pointed at one written outside the engine, a checkpoint's index
    "is_published", "find_latest", "write_latest", "read_index",
    # the tracker read as an iteration, the published iterations, and a run's clean-up before its first save
    "read_latest", "published_iterations", "clean_leftovers",
    # the one publication policy of a save root (stage, commit, pointer, retention, leftovers), for every kind of
    # root: its marker and pointer are parameters (a Hugging Face models root: the safetensors index, `latest`
    # holding DIRECTORY_TEXT)
    "SaveRoot", "ITERATION_TEXT", "DIRECTORY_TEXT",
    # Megatron's legacy torch format detected as the tracker detects it (the trainer's torch format)
    "holds_dcp",
    "holds_legacy",
    # a directory's entries made durable (the benchmarks' files), JSON read with a clear error
    "fsync_dir", "read_json",
    # where checkpoints live: the backend a path or URL names (s3://, msc://, a file system)
    "storage_for", "Storage",
    # bytes a storage writes with O_DIRECT straight from their pages (the trainer's --save-hf assembles units in them)
    "aligned_empty",
    # a storage's reads in flight when not told (the trainer's --ckpt-read-threads default)
    "DEFAULT_READ_THREADS",
    # the node-local memory tier (--non-persistent-*): the tier, the check that it fits, whose it is, a rank's node
    "LocalTier", "check_fits", "fitted_replication", "job_id", "node_of",
]
