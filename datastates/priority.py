"""The engine's background work runs below training: on a host whose cores training uses, a checksum or a write
that competes as an equal slows the step more than it gains. Only the snapshot's copies (what the fence waits
for) keep training's priority."""
from __future__ import annotations

import os
import threading

BACKGROUND_NICE = 5  # Linux per-thread nice of the writers, encoders and the stages after the snapshot


def lower_priority() -> None:
    """Run the calling thread at BACKGROUND_NICE (Linux applies nice per thread; elsewhere nothing changes)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)
    except (OSError, AttributeError):
        pass
