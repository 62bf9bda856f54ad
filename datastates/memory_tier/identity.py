"""Whose tier it is: a job never loads another job's memory tier, nor one written in another layout.

The job id is in the tier's path, and `job.json` (the owner record) says which job, world size and layout wrote
the parts; set-up clears a tier whose owner differs, and restart lists nothing from one.
"""
from __future__ import annotations

import hashlib
import json
import os

from .. import format as fmt
from .. import paths
from ..storage import SharedMemoryStorage


def job_id(save_dir: str | None) -> str:
    """The job a memory tier belongs to: DATASTATES_JOB_ID, else Slurm's job id, else the save directory (a
    restart of the same training run writes to the same place)."""
    explicit = os.environ.get("DATASTATES_JOB_ID") or os.environ.get("SLURM_JOB_ID")
    if explicit:
        return "".join(c if c.isalnum() or c in "-_." else "_" for c in explicit)
    where = (paths.normalize(save_dir) if paths.scheme(save_dir) else os.path.abspath(save_dir)) if save_dir \
        else os.getcwd()
    return "save-" + hashlib.sha1(where.encode()).hexdigest()[:16]


def owner(job: str, world_size: int, layout: list) -> dict:
    """The owner record of a tier: parts written under another one are never loaded."""
    return {"job": job, "world_size": world_size, "layout": list(layout)}


def read_owner(storage: SharedMemoryStorage, job_file: str) -> dict | None:
    """The owner record at `job_file`, None when there is none or it does not parse."""
    try:
        return json.loads(storage.read_bytes(job_file))
    except (OSError, ValueError):
        return None


def write_owner(storage: SharedMemoryStorage, job_file: str, record: dict) -> None:
    storage.write_bytes(job_file, fmt.encode_json(record), replace=True)
