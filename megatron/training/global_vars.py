"""Process-wide training globals (Megatron's get_args, get_tokenizer), set by `initialize_megatron`."""
_GLOBALS: dict = {}


def _get(name: str):
    if _GLOBALS.get(name) is None:
        raise RuntimeError(f"{name}: not set up: call megatron.training.pretrain() first")
    return _GLOBALS[name]


def set_args(args):
    _GLOBALS["args"] = args


def get_args():
    return _get("args")


def set_tokenizer(tokenizer):
    _GLOBALS["tokenizer"] = tokenizer


def get_tokenizer():
    return _get("tokenizer")
