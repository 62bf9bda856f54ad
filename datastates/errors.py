"""Errors raised by the engine. Every message names the file or item and what is wrong with it."""


class CheckpointError(RuntimeError):
    """A save or load failed; the previous published checkpoint is untouched."""


class CheckpointCorruptError(CheckpointError):
    """Bytes on disk do not match what was written (checksum, truncation, damaged manifest)."""


class CheckpointTimeoutError(CheckpointError):
    """A rank did not finish its part of a checkpoint in time."""
