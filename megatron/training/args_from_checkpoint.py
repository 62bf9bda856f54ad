"""--use-checkpoint-args: the model's architecture from the checkpoint to load, as upstream's flag does.

The saved args of the newest checkpoint under --load fill every architecture flag (the parser's "model" group,
and the tokenizer type) the command line leaves at its default. A flag the command line sets to another value
than the checkpoint's is refused naming both: the weights would not fit that model. Training choices (dropout,
initialisation, the dtype, the implementation) stay the command line's, as upstream. Read before the
distributed start, on every rank: it reads the checkpoint's small common state only (a legacy torch checkpoint
is one file, read whole).
"""
from __future__ import annotations

import argparse

from .arguments import ArgumentError, build_parser
from .latent_attention import ARCHITECTURE as MLA_ARCHITECTURE
from .moe import ARCHITECTURE as MOE_ARCHITECTURE
from .multi_token import ARCHITECTURE as MTP_ARCHITECTURE

TRAINING_CHOICES = {"hidden_dropout", "attention_dropout", "init_method_std", "fp16", "bf16", "transformer_impl"}


def architecture_flags(parser: argparse.ArgumentParser) -> list[str]:
    """The dests of the parser's model group that shape the weights, those of the mixture of experts, multi-latent
    attention and multi-token prediction, and the tokenizer type."""
    group = next(g for g in parser._action_groups if g.title == "model")
    return ([a.dest for a in group._group_actions if a.dest not in TRAINING_CHOICES] + list(MOE_ARCHITECTURE)
            + list(MLA_ARCHITECTURE) + list(MTP_ARCHITECTURE) + ["tokenizer_type"])


def saved_args(load_dir: str) -> tuple[argparse.Namespace, str]:
    """(the args saved in the newest checkpoint under `load_dir`, its directory)."""
    from contextlib import closing

    from datastates import find_latest
    from .checkpointing.formats import detect
    latest = find_latest(load_dir)
    if latest.path is None:
        raise ArgumentError(f"--use-checkpoint-args: {latest.why_none()}")
    with closing(detect(latest.path).alone()) as ckpt_format:
        saved = ckpt_format.saved_common(latest.path).get("args")
    if saved is None:
        raise ArgumentError(f"--use-checkpoint-args: {latest.path} holds no saved args")
    return saved, latest.path


def apply_checkpoint_args(args: argparse.Namespace) -> None:
    """Fill the architecture flags of `args` from the checkpoint under --load (see the module's docstring)."""
    if args.load is None:
        raise ArgumentError("--use-checkpoint-args needs --load (the checkpoint whose args to use)")
    saved, path = saved_args(args.load)
    parser = build_parser()
    for name in architecture_flags(parser):
        if not hasattr(saved, name):
            continue
        mine, theirs = getattr(args, name), getattr(saved, name)
        if mine == parser.get_default(name):
            setattr(args, name, theirs)
        elif mine != theirs:
            raise ArgumentError(f"--use-checkpoint-args: --{name.replace('_', '-')} is {mine} on the command line "
                                f"but {theirs} in {path}: drop the flag, or load another checkpoint")
