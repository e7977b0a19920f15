"""Commit raw offsets only after the broker acknowledged what their batch forwarded.

At most one batch is being acknowledged while the next is voted on
(`Checkpoint.then`); batches finish, and are committed, strictly in fetch
order. `drain` waits for the batch in hand: before the next one is handed
over, before a rebalance moves partitions, and at stop.

A batch completes through the raw loop's `Completion` (gateway/kafka/completion.py):
its offsets committed once its copies are acknowledged or, with `[kafka]
exactly_once`, its copies and its raw offsets in one Kafka transaction, begun before
the first copy is sent. A transaction that aborts (the group moved on, or the broker
aborted it after `transaction_timeout`) forwarded nothing a `read_committed` reader
sees and committed no offset: `drain` raises `StepAborted`
(gateway/kafka/exactly_once.py), and the raw loop reads every partition again from
its committed offset. The marks its records claimed name them as owners, so the
replay forwards them again.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable

from aiokafka import TopicPartition

from gateway import faults
from gateway.kafka.completion import Completion
from gateway.kafka.exactly_once import StepAborted
from gateway.kafka.transactions import Member


class Checkpoint:
    def __init__(self, completion: Completion) -> None:
        self.completion = completion
        self._finishing: asyncio.Task[None] | None = None  # the batch being acknowledged

    async def then(
        self, finish: Awaitable[dict[TopicPartition, int]], member: Member = (-1, "", None)
    ) -> None:
        """Wait for the previous batch, then acknowledge-and-commit this one in the background.

        `finish` forwards a batch, waits for the acknowledgements and returns
        the offsets to commit (next offset to read, per partition); `member` is who
        the consumer was in its group when the batch was fetched. Raises
        `StepAborted` when the previous batch's transaction aborted; `finish` is
        then not started (its batch was read before the abort: it is read again).
        """
        try:
            await self.drain()
        except StepAborted:
            if asyncio.iscoroutine(finish):
                finish.close()
            raise
        self._finishing = asyncio.create_task(self._complete(finish, member))

    async def drain(self) -> None:
        """Wait until the batch being acknowledged is committed (its errors surface here).
        Callers hold the raw loop's `batch_lock`: it is taken from the checkpoint as it is
        waited for, so a second caller meanwhile would not wait for it."""
        if self._finishing is not None:
            finishing, self._finishing = self._finishing, None
            await finishing

    async def _complete(self, finish: Awaitable[dict[TopicPartition, int]], member: Member) -> None:
        """`finish`, then the offsets it returns committed as `member` (a partition that
        moved on meanwhile: its new owner replays from the last commit, and finds our
        marks owned by these same source records)."""
        await self.completion.complete(self._acked(finish), member)

    @staticmethod
    async def _acked(
        finish: Awaitable[dict[TopicPartition, int]],
    ) -> dict[TopicPartition, int]:
        """`finish`'s offsets, once its copies are acknowledged: the crash window's start."""
        offsets = await finish
        faults.reached("raw-acked")
        return offsets
