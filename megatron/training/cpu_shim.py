"""The one place where megatron-core's hard-coded CUDA calls are made harmless on a CPU-only machine.

megatron-core (0.16-0.19) calls a few `torch.cuda` device-management functions unconditionally on paths that
are otherwise device-agnostic: `torch.cuda.current_device()` as the `device=` of scratch buffers
(`GlobalMemoryBuffer`, some collectives), `torch.cuda.synchronize()` around timers and in
`dist_checkpointing`, `torch.cuda.set_device()` / `torch.cuda.device_count()` during initialization.
On a torch built without CUDA (or a machine without a GPU) every one of them raises.

`install()` replaces exactly these four functions, and only when `torch.cuda.is_available()` is False:

- `current_device()` returns the string ``"cpu"`` so that `torch.empty(..., device=torch.cuda.current_device())`
  allocates on the CPU;
- `synchronize()` and `set_device()` do nothing (there is no device work to wait for);
- `device_count()` returns 0.

Tensor factory functions (`torch.empty`, `torch.zeros`, ...) are never touched, and when CUDA is present this
module does nothing at all. `uninstall()` restores the originals (used by tests).
"""
from __future__ import annotations

import torch

_ORIGINALS: dict = {}


def _current_device():
    return "cpu"


def _synchronize(device=None):
    return None


def _set_device(device):
    return None


def _device_count():
    return 0


def needed() -> bool:
    return not torch.cuda.is_available()


def installed() -> bool:
    return bool(_ORIGINALS)


def install() -> bool:
    """Make megatron-core's hard-coded CUDA device calls harmless on a CPU-only machine. Idempotent.

    Returns True when the shim is active, False when CUDA is present (nothing is changed then).
    """
    if not needed():
        return False
    if _ORIGINALS:
        return True
    for name, repl in (("current_device", _current_device), ("synchronize", _synchronize),
                       ("set_device", _set_device), ("device_count", _device_count)):
        _ORIGINALS[name] = getattr(torch.cuda, name)
        setattr(torch.cuda, name, repl)
    return True


def uninstall() -> None:
    for name, orig in _ORIGINALS.items():
        setattr(torch.cuda, name, orig)
    _ORIGINALS.clear()
