"""Process-wide training globals (Megatron's get_args)."""
_ARGS = None


def set_args(args):
    global _ARGS
    _ARGS = args


def get_args():
    if _ARGS is None:
        raise RuntimeError("arguments are not initialized: call megatron.training.pretrain() first")
    return _ARGS
