"""The engine's background work runs below training: on a host whose cores training uses, a checksum or a write
that competes as an equal slows the step more than it gains. Only the snapshot's copies (what the fence waits
for) keep training's priority. "Below" is relative: a job started under `nice -n 10` runs its background work at
15, never at a fixed value that could put it above training."""
from __future__ import annotations

import os
import threading

BACKGROUND_NICE = 5  # added to the caller's nice: the writers, encoders and the stages after the snapshot


def thread_nice() -> int:
    """The calling thread's nice (Linux keeps one per thread; 0 where it cannot be read)."""
    try:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    except (OSError, AttributeError):
        return 0


def background_nice() -> int:
    """The nice of background work made by the calling thread (the engine's caller): BACKGROUND_NICE above its own.
    Taken where the work is set up, because a thread inherits the nice of the thread that starts it, which for a
    pool started lazily may already be a background one."""
    return thread_nice() + BACKGROUND_NICE


def lower_priority(nice: int) -> None:
    """Run the calling thread at `nice` if that is below its priority now (best effort: never raised, which
    needs privileges; elsewhere than Linux nothing changes)."""
    if nice <= thread_nice():
        return
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except (OSError, AttributeError):
        pass


def added_from_here(nice: int) -> int:
    """What a native pool started by the calling thread adds to its nice (the pools add to the nice their threads
    inherit from this one) so that they run at `nice`."""
    return max(0, nice - thread_nice())
