"""A rollout-side process for benchmarks/rl_weights.py: takes each new policy version until iteration LAST and
prints `GOT <iteration> <unix time it holds it> <bytes it read>` (`READY` first, once its imports are done).

    python benchmarks/rl_reader.py versions ROOT LAST   datastates.weights: every tensor of the newest version read
    python benchmarks/rl_reader.py deltas ROOT LAST     the first version whole, then each next one through the
                                                        deltas into this reader's own copy (the full one if its
                                                        chain is gone)
    python benchmarks/rl_reader.py hf ROOT LAST         --save-hf's `latest` reloaded with from_pretrained
    python benchmarks/rl_reader.py remote HOST:PORT LAST         as `versions`, from a relay over TCP
    python benchmarks/rl_reader.py remote-deltas HOST:PORT LAST  as `deltas`, from a relay over TCP (the bytes
                                                                 received on the wire, frames included)
"""
import os
import sys
import time

kind, root, last = sys.argv[1], sys.argv[2], int(sys.argv[3])
newest = None
if kind in ("versions", "deltas"):
    from datastates.weights import WeightsError, WeightsReader
    reader = WeightsReader(root)
    print("READY", flush=True)
    held = None
    while newest != last:
        if held is not None:
            while reader.pointed() == newest:
                time.sleep(0.005)
            try:
                newest, nbytes = reader.catch_up(held, newest)
                print(f"GOT {newest} {time.time():.6f} {nbytes}", flush=True)
                continue
            except WeightsError:
                pass
        with reader.wait_next(newest, timeout_s=600) as version:
            tensors = dict(version.tensors())
            newest = version.iteration
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        held = tensors if kind == "deltas" else None
        print(f"GOT {newest} {time.time():.6f} {nbytes}", flush=True)
elif kind in ("remote", "remote-deltas"):
    from datastates.weights import RemoteReader
    host, port = root.rsplit(":", 1)
    reader = RemoteReader(host, int(port), timeout_s=600)
    print("READY", flush=True)
    held = None
    while newest != last:
        if held is not None:  # the relay waits for the next version, then sends its deltas (or the full one)
            newest, nbytes = reader.catch_up(held, newest, timeout_s=600)
        else:
            with reader.wait_next(newest, timeout_s=600) as version:
                tensors = dict(version.tensors())
                newest, nbytes = version.iteration, version.nbytes
            held = tensors if kind == "remote-deltas" else None
        print(f"GOT {newest} {time.time():.6f} {nbytes}", flush=True)
else:
    import torch
    from transformers import AutoModelForCausalLM
    from datastates.weights import WeightsReader  # its pointer's reader: --save-hf's `latest` is the same
    reader = WeightsReader(root)
    print("READY", flush=True)
    while newest != last:
        pointed = reader.pointed()
        if pointed is None or pointed == newest:
            time.sleep(0.005)
            continue
        path = os.path.join(root, f"iter_{pointed:07d}")
        try:
            AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        except OSError:  # retired by --save-hf-keep-last while this reader was behind: the newest is taken next
            continue
        newest = pointed
        nbytes = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))
        print(f"GOT {newest} {time.time():.6f} {nbytes}", flush=True)
