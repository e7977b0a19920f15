"""A consumer loop's side of a rebalance.

- `RevocationGuard`: counts revoke callbacks, so a batch fetched before one (its
  partitions may have been revoked and assigned again: the positions were reset
  to the commits) is recognised as stale and left to be read again.
- `Rebalance`: the rebalance listener: under the loop's lock, its own work for
  the revoked partitions, then forget them and count the revoke.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from aiokafka import ConsumerRebalanceListener, TopicPartition

logger = logging.getLogger(__name__)


class RevocationGuard:
    """Tells a batch fetched before a revoke (stale) from one fetched after it."""

    def __init__(self) -> None:
        self.revocations = 0  # revoke callbacks run so far
        self._fetched_after = 0  # `revocations` when the last fetch returned

    def fetched(self) -> None:
        """Call as the fetch returns, with no await in between."""
        self._fetched_after = self.revocations

    def revoked(self) -> None:
        self.revocations += 1

    def stale(self) -> bool:
        """A revoke ran since the last fetch returned: its records are read again."""
        return self.revocations != self._fetched_after


class Rebalance(ConsumerRebalanceListener):  # type: ignore[misc]
    """A loop's rebalance listener: its revoked partitions' work is settled under its
    lock (`settle`), then forgotten (`forget`), and the revoke counted."""

    def __init__(
        self,
        what: str,
        lock: asyncio.Lock,
        guard: RevocationGuard,
        forget: Callable[[set[TopicPartition]], None],
        settle: Callable[[], Awaitable[None]] | None = None,
        assigned: Callable[[], None] | None = None,
    ) -> None:
        self.what = what  # "partitions", "delay tier partitions", ...
        self.lock = lock
        self.guard = guard
        self.forget = forget
        self.settle = settle
        self.assigned = assigned

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        async with self.lock:
            if self.settle is not None:
                await self.settle()
            self.forget(revoked)
            self.guard.revoked()
        if revoked:
            names = sorted(map(str, revoked))
            logger.info("%s revoked: %s", self.what, names, extra={"partitions": names})

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        if self.assigned is not None:
            self.assigned()
        names = sorted(map(str, assigned))
        logger.info("%s assigned: %s", self.what, names, extra={"partitions": names})
