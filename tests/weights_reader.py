"""A rollout-side reader process for tests/test_weights_publish.py (the readers' library alone, no megatron-core):

    python tests/weights_reader.py ROOT follow LAST   the first version whole, then each newer one through the deltas
                                                      into its own copy (whole again when its chain is gone), each
                                                      compared bit for bit with the full version while it is still
                                                      held: `GOT <iteration> <bytes read> <how> <exact|unchecked>`,
                                                      until LAST, then `DONE`
    python tests/weights_reader.py ROOT hold          the first version, one tensor read, then `MID-READ <iteration>`
                                                      and sleep holding it (the test SIGKILLs it there)

Either prints `READY` first, once its imports are done: the test starts the trainer only then, so that a reader
slow to start on a loaded machine does not miss the versions it is there for.
"""
import sys
import time

import torch

from datastates.weights import WeightsError, WeightsReader

root, mode = sys.argv[1], sys.argv[2]
reader = WeightsReader(root)
print("READY", flush=True)
if mode == "hold":
    version = reader.wait_next(None, timeout_s=300)
    next(version.tensors())
    print(f"MID-READ {version.iteration}", flush=True)
    time.sleep(600)
last, newest, held = int(sys.argv[3]), None, None
while newest != last:
    how = "full"
    if held is not None:
        while reader.pointed() == newest:
            time.sleep(0.005)
        try:
            newest, nbytes = reader.catch_up(held, newest)
            how = "deltas"
        except WeightsError:
            held = None
    if held is None:
        with reader.wait_next(newest, timeout_s=300) as version:
            held, newest = dict(version.tensors()), version.iteration
        nbytes = sum(t.numel() * t.element_size() for t in held.values())
    try:
        with reader.open(newest) as version:
            bits = {torch.float32: torch.int32, torch.bfloat16: torch.int16}
            exact = all(torch.equal(held[n].view(bits[t.dtype]), t.view(bits[t.dtype])) for n, t in version.tensors())
        check = "exact" if exact else "DIFFERS"
    except WeightsError:  # retired already: the trainer went on
        check = "unchecked"
    print(f"GOT {newest} {nbytes} {how} {check}", flush=True)
print("DONE", flush=True)
