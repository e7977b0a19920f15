"""The skeleton the gateway's consumer loops share: raw, delay tiers, failure commands.

- `PartitionOffsets` / `OffsetBook`: per assigned partition, the offsets taken and
  not yet acknowledged downstream, and the commit point that follows from them
  (the first one still in flight, else the next to read). Offsets are committed
  only for partitions still assigned, and only once acknowledged.
- `RevocationGuard`: counts revoke callbacks, so a batch fetched before one (its
  partitions may have been revoked and assigned again: the positions were reset
  to the commits) is recognised as stale and left to be read again.
- `Rebalance`: the rebalance listener: under the loop's lock, its own work for
  the revoked partitions, then forget them and count the revoke.
- `fetch_past_bad_headers`: a record whose header name is not UTF-8 makes
  aiokafka's `getmany` raise, every time (gateway/kafka/salvage.py): the
  partitions are read leniently from where the loop stands instead.
- `DueQueue`: the items waiting for their time, earliest first.
- and `gateway.waits.wait_or_stop`: a sleep that ends early when the loop stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener, TopicPartition
from aiokafka.client import AIOKafkaClient
from aiokafka.errors import CommitFailedError, IllegalStateError, KafkaError

from gateway.config import KafkaSettings
from gateway.kafka.clients import aiokafka_options
from gateway.kafka.salvage import Salvaged, read_leniently

logger = logging.getLogger(__name__)

T = TypeVar("T")
P = TypeVar("P", bound="PartitionOffsets")


@dataclass(slots=True)
class PartitionOffsets:
    """One assigned partition's offsets, from the loop's side.

    Replaced when the partition is revoked: work started before then still points
    at the old object, which is how it knows the partition is no longer its own.
    """

    taken: deque[int] = field(default_factory=deque)  # in flight, in offset order
    moved: set[int] = field(default_factory=set)  # acknowledged, behind one still in flight
    next_offset: int | None = None  # first offset not taken
    committed: int | None = None

    def take(self, offset: int) -> None:
        self.taken.append(offset)

    def commit_point(self) -> int | None:
        """The first offset not yet acknowledged downstream (what may be committed)."""
        while self.taken and self.taken[0] in self.moved:
            self.moved.discard(self.taken.popleft())
        return self.taken[0] if self.taken else self.next_offset


class OffsetBook(Generic[P]):
    """The loop's `PartitionOffsets` of each partition it took anything from."""

    def __init__(self, new: Callable[[], P]) -> None:
        self._new = new
        self.parts: dict[TopicPartition, P] = {}

    def of(self, tp: TopicPartition) -> P:
        part = self.parts.get(tp)
        if part is None:
            part = self.parts[tp] = self._new()
        return part

    def position(self, tp: TopicPartition) -> int | None:
        """Where the loop stands in `tp`: its next offset to take; None: nothing taken."""
        part = self.parts.get(tp)
        return part.next_offset if part is not None else None

    def owns(self, consumer: AIOKafkaConsumer, tp: TopicPartition, part: P) -> bool:
        """Whether `part` is still the loop's state of `tp`, which is still assigned."""
        return self.parts.get(tp) is part and tp in consumer.assignment()

    def forget(self, partitions: set[TopicPartition]) -> None:
        for tp in partitions:
            self.parts.pop(tp, None)

    def due_commits(self, consumer: AIOKafkaConsumer) -> dict[TopicPartition, int]:
        """Commit points of the assigned partitions that moved since their last commit."""
        assigned = consumer.assignment()
        offsets = {}
        for tp, part in self.parts.items():
            point = part.commit_point()
            if tp in assigned and point is not None and point != part.committed:
                offsets[tp] = point
        return offsets

    def committed(self, offsets: dict[TopicPartition, int]) -> None:
        for tp, point in offsets.items():
            if (part := self.parts.get(tp)) is not None:
                part.committed = point

    async def commit(self, consumer: AIOKafkaConsumer, what: str) -> None:
        """Commit what is acknowledged; a partition that moved on meanwhile is left to
        its new owner, which reads again from the last commit."""
        offsets = self.due_commits(consumer)
        if not offsets:
            return
        try:
            await consumer.commit(offsets)
        except (CommitFailedError, IllegalStateError) as exc:
            logger.warning("%s commit failed after a rebalance: %s", what, exc)
            return
        self.committed(offsets)


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
        lock: asyncio.Lock | None,
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
        async with self.lock or contextlib.nullcontext():
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


async def fetch_past_bad_headers(
    consumer: AIOKafkaConsumer,
    kafka: KafkaSettings,
    max_records: int,
    position: Callable[[TopicPartition], int | None] = lambda tp: None,
) -> dict[TopicPartition, Salvaged] | None:
    """Read the assigned, unpaused partitions leniently after `getmany` raised
    UnicodeDecodeError; None when the broker could not be read (try again later).

    The failed `getmany` may have moved partitions past records it never returned,
    so each one is rewound first: to `position(tp)` (where the loop stands), else
    to its committed offset, else to its beginning. The caller handles what is
    found (`Salvaged.records` in order, `Salvaged.bad` set aside) and seeks a
    partition with bad records to its `next_offset`: aiokafka cannot read the
    rest of that batch.
    """
    assigned = consumer.assignment()
    for tp in assigned:
        at = position(tp)
        if at is None:
            at = await consumer.committed(tp)
        if at is None:
            await consumer.seek_to_beginning(tp)
        else:
            consumer.seek(tp, at)
    client = AIOKafkaClient(**aiokafka_options(kafka))
    try:
        await client.bootstrap()
        return {
            tp: await read_leniently(client, tp, await consumer.position(tp), max_records)
            for tp in sorted(assigned - consumer.paused())
        }
    except (KafkaError, OSError, TimeoutError) as exc:  # e.g. a leader election
        logger.warning("reading past a record that cannot be parsed failed (%r): trying again", exc)
        return None
    finally:
        await client.close()


class DueQueue(Generic[T]):
    """Items waiting for their time (any clock the caller keeps), earliest first;
    items due at the same time in the order they were pushed."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, T]] = []
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[T]:
        return (item for _, _, item in self._heap)

    def push(self, at: float, item: T) -> None:
        heapq.heappush(self._heap, (at, next(self._seq), item))

    def next_at(self) -> float | None:
        return self._heap[0][0] if self._heap else None

    def pop_due(self, now: float) -> T | None:
        """The earliest item when its time is `now` or earlier, else None."""
        if self._heap and self._heap[0][0] <= now:
            return heapq.heappop(self._heap)[2]
        return None

    def drop(self, gone: Callable[[T], bool]) -> list[T]:
        """Remove the items `gone` says are; returns them."""
        kept = [entry for entry in self._heap if not gone(entry[2])]
        dropped = [entry[2] for entry in self._heap if gone(entry[2])]
        heapq.heapify(kept)
        self._heap = kept
        return dropped
