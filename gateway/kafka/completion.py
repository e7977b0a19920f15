"""How a loop's step completes: what it wrote acknowledged, then its input offsets
committed (`PlainCompletion`), or both in one Kafka transaction
(`TransactionalCompletion`, `[kafka] exactly_once`; gateway/kafka/exactly_once.py).

Which of the two each loop holds is decided once, in the composition root
(gateway/service/app.py, through `completions`); the raw, delay and failure loops
hold a `Completion` and never ask which. A step completed in a transaction that aborts
raises `StepAborted` (counted, `dedup_gateway_transactions_aborted_total{loop}`); the
loop then reads its partitions again from their commits (`ConsumerLoop.read_again`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import uuid
from collections.abc import Awaitable
from typing import Any, Protocol

from aiokafka import AIOKafkaConsumer, TopicPartition
from prometheus_client import Counter

from gateway.config import KafkaSettings
from gateway.kafka.clients import build_transactional_producer
from gateway.kafka.commits import Commits
from gateway.kafka.exactly_once import StepAborted, Transactions, end_bound_s
from gateway.kafka.offsets import OffsetBook
from gateway.kafka.sink import Sink
from gateway.kafka.transactions import Member
from gateway.metrics import Metrics

logger = logging.getLogger(__name__)

Offsets = dict[TopicPartition, int]

# How each loop names its input in a commit's log line.
COMMIT_NAMES = {"raw": "raw", "delay": "delay tier", "failures": "failure-topic"}
# A transaction's share of a loop's work: well inside `transaction_timeout`, after which
# the broker aborts it (400 retries in one took longer, and every one was aborted and
# redone).
MAX_STEP_S = 1.0


class Completion(Protocol):
    """What a loop's steps write through, and how a step completes."""

    sink: Sink  # the copies a step sends
    # Whether a copy is out for good once the broker acknowledged it (plain), or only
    # once the step's transaction commits: what a loop notes as done, and when.
    out_on_ack: bool
    step_s: float  # how long a step that may do many things should run at most

    def step_offsets(self, book: OffsetBook[Any], consumer: AIOKafkaConsumer) -> Offsets:
        """The offsets a step returns, to be committed with it."""

    async def complete(self, step: Awaitable[Offsets], member: Member) -> Offsets | None:
        """Run `step` (it sends through `sink` and returns its input offsets, next offset
        to read), then commit them as `member` (who the consumer was in its group when
        it fetched the records); the offsets committed, or None when a plain commit is
        left for the next pass. StepAborted: nothing of the step is visible."""

    async def commit(self, offsets: Offsets) -> bool:
        """A plain commit of offsets no copy goes with (`Commits.commit`)."""


class _PlainCommits:
    """What both completions share: offsets no copy goes with, committed plainly."""

    commits: Commits

    async def commit(self, offsets: Offsets) -> bool:
        return await self.commits.commit(offsets)


class PlainCompletion(_PlainCommits):
    """At-least-once: the step's copies go through the shared sink; its offsets are
    committed once they are acknowledged (bounded, never cancelled: `Commits`)."""

    out_on_ack = True
    step_s = MAX_STEP_S

    def __init__(self, consumer: AIOKafkaConsumer, loop: str, sink: Sink) -> None:
        self.commits = Commits(consumer, COMMIT_NAMES[loop])
        self.sink = sink

    def step_offsets(self, book: OffsetBook[Any], consumer: AIOKafkaConsumer) -> Offsets:
        """The points that moved since their last commit."""
        return book.due_commits(consumer)

    async def complete(self, step: Awaitable[Offsets], member: Member) -> Offsets | None:
        offsets = await step
        return offsets if await self.commits.commit(offsets) else None


class TransactionalCompletion(_PlainCommits):
    """Exactly-once: the step's copies and its offsets in one transaction of the loop's
    own transactional producer (`Transactions.run`); `sink` writes through it, the new
    one when a fenced producer was replaced."""

    out_on_ack = False

    def __init__(
        self,
        consumer: AIOKafkaConsumer,
        loop: str,
        transactions: Transactions,
        kafka: KafkaSettings,
        metrics: Metrics,
    ) -> None:
        self.consumer = consumer
        self.transactions = transactions
        self.commits = Commits(consumer, COMMIT_NAMES[loop])
        self.sink = Sink(transactions.producer, kafka, metrics)
        self.aborted: Counter = metrics.transactions_aborted.labels(loop)
        self.step_s = min(MAX_STEP_S, kafka.transaction_timeout.total_seconds() / 5)

    def step_offsets(self, book: OffsetBook[Any], consumer: AIOKafkaConsumer) -> Offsets:
        """Every partition's point, moved or not: its TxnOffsetCommit is what checks the
        group generation (`OffsetBook.fencing_commits`)."""
        return book.fencing_commits(consumer)

    async def complete(self, step: Awaitable[Offsets], member: Member) -> Offsets | None:
        try:
            return await self.transactions.run(step, self.consumer, member)
        except StepAborted:
            self.aborted.inc()
            raise
        finally:
            self.sink.producer = self.transactions.producer  # renewed after a fence


class Completions(Protocol):
    """Builds each loop's `Completion`, the same kind for every loop of a gateway."""

    async def for_loop(
        self, loop: str, consumer: AIOKafkaConsumer, writes: bool = True
    ) -> Completion:
        """`loop`'s completion on `consumer`; `writes`: its steps send copies."""


class PlainCompletions:
    """Every loop completes plainly, sending through the one shared sink."""

    def __init__(self, sink: Sink) -> None:
        self.sink = sink

    async def for_loop(
        self, loop: str, consumer: AIOKafkaConsumer, writes: bool = True
    ) -> Completion:
        return PlainCompletion(consumer, loop, self.sink)


class TransactionalCompletions:
    """Every loop that writes copies completes in transactions of a producer of its
    own (started here, stopped with `stack`), its id stable with `group_instance_id`,
    so a restart aborts what the killed process left open; else it is this process's."""

    def __init__(
        self,
        kafka: KafkaSettings,
        metrics: Metrics,
        stack: contextlib.AsyncExitStack,
        plain: PlainCompletions,
    ) -> None:
        self.kafka = kafka
        self.metrics = metrics
        self.stack = stack
        self.plain = plain  # for a loop that writes nothing (release commands)

    async def for_loop(
        self, loop: str, consumer: AIOKafkaConsumer, writes: bool = True
    ) -> Completion:
        if not writes:
            return await self.plain.for_loop(loop, consumer)
        txn_id = transactional_id(self.kafka, loop)
        logger.info("exactly-once output: transactional id %s", txn_id)
        build = functools.partial(build_transactional_producer, self.kafka, txn_id)
        producer = build()
        await producer.start()  # InitProducerId: aborts what an earlier holder of the id left
        end_within_s = end_bound_s(self.kafka.transaction_timeout.total_seconds())
        transactions = Transactions(loop, producer, build, end_within_s)
        self.stack.push_async_callback(transactions.stop)
        return TransactionalCompletion(consumer, loop, transactions, self.kafka, self.metrics)


def transactional_id(kafka: KafkaSettings, loop: str = "raw") -> str:
    """`<group_id>.<loop>.<group_instance_id>`, or a name of this process's own."""
    return f"{kafka.group_id}.{loop}.{kafka.group_instance_id or uuid.uuid4().hex}"
