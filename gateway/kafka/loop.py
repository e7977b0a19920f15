"""The consumer-loop skeleton the delay and failure loops are steps on; the raw loop
(gateway/raw/source.py) keeps its own pipelined fetch and uses the same salvage and
commits.

One turn: the step says what to ask for (`Step.ask`), the fetch (ended early at
stop), the stale check under the loop's lock (a batch fetched before a revoke is
read again from the commits), the step takes the batch under that lock
(`Step.take`), then its work outside the lock (`Step.after`). A fetch that raises
on a header name that is not UTF-8 goes through `Salvage` (gateway/kafka/salvage.py)
under the same lock instead. At stop, `Step.drain`.

`Commits` is every loop's one commit path: a plain commit, bounded and never
cancelled, or (`[kafka] exactly_once`) the step and its offsets in one transaction
(gateway/kafka/exactly_once.py).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Protocol

from aiokafka import AIOKafkaConsumer, TopicPartition

from gateway.config import KafkaSettings
from gateway.contract.records import source_ref
from gateway.kafka.clients import unless_stopped
from gateway.kafka.exactly_once import Transactions
from gateway.kafka.rebalance import Rebalance, RevocationGuard
from gateway.kafka.salvage import Fetched, Salvage
from gateway.kafka.transactions import Member, group_member
from gateway.waits import wait_or_stop

logger = logging.getLogger(__name__)

COMMIT_TIMEOUT_S = 5.0  # a commit the broker does not answer within it is left under way


class Commits:
    """A loop's input offsets, committed plainly (`commit`) or in its step's
    transaction (`transaction`, with `[kafka] exactly_once`)."""

    def __init__(
        self, consumer: AIOKafkaConsumer, what: str, transactions: Transactions | None = None
    ) -> None:
        self.consumer = consumer
        self.what = what  # "raw", "delay tier", "failure-topic"
        self.transactions = transactions
        self._under_way: asyncio.Future[None] | None = None
        self._left: dict[TopicPartition, int] = {}  # kept back by a commit under way

    async def commit(self, offsets: dict[TopicPartition, int]) -> bool:
        """Commit `offsets` (next offset to read) of the partitions still assigned; True
        once the broker took them. Bounded, but never cancelled: aiokafka retries a
        commit for as long as the broker is away (the loop must go on meanwhile), and
        a cancelled commit leaves its own inner task to fail unobserved. While one is
        under way, the offsets wait for the next call. A partition that moved on is
        left to its new owner, which reads again from the last commit."""
        assigned = self.consumer.assignment()
        offsets = {tp: o for tp, o in {**self._left, **offsets}.items() if tp in assigned}
        self._left = {}
        if not offsets:
            return True
        if self._under_way is not None and not self._under_way.done():
            self._left = offsets
            return False
        where = {source_ref(tp.topic, tp.partition, o): o for tp, o in offsets.items()}
        task = asyncio.ensure_future(self.consumer.commit(offsets))
        self._under_way = task
        done, _ = await asyncio.wait([task], timeout=COMMIT_TIMEOUT_S)
        if not done:
            task.add_done_callback(functools.partial(_commit_done, self.what, where))
            logger.warning(
                "%s commit still under way after %.0fs; the next pass commits again",
                self.what, COMMIT_TIMEOUT_S, extra={"commit": where},
            )  # fmt: skip
            return False
        return _commit_done(self.what, where, task)

    async def transaction(
        self, step: Awaitable[dict[TopicPartition, int]], member: Member
    ) -> dict[TopicPartition, int]:
        """`step` and the offsets it returns in one transaction (`Transactions.run`)."""
        assert self.transactions is not None
        return await self.transactions.run(step, self.consumer, member)


def _commit_done(what: str, where: dict[str, int], task: asyncio.Future[None]) -> bool:
    """Log a failed commit (its exception retrieved, never left unobserved); True when
    it succeeded."""
    if task.cancelled():
        return False
    if (exc := task.exception()) is None:
        return True
    # Revoked meanwhile (CommitFailedError, IllegalStateError), or a broker error: the
    # next pass commits again, or the new owner reads again from the last commit.
    logger.warning(
        "%s commit failed, left for the next pass: %r", what, exc, extra={"commit": where}
    )
    return False


class Step(Protocol):
    """What a loop on the skeleton does with its batches."""

    async def ask(self, stop: asyncio.Event) -> tuple[int, int] | None:
        """Before a fetch: how long it may wait (ms) and how many records it may bring;
        None to skip this turn's fetch."""

    async def take(self, fetched: Fetched) -> set[TopicPartition]:
        """Under the loop's lock: act on a batch; the partitions that stop where they are
        (paused or rewound: a salvage does not read them on)."""

    async def after(self, stop: asyncio.Event) -> None:
        """Outside the lock, after each turn: commits, waits, reports."""

    async def drain(self) -> None:
        """At stop, after the last turn."""


class ConsumerLoop:
    """Runs a `Step` on a consumer (module docstring). `position`/`read_on`: the
    step's offset book, for reading past unparseable records from where it stands."""

    def __init__(
        self,
        consumer: AIOKafkaConsumer,
        kafka: KafkaSettings,
        what: str,
        step: Step,
        position: Callable[[TopicPartition], int | None] = lambda tp: None,
        read_on: Callable[[TopicPartition, int], None] = lambda tp, offset: None,
    ) -> None:
        self.consumer = consumer
        self.what = what
        self.step = step
        self.lock = asyncio.Lock()  # a step against a rebalance
        self.guard = RevocationGuard()  # a batch fetched before a revoke is stale
        self.salvage = Salvage(consumer, kafka, what, position, read_on)

    def listener(self, partitions: str, forget: Callable[[set[TopicPartition]], None]) -> Rebalance:
        """The rebalance listener: a revoke waits for a step in progress, then `forget`."""
        return Rebalance(partitions, self.lock, self.guard, forget)

    async def run(self, stop: asyncio.Event) -> None:
        consumer = self.consumer
        while not stop.is_set():
            if (ask := await self.step.ask(stop)) is None:
                continue
            wait_ms, max_records = ask
            try:
                fetched = await unless_stopped(
                    consumer.getmany(timeout_ms=wait_ms, max_records=max_records), stop
                )
            except UnicodeDecodeError as exc:  # a header name (gateway/kafka/salvage.py)
                async with self.lock:
                    wait = await self.salvage(exc, max_records, self.step.take)
                await self.step.after(stop)
                await wait_or_stop(stop, wait)
                continue
            if fetched is None:
                break
            self.guard.fetched()
            member = group_member(consumer)
            async with self.lock:
                if self.guard.stale():
                    # A revoke ran between the fetch and the lock: each partition reads
                    # again from its committed offset (or moved to another gateway).
                    logger.info("%s records fetched before a rebalance are left to be read "
                                "again", self.what)  # fmt: skip
                else:
                    await self.step.take(Fetched(fetched, member))
            await self.step.after(stop)
        await self.step.drain()
