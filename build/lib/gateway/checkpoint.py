"""Commit raw offsets only after the broker acknowledged what their batch forwarded.

At most one batch is being acknowledged while the next is voted on
(`Checkpoint.then`); batches finish, and are committed, strictly in fetch
order. `drain` waits for the batch in hand: before the next one is handed
over, before a rebalance moves partitions, and at stop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import CommitFailedError, IllegalStateError

logger = logging.getLogger(__name__)


class Checkpoint:
    def __init__(self, consumer: AIOKafkaConsumer) -> None:
        self.consumer = consumer
        self._finishing: asyncio.Task[None] | None = None  # the batch being acknowledged

    async def then(self, finish: Awaitable[dict[TopicPartition, int]]) -> None:
        """Wait for the previous batch, then acknowledge-and-commit this one in the background.

        `finish` forwards a batch, waits for the acknowledgements and returns
        the offsets to commit (next offset to read, per partition).
        """
        await self.drain()
        self._finishing = asyncio.create_task(self._commit_after(finish))

    async def drain(self) -> None:
        """Wait until the batch being acknowledged is committed (its errors surface here)."""
        if self._finishing is not None:
            finishing, self._finishing = self._finishing, None
            await finishing

    async def _commit_after(self, finish: Awaitable[dict[TopicPartition, int]]) -> None:
        await self.commit(await finish)

    async def commit(self, offsets: dict[TopicPartition, int]) -> None:
        """Commit `offsets` for the partitions still assigned to us."""
        assigned = self.consumer.assignment()
        offsets = {tp: o for tp, o in offsets.items() if tp in assigned}
        if not offsets:
            return
        try:
            await self.consumer.commit(offsets)
        except (CommitFailedError, IllegalStateError) as exc:
            # The partitions moved on; their new owner replays from the last
            # commit, and finds our marks owned by these same source records.
            logger.warning("commit failed after a rebalance, batch will be replayed: %s", exc)
