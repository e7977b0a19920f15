"""The consumer-loop skeleton the raw, delay and failure loops are steps on.

One turn: the step says what to ask for (`Step.ask`: a fetch, `Ask`, optionally a
starved lane's partitions first; or an idle turn, `Idle`, that the loop waits out),
the fetch (ended early at stop), the stale check under the loop's lock (a batch
fetched before a revoke is read again from the commits, and counted), the step takes
the batch under that lock (`Step.take`, an empty one too), then its work outside the
lock (`Step.after`). A fetch that raises on a header name that is not UTF-8 goes
through `Salvage` (gateway/kafka/salvage.py) under the same lock instead, after the
step settled what it holds (`Step.settle`: the salvage reads from the commits). At
stop, or when a turn raises, `Step.drain`.

Every loop completes its steps through a `Completion` (gateway/kafka/completion.py):
a plain commit, or with `[kafka] exactly_once` one transaction per step. A step whose
transaction aborted reads everything again from the commits: `read_again`, the one
abort path of every loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from aiokafka import AIOKafkaConsumer, ConsumerRecord, TopicPartition

from gateway.config import KafkaSettings
from gateway.kafka.clients import unless_stopped
from gateway.kafka.exactly_once import read_again_from_commits
from gateway.kafka.rebalance import Rebalance, RevocationGuard
from gateway.kafka.salvage import Fetched, Salvage
from gateway.kafka.transactions import Member, group_member
from gateway.waits import wait_or_stop

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Ask:
    """A turn's fetch: how long it may wait (ms) and how many records it may bring;
    `first`, partitions asked on their own before it (a starved lane's), for at most
    `first_wait_ms`: the usual fetch follows only when they brought nothing."""

    wait_ms: int
    max_records: int
    first: tuple[TopicPartition, ...] = ()
    first_wait_ms: int = 0


@dataclass(frozen=True)
class Idle:
    """A turn without a fetch: the loop waits `wait_ms` (ended early at stop), then
    asks again. Never 0: a step that skipped its fetch without waiting would spin."""

    wait_ms: int

    def __post_init__(self) -> None:
        if self.wait_ms <= 0:
            raise ValueError(f"an idle turn waits more than 0 ms, not {self.wait_ms}")


class Step(Protocol):
    """What a loop on the skeleton does with its batches."""

    async def ask(self, stop: asyncio.Event) -> Ask | Idle:
        """Before a fetch: what to fetch, or an idle turn."""

    async def take(self, fetched: Fetched) -> set[TopicPartition]:
        """Under the loop's lock: act on a batch (empty when the fetch brought nothing;
        `fetched.salvaged` when read leniently); the partitions that stop where they are
        (paused or rewound: a salvage does not read them on)."""

    async def settle(self) -> None:
        """Under the loop's lock, before a salvage reads from the committed offsets:
        finish and commit what is in hand (nothing, for a step that holds nothing)."""

    async def after(self, stop: asyncio.Event) -> None:
        """Outside the lock, after each turn: commits, waits, reports."""

    async def drain(self) -> None:
        """At stop (or when a turn raised), after the last turn."""


Records = dict[TopicPartition, list[ConsumerRecord[bytes, bytes]]]


class ConsumerLoop:
    """Runs a `Step` on a consumer (module docstring). `position`/`read_on`: the
    step's offset book, for reading past unparseable records from where it stands;
    `reread`: counts the records of a batch left stale by a rebalance."""

    def __init__(
        self,
        consumer: AIOKafkaConsumer,
        kafka: KafkaSettings,
        what: str,
        step: Step,
        position: Callable[[TopicPartition], int | None] = lambda tp: None,
        read_on: Callable[[TopicPartition, int], None] = lambda tp, offset: None,
        reread: Callable[[int], None] = lambda records: None,
    ) -> None:
        self.consumer = consumer
        self.what = what
        self.step = step
        self.reread = reread
        self.lock = asyncio.Lock()  # a step against a rebalance
        self.guard = RevocationGuard()  # a batch fetched before a revoke is stale
        self.salvage = Salvage(consumer, kafka, what, position, read_on)
        self.fetched_as: Member = (-1, "", None)  # who the consumer was at the last fetch

    def listener(
        self,
        partitions: str,
        forget: Callable[[set[TopicPartition]], None],
        assigned: Callable[[], None] | None = None,
    ) -> Rebalance:
        """The rebalance listener: a revoke waits for a step in progress and lets the
        step settle what it holds (`Step.settle`), then `forget`."""
        return Rebalance(partitions, self.lock, self.guard, forget, self.step.settle, assigned)

    async def read_again(self, forget: Callable[[set[TopicPartition]], None]) -> None:
        """A step's transaction aborted: nothing it wrote is visible and no offset moved.
        The step `forget`s what it holds of the assigned partitions, a batch fetched
        before now is stale, and every partition reads again from its commit."""
        forget(self.consumer.assignment())
        self.guard.revoked()
        await read_again_from_commits(self.consumer)

    async def run(self, stop: asyncio.Event) -> None:
        try:
            while not stop.is_set():
                ask = await self.step.ask(stop)
                if isinstance(ask, Idle):
                    await wait_or_stop(stop, ask.wait_ms / 1000)
                    continue
                try:
                    fetched = await unless_stopped(self.fetch(ask), stop)
                except UnicodeDecodeError as exc:  # a header name (gateway/kafka/salvage.py)
                    async with self.lock:
                        await self.step.settle()  # all in hand committed: read from there
                        wait = await self.salvage(exc, ask.max_records, self.step.take)
                    await self.step.after(stop)
                    await wait_or_stop(stop, wait)
                    continue
                if fetched is None:
                    break
                async with self.lock:
                    if self.guard.stale():
                        # A revoke ran between the fetch and the lock: each partition
                        # reads again from its committed offset (aiokafka resets every
                        # position on the assignment that follows), or moved to another
                        # gateway: the batch is left to whoever owns its partitions then.
                        stale = sum(map(len, fetched.values()))
                        self.reread(stale)
                        logger.info(
                            "%d %s records fetched before a rebalance are left to be read "
                            "again", stale, self.what,
                        )  # fmt: skip
                    else:
                        await self.step.take(Fetched(fetched, self.fetched_as))
                await self.step.after(stop)
        finally:
            await self.step.drain()

    async def fetch(self, ask: Ask) -> Records:
        """One fetch as `ask` says."""
        consumer = self.consumer
        batch: Records = {}
        if ask.first:
            batch = await consumer.getmany(
                *ask.first, timeout_ms=ask.first_wait_ms, max_records=ask.max_records
            )
        if not batch:
            batch = await consumer.getmany(timeout_ms=ask.wait_ms, max_records=ask.max_records)
        # Read as getmany returns, no await between: a getmany that waited for a
        # rebalance returns records of the new assignment, which are not stale.
        self.guard.fetched()
        self.fetched_as = group_member(consumer)
        return batch
