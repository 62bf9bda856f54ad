"""Process-wide training globals (Megatron's get_args, get_tokenizer)."""
_ARGS = None
_TOKENIZER = None


def set_args(args):
    global _ARGS
    _ARGS = args


def get_args():
    if _ARGS is None:
        raise RuntimeError("arguments are not initialized: call megatron.training.pretrain() first")
    return _ARGS


def set_tokenizer(tokenizer):
    global _TOKENIZER
    _TOKENIZER = tokenizer


def get_tokenizer():
    if _TOKENIZER is None:
        raise RuntimeError("the tokenizer is not built: call megatron.training.pretrain() first")
    return _TOKENIZER
