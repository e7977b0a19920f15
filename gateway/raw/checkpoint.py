"""Commit raw offsets only after the broker acknowledged what their batch forwarded.

At most one batch is being acknowledged while the next is voted on
(`Checkpoint.then`); batches finish, and are committed, strictly in fetch
order. `drain` waits for the batch in hand: before the next one is handed
over, before a rebalance moves partitions, and at stop.

Exactly once (`[kafka] exactly_once`): a batch's copies and its raw offsets go in
one Kafka transaction, begun before the first copy is sent and committed with the
offsets (gateway/kafka/transactions.py). A transaction that aborts (the group moved
on, or the broker aborted it after `transaction_timeout`) forwarded nothing a
`read_committed` reader sees and committed no offset: `drain` raises `BatchAborted`,
and the raw loop reads every partition again from its committed offset. The marks
its records claimed name them as owners, so the replay forwards them again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import (
    CommitFailedError,
    IllegalStateError,
    KafkaError,
    ProducerFenced,
)

from gateway import faults
from gateway.kafka.clients import stop_within
from gateway.kafka.transactions import Member, TransactionalProducer

logger = logging.getLogger(__name__)


class BatchAborted(Exception):
    """A batch's transaction aborted: nothing of it is visible, no offset moved."""


@dataclass
class Transactions:
    """The raw loop's transactional producer (started), how to build another, and who
    sends through it (`use`). `renew` replaces a fenced one: the broker aborted its
    transaction after `transaction_timeout` and bumped its epoch."""

    producer: TransactionalProducer
    build: Callable[[], TransactionalProducer]
    use: Callable[[TransactionalProducer], None]

    async def renew(self) -> None:
        old, self.producer = self.producer, self.build()
        await self.producer.start()  # InitProducerId under the same id: a new epoch
        self.use(self.producer)
        logger.warning("transactional producer fenced: a new one under the same id goes on")
        await stop_within(old)


class Checkpoint:
    def __init__(
        self, consumer: AIOKafkaConsumer, transactions: Transactions | None = None
    ) -> None:
        self.consumer = consumer
        self.transactions = transactions
        self._finishing: asyncio.Task[None] | None = None  # the batch being acknowledged

    async def then(
        self, finish: Awaitable[dict[TopicPartition, int]], member: Member = (-1, "", None)
    ) -> None:
        """Wait for the previous batch, then acknowledge-and-commit this one in the background.

        `finish` forwards a batch, waits for the acknowledgements and returns
        the offsets to commit (next offset to read, per partition); `member` is who
        the consumer was in its group when the batch was fetched. Raises
        `BatchAborted` when the previous batch's transaction aborted; `finish` is
        then not started (its batch was read before the abort: it is read again).
        """
        try:
            await self.drain()
        except BatchAborted:
            if asyncio.iscoroutine(finish):
                finish.close()
            raise
        if self.transactions is not None:
            self._finishing = asyncio.create_task(self._transaction(finish, member))
        else:
            self._finishing = asyncio.create_task(self._commit_after(finish))

    async def drain(self) -> None:
        """Wait until the batch being acknowledged is committed (its errors surface here)."""
        if self._finishing is not None:
            finishing, self._finishing = self._finishing, None
            await finishing

    async def _commit_after(self, finish: Awaitable[dict[TopicPartition, int]]) -> None:
        offsets = await finish
        faults.reached("raw-acked")
        await self.commit(offsets)

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

    async def _transaction(
        self, finish: Awaitable[dict[TopicPartition, int]], member: Member
    ) -> None:
        """`finish` and the offsets it returns in one transaction, committed as `member`."""
        assert self.transactions is not None
        producer = self.transactions.producer
        await producer.begin_transaction()
        try:
            offsets = await finish
            faults.reached("raw-acked")
            assigned = self.consumer.assignment()
            offsets = {tp: o for tp, o in offsets.items() if tp in assigned}
            if offsets and (member[0] < 0 or not member[1]):
                # Fetched while out of the group: the coordinator would take a commit
                # without a generation for one with no group metadata, and accept it.
                raise CommitFailedError(f"the batch was fetched outside the group ({member})")
            if offsets:
                await producer.send_group_offsets(offsets, self.consumer._group_id, member)
            await producer.commit_transaction()
        except ProducerFenced as exc:
            # Our epoch is gone (the coordinator aborted the transaction after its
            # timeout, or a restart under our id began): nothing of it commits.
            logger.warning("raw batch's transaction fenced (%s): reading it again", exc)
            await self.transactions.renew()
            raise BatchAborted(str(exc)) from exc
        except KafkaError as exc:  # CommitFailedError: the group moved on
            logger.warning("raw batch's transaction aborted (%s): reading it again", exc)
            try:
                await producer.abort_after_error()
            except KafkaError as again:
                logger.warning("abort failed (%r): a new transactional producer goes on", again)
                await self.transactions.renew()
            raise BatchAborted(str(exc)) from exc
        except BaseException:
            if producer._txn_manager.is_in_transaction():
                await asyncio.shield(producer.abort_transaction())
            raise
