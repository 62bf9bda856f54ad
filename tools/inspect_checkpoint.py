#!/usr/bin/env python
"""Inspect (and verify) datastates checkpoints.

    python tools/inspect_checkpoint.py SAVE_ROOT                 # iterations, latest, unpublished leftovers
    python tools/inspect_checkpoint.py SAVE_ROOT --iteration 100 # one iteration of a save root
    python tools/inspect_checkpoint.py SAVE_ROOT/iter_0000100     # ranks, bytes, tensors and their shard layout
    python tools/inspect_checkpoint.py PATH --verify              # read every data byte, check every checksum
    python tools/inspect_checkpoint.py PATH --json                # the same, machine-readable

For an iteration directory it shows the ranks (data bytes, items), every logical (global) tensor with its global
shape and which rank holds which global box (and the replicas a rank holds but does not write), rank-local
tensors, and objects with their sizes; the optimizer state's layout (a MoE model's chained dense + expert
optimizer part by part) and a MoE model's experts (how many, which ranks write and hold which: the EP layout).

The structural checks always run: metadata.json present and listing every rank, each manifest intact (its own
crc32c, and the one metadata.json published for it), data files at their recorded size, item extents inside
them, and every global tensor fully covered by written shards. `--verify` also reads every data byte through the
engine's verifier (the read pipeline a load uses, a crc32c per checksummed chunk) and compares it with the index.
Every problem is collected, none stops the others: every bad checksum, short or missing file, missing manifest,
uncovered or overlapping shard of every rank, each named with its file (and rank, item, file offset in --json).

Exit status: 0 when no problem was found; 1 when any problem was found (each printed with the file it concerns,
on stderr, also in the "problems" list of --json); 2 for a path that is not a checkpoint or a usage error.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys

if __package__ in (None, ""):  # run as `python tools/inspect_checkpoint.py`: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from datastates import Audit, Problems, storage_for  # noqa: E402
from datastates import NotACheckpointError as UsageError  # noqa: E402  (exit status 2)
from datastates.paths import (METADATA, PARTIAL, RANK_FILE_RE, checkpoint_dir, iteration_of,  # noqa: E402
                              normalize as normalize_path, partial_dir, scheme as url_scheme)
from datastates.logs import setup_logging  # noqa: E402
from tools.checkpoint.report import iteration_report, scan_root  # noqa: E402
from tools.checkpoint.text import print_iteration, print_root, progress  # noqa: E402

Scan = Audit  # the engine's audit of one checkpoint directory, under the name this tool gave it
__all__ = ["Problems", "Scan", "UsageError", "main", "scan_root"]
log = logging.getLogger("tools.inspect_checkpoint")


def _target(path: str, args, out: dict, problems: Problems) -> str | None:
    """The iteration directory to describe (None: only the save root), filling out["root"] for a save root."""
    storage = storage_for(path)
    is_iteration = iteration_of(path) is not None or path.endswith(PARTIAL) or \
        storage.exists(os.path.join(path, METADATA)) or any(RANK_FILE_RE.match(n) for n in storage.list(path))
    if is_iteration:
        if args.iteration is not None:
            raise UsageError("--iteration goes with a save root, not an iteration directory")
        return path
    out["root"] = scan_root(path, problems)
    if args.iteration is not None:
        target = checkpoint_dir(path, args.iteration)
        if storage.exists(target):
            return target
        if storage.exists(partial_dir(target)):
            return partial_dir(target)
        raise UsageError(f"{path!r} has no iteration {args.iteration} ({target!r} does not exist)")
    if args.verify:
        if out["root"]["latest"] is None:
            problems.add(path, "no published checkpoint to verify under this save root")
            return None
        return checkpoint_dir(path, out["root"]["latest"])
    return None


def _inspect(path: str, args, problems: Problems) -> dict:
    if not (os.path.exists(path) if url_scheme(path) is None else storage_for(path).exists(path)):
        raise UsageError(f"{path!r} does not exist")
    if url_scheme(path) is None and not os.path.isdir(path):
        raise UsageError(f"{path!r} is not a directory (a save root or an iteration directory)")
    out: dict = {}
    target = _target(path, args, out, problems)
    if target is not None:
        found = Audit(target, problems)
        if args.verify:
            bar = progress(sum(it.nbytes for info in found.ranks.values() for it in info["items"] if it.write),
                           "verify")
            try:
                found.verify(args.threads, bar.update)
            finally:
                bar.close()
        out["checkpoint"] = iteration_report(found)
    return out


def _print(out: dict, problems: Problems, args) -> None:
    if args.json:
        json.dump(out, sys.stdout, indent=1, default=str)
        sys.stdout.write("\n")
    else:
        if "root" in out:
            print_root(out["root"])
        if "checkpoint" in out:
            print_iteration(out["checkpoint"])
    for wng in problems.warnings:
        log.warning("%s: %s", wng["file"], wng["warning"])
    for prob in problems.found:
        log.error("PROBLEM %s: %s", prob.file, prob.message)
    if not args.json:
        if problems:
            log.error("%d problem(s) found", len(problems))
        elif args.verify:
            print("verify: OK, every checksum matches")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="inspect_checkpoint.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("path", help="a save root (holding iter_XXXXXXX/ and the tracker) or an iteration directory")
    ap.add_argument("--iteration", type=int, help="with a save root: describe this iteration")
    ap.add_argument("--verify", action="store_true",
                    help="read every data byte and check every checksum (with a save root: its latest iteration, "
                         "or --iteration)")
    ap.add_argument("--json", action="store_true", help="print one JSON document instead of text")
    ap.add_argument("--threads", type=int, default=4, help="native reader threads for --verify [4]")
    args = ap.parse_args(argv)
    setup_logging(rank=0)
    problems = Problems()
    try:
        out = _inspect(normalize_path(args.path), args, problems)
    except UsageError as e:
        log.error("%s", e)
        return 2
    out.update(problems=problems.items, warnings=problems.warnings, ok=not problems)
    _print(out, problems, args)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
