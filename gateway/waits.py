"""Waiting: the one stop-aware wait of the gateway's loops, and how often to say so."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable


async def wait_or_stop(stop: asyncio.Event, seconds: float) -> bool:
    """Sleep `seconds`, or less when `stop` is set meanwhile; True when it is set."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), seconds)
    return stop.is_set()


REPORT_MAX_S = 60.0


class FallingReport:
    """When to repeat a report: at once, then at doubling intervals up to `max_s`."""

    def __init__(
        self,
        first_s: float,
        max_s: float = REPORT_MAX_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.every = first_s
        self.max_s = max_s
        self.clock = clock
        self.next_at = clock()

    def due(self) -> bool:
        """True when a report is due; the next one is then due twice as late."""
        if self.clock() < self.next_at:
            return False
        self.every = min(self.every * 2, self.max_s)
        self.next_at = self.clock() + self.every
        return True
