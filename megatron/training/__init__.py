"""Our Megatron-style trainer over megatron-core (a namespace portion of `megatron`: no megatron/__init__.py).

`pretrain` is imported lazily so that `megatron.training.arguments` stays cheap to import (no megatron-core).
"""
from .global_vars import get_args, get_tokenizer  # noqa: F401


def pretrain(*args, **kwargs):
    from .arguments import answer_help
    answer_help(kwargs.get("extra_args_provider"), kwargs.get("argv"))  # before megatron-core's import warnings
    from .training import pretrain as _pretrain
    return _pretrain(*args, **kwargs)


def print_rank_0(msg):
    from .utils import print_rank_0 as _p
    _p(msg)
