"""A rollout-side reader process for tests/test_weights_publish.py (the readers' library alone, no megatron-core):

    python tests/weights_reader.py ROOT follow LAST   every version as it comes, each read whole (every tensor),
                                                      printing `GOT <iteration> <bytes>`, until LAST, then `DONE`
    python tests/weights_reader.py ROOT hold          the first version, one tensor read, then `MID-READ <iteration>`
                                                      and sleep holding it (the test SIGKILLs it there)
"""
import sys
import time

from datastates.weights import WeightsReader

root, mode = sys.argv[1], sys.argv[2]
reader = WeightsReader(root)
if mode == "hold":
    version = reader.wait_next(None, timeout_s=300)
    next(version.tensors())
    print(f"MID-READ {version.iteration}", flush=True)
    time.sleep(600)
last, newest = int(sys.argv[3]), None
while newest != last:
    with reader.wait_next(newest, timeout_s=300) as version:
        nbytes = sum(t.numel() * t.element_size() for _, t in version.tensors())
        newest = version.iteration
    print(f"GOT {newest} {nbytes}", flush=True)
print("DONE", flush=True)
