"""Where a conversion reads from and writes to, checked before anything is read or written."""
from __future__ import annotations

import os

from datastates import find_latest, storage_for
from datastates.paths import (METADATA, PARTIAL, checkpoint_dir, iteration_of, normalize as normalize_path,
                              partial_dir, scheme as url_scheme)


class ConvertError(Exception):
    """The input cannot be converted (exit status 1); the message names the path and the problem."""


# the formats kept on file systems only, and why; datastates checkpoints also live in object stores
FILE_SYSTEM_ONLY = {"torch_dist": "this tool reads and writes it through PyTorch DCP's file system reader and writer",
                    "torch_dcp": "this tool reads and writes it through PyTorch DCP's file system reader and writer",
                    "fsdp_dtensor": "this tool reads and writes it through PyTorch DCP's file system reader and "
                                    "writer",
                    "safetensors": "it is one file for transformers and safetensors' loaders"}
# read from a file system only: --to hf writes a model to s3:// or msc:// as the trainer's --save-hf does
READ_FROM_A_FILE_SYSTEM_ONLY = {"hf": "the import reads the model's files through safetensors' own reader"}


def check_locations(src: str, input_path: str, dst: str, output: str) -> None:
    """A URL (s3://, msc://) only where the format can live in an object store: refused before any work."""
    for fmt, path, flag in ((src, input_path, "--input"), (dst, output, "--output")):
        if url_scheme(path) is None:
            continue
        if fmt in FILE_SYSTEM_ONLY:
            raise ConvertError(f"{flag} {path!r}: {fmt} is read and written on a file system only "
                               f"({FILE_SYSTEM_ONLY[fmt]}); datastates checkpoints can live in an object store")
        if flag == "--input" and fmt in READ_FROM_A_FILE_SYSTEM_ONLY:
            raise ConvertError(f"{flag} {path!r}: {fmt} is read from a file system only "
                               f"({READ_FROM_A_FILE_SYSTEM_ONLY[fmt]})")


def resolve_input(path: str, iteration: int | None, what: str) -> str:
    """The iteration directory to convert: `path` itself, its iteration `iteration`, or its latest published."""
    storage = storage_for(path)
    path = normalize_path(path)
    local = url_scheme(path) is None
    if not (os.path.exists(path) if local else storage.exists(path)):
        raise ConvertError(f"input {path!r} does not exist")
    if local and not os.path.isdir(path):
        raise ConvertError(f"input {path!r} is not a directory ({what} checkpoints are directories)")
    if path.endswith(PARTIAL):
        raise ConvertError(f"input {path!r} is not published: a '.partial' directory is an unfinished or failed save")
    if iteration is not None:
        cand = checkpoint_dir(path, iteration)
        if not storage.exists(cand):
            if storage.exists(partial_dir(cand)):
                raise ConvertError(f"iteration {iteration} under {path!r} is not published "
                                   f"({partial_dir(cand)!r} is an unfinished or failed save)")
            raise ConvertError(f"input {path!r} has no iteration {iteration} ({cand!r} does not exist)")
        return cand
    if storage.exists(os.path.join(path, METADATA)) or iteration_of(path) is not None:
        return path
    latest = find_latest(path, storage)
    if latest.path is None:
        raise ConvertError(f"input {path!r} is not a {what} checkpoint directory (no metadata.json) nor a save root "
                           f"holding a published one: {latest.why_none()}")
    return latest.path


def resolve_output(path: str, iteration) -> tuple[str, str | None]:
    """(checkpoint directory, save root whose tracker to update or None)."""
    storage = storage_for(path)
    path = normalize_path(path)
    if iteration_of(path) is not None:
        out, root = path, os.path.dirname(path) or "."
    else:
        it = iteration if isinstance(iteration, int) else 0
        out, root = checkpoint_dir(path, it), path
    occupied = storage.list(out) if url_scheme(out) or os.path.isdir(out) else os.path.exists(out)
    if occupied:
        raise ConvertError(f"output {out!r} already exists and is not empty: refusing to overwrite it")
    return out, root
