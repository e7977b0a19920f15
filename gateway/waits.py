"""The one stop-aware wait of the gateway's loops."""

from __future__ import annotations

import asyncio
import contextlib


async def wait_or_stop(stop: asyncio.Event, seconds: float) -> bool:
    """Sleep `seconds`, or less when `stop` is set meanwhile; True when it is set."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), seconds)
    return stop.is_set()
