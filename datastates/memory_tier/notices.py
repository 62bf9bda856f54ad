"""What the memory tier tells the operator about its decisions (a tier cleared, memory not used, a part
recovered): one NOTICE line, shared so every such decision reads alike in the log."""
from __future__ import annotations

import logging

log = logging.getLogger(__name__)


def notice(msg: str, any_rank: bool = False) -> None:
    """Logged by rank 0 only unless `any_rank` (what one rank alone knows, e.g. that it recovered its part)."""
    log.info("NOTICE: " + msg, extra={"any_rank": any_rank})
