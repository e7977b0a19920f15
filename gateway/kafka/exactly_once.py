"""One Kafka transaction per step of a consumer loop: its copies and its input offsets
committed together, or neither (`[kafka] exactly_once`).

The raw loop (gateway/raw/checkpoint.py), the delay loop (gateway/delay/loop.py) and,
in retry mode, the failure loop (gateway/failures/loop.py) each complete their steps
through a `TransactionalCompletion` (gateway/kafka/completion.py) that holds a `Transactions`:
their own transactional producer, under an id of their own
(`<group_id>.<loop>.<group_instance_id or this process's own>`). A step that aborts
(the group moved on, or the broker aborted it after `transaction_timeout`) wrote
nothing a `read_committed` reader sees and moved no offset: `run` raises
`StepAborted`, and the loop reads its partitions again from their committed offsets
(`ConsumerLoop.read_again`).

Every transaction that writes copies commits input offsets with them, at the partitions'
commit points whether they moved or not (`OffsetBook.fencing_commits`): their
TxnOffsetCommit is what checks the group generation, so a gateway stalled past its
session (a zombie) aborts whatever step it resumes in. `run` aborts a transaction that
wrote copies and has no offset to send.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import CommitFailedError, IllegalStateError, KafkaError, ProducerFenced

from gateway.kafka.clients import stop_within
from gateway.kafka.transactions import Member, TransactionalProducer

logger = logging.getLogger(__name__)

RENEW_FIRST_WAIT_S = 0.1  # between tries to start a new producer after a fence
RENEW_MAX_WAIT_S = 5.0
ABORT_WITHIN_S = 5.0  # an abort when a step raised (a stop, a cancel)
END_MARGIN_S = 2.0  # past transaction_timeout: the broker's abort and its answer
END_AT_LEAST_S = 60.0  # and never less than this: a broker restarting is not stuck


def end_bound_s(transaction_timeout_s: float) -> float:
    """How long a step's offsets and commit may take before a new producer ends the
    transaction: a bound for an end that never comes, not for a slow broker (a restart
    takes 20 s on a loaded machine; CI's chaos seed 1)."""
    return max(transaction_timeout_s + END_MARGIN_S, END_AT_LEAST_S)


class StepAborted(Exception):
    """A step's transaction aborted: nothing of it is visible, no offset moved."""


async def read_again_from_commits(consumer: AIOKafkaConsumer) -> None:
    """Every assigned partition reads again from its committed offset (from where the
    group starts, `auto_offset_reset`, when it has none). aiokafka's own
    `seek_to_committed` leaves a partition with no commit, or one at 0, where it is."""
    for tp in consumer.assignment():
        committed = await consumer.committed(tp)
        # A rebalance during that await may have taken it (chaos seed 13008: the seek
        # raised IllegalStateError and the gateway exited): its new owner reads it
        # from the commit anyway.
        if tp not in consumer.assignment():
            continue
        try:
            if committed is None:
                await consumer.seek_to_beginning(tp)
            else:
                consumer.seek(tp, committed)
        except IllegalStateError:  # revoked during seek_to_beginning's own await
            continue


@dataclass
class Transactions:
    """A loop's transactional producer (started) and how to build another: a fenced
    producer (the broker aborted its transaction after `transaction_timeout` and bumped
    its epoch) is replaced, and `producer` is the new one."""

    what: str
    producer: TransactionalProducer
    build: Callable[[], TransactionalProducer]
    end_within_s: float  # how long offsets and commit may take (`end_bound_s`)

    async def run(
        self,
        step: Awaitable[dict[TopicPartition, int]],
        consumer: AIOKafkaConsumer,
        member: Member,
    ) -> dict[TopicPartition, int]:
        """`step` (it sends through `producer` and returns the input offsets to commit,
        next offset to read) and those offsets of the partitions still assigned, in
        one transaction, committed as `member` (who the consumer was in its group when
        it fetched the records). Returns the offsets committed; StepAborted when the
        transaction aborted (also when it wrote copies and no offset is left to fence
        them). Any other error aborts it and is raised as it is."""
        producer = self.producer
        try:
            await producer.begin()
        except BaseException:
            if asyncio.iscoroutine(step):
                step.close()
            raise
        try:
            offsets = await step
            assigned = consumer.assignment()
            offsets = {tp: o for tp, o in offsets.items() if tp in assigned}
            if not offsets and producer._txn_manager.txn_partitions:
                # Copies with no offset: no TxnOffsetCommit, so nothing would check the
                # group generation, and a zombie's copies would commit.
                raise CommitFailedError("copies written with no input offset to fence them")
            if offsets and (member[0] < 0 or not member[1]):
                # Fetched outside the group: the coordinator would take a commit without
                # a generation for one with no group metadata at all, and accept it.
                raise CommitFailedError(f"records fetched outside the group ({member})")
            async with asyncio.timeout(self.end_within_s):
                if offsets:
                    await producer.send_group_offsets(offsets, consumer._group_id, member)
                await producer.commit_transaction()
        except TimeoutError as exc:
            # The broker has aborted a transaction open past `transaction_timeout`, or
            # committed it: either way a new producer under the same id settles which
            # (chaos seed 52204: a produce that waited for metadata that never came held
            # the failure loop's commit, and then its stop, for good).
            logger.warning(
                "%s transaction did not end within %.0fs: a new producer under the same "
                "id ends it; reading it again", self.what, self.end_within_s,
            )  # fmt: skip
            await self._renew()
            raise StepAborted("the transaction did not end in time") from exc
        except ProducerFenced as exc:
            # Our epoch is gone (the coordinator aborted the transaction after its
            # timeout, or a restart under our id began): nothing of it commits.
            logger.warning("%s transaction fenced (%s): reading it again", self.what, exc)
            await self._renew()
            raise StepAborted(str(exc)) from exc
        except KafkaError as exc:  # CommitFailedError: the group moved on; a produce failed
            logger.warning("%s transaction aborted (%s): reading it again", self.what, exc)
            if producer._txn_manager.is_fatal_error():
                # A broker away past `transaction_timeout` aborted it and bumped our
                # epoch: this producer can do nothing more, abort included.
                await self._renew()
                raise StepAborted(str(exc)) from exc
            try:
                await producer.abort_after_error()
            except KafkaError as again:
                logger.warning("abort failed (%r): a new transactional producer goes on", again)
                await self._renew()
            raise StepAborted(str(exc)) from exc
        except BaseException as exc:
            txn = producer._txn_manager
            if txn.is_in_transaction() and not txn.is_fatal_error():
                try:  # bounded: the stop that cancelled us must end
                    async with asyncio.timeout(ABORT_WITHIN_S):
                        await asyncio.shield(producer.abort_transaction())
                except (KafkaError, TimeoutError) as again:  # raised instead, it hid `exc`
                    logger.warning("%s abort after %r failed: %r", self.what, exc, again)
            raise
        return offsets

    async def _renew(self) -> None:
        old, wait_s = self.producer, RENEW_FIRST_WAIT_S
        while True:
            new = self.build()
            try:
                await new.start()  # InitProducerId under the same id: a new epoch
                break
            except (KafkaError, AssertionError, OSError) as exc:
                # A broker just back (chaos seed 14004: aiokafka's coordinator lookup
                # asserted "Did we not perform bootstrap?") took the failure loop down.
                logger.warning(
                    "%s: a new transactional producer did not start (%r); trying again "
                    "in %.1fs", self.what, exc, wait_s,
                )  # fmt: skip
                await stop_within(new)
                await asyncio.sleep(wait_s)
                wait_s = min(2 * wait_s, RENEW_MAX_WAIT_S)
        self.producer = new
        logger.warning("%s: a new transactional producer under the same id goes on", self.what)
        await retire(old)

    async def stop(self) -> None:
        """Stop the current producer (at shutdown; it may be one a fence ended)."""
        await retire(self.producer)


async def retire(producer: TransactionalProducer) -> None:
    """Stop `producer` and mark seen the failures a fence left in it: it was handled by
    whoever ran into it, and asyncio logs an unseen one as a traceback. A fence ends
    the sender task, the transaction and every batch not yet sent; such a batch's drain
    waiter is aiokafka's own, awaited by nobody (chaos seed 4: one traceback per
    partition whose batch waited for AddPartitionsToTxn when a broker back from 20 s
    away answered that the epoch was gone)."""
    txn, accumulator = producer._txn_manager, producer._message_accumulator

    def left_behind() -> list[asyncio.Future[Any] | None]:
        batches = [*(b for queued in accumulator._batches.values() for b in queued)]
        batches += accumulator._pending_batches
        return [txn._transaction_waiter, *(fut for _, _, fut in txn._pending_txn_offsets),
                *(b._drain_waiter for b in batches), *(b.future for b in batches)]  # fmt: skip

    def sender_ended(task: asyncio.Future[Any]) -> None:
        # After aiokafka's own callback, which fails the transaction (a new waiter) and
        # every batch with what ended the sender: a stop is bounded, and its sender may
        # end later on a fence (chaos seeds 1, 52204, 52304: a stalled end given up, its
        # offsets then fenced by the new producer).
        _seen(task)
        _watch(*left_behind())

    if producer._sender.sender_task is not None:
        producer._sender.sender_task.add_done_callback(sender_ended)
    _watch(*left_behind())
    await stop_within(producer)
    _watch(*left_behind())


def _watch(*futures: asyncio.Future[Any] | None) -> None:
    """Mark each future's failure seen whenever it comes (at once if it came)."""
    for future in futures:
        if future is not None:
            future.add_done_callback(_seen)


def _seen(done: asyncio.Future[Any]) -> None:
    if not done.cancelled():
        done.exception()
