"""Blocked partitions and the one backoff rule of the gateway.

A raw partition whose head record no majority decided (policy `block`) is
rewound to that record and paused; it is resumed after a backoff that
doubles per consecutive block, with jitter so that gateways blocked by the
same outage do not retry in lockstep. The failure loop uses the same rule
for its retries (`backoff_delay`).
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Iterable
from dataclasses import dataclass

from aiokafka import AIOKafkaConsumer, TopicPartition

from gateway.metrics import Metrics

logger = logging.getLogger(__name__)


def backoff_delay(initial_s: float, maximum_s: float, attempt: int, jitter: float = 0.2) -> float:
    """Delay before try `attempt` (1-based): initial * 2^(attempt-1), capped at maximum,
    then spread by +-`jitter` (a share of the delay), never above maximum."""
    base = min(initial_s * 2 ** max(attempt - 1, 0), maximum_s)
    return float(min(base * (1 + random.uniform(-jitter, jitter)), maximum_s))


@dataclass
class _Block:
    attempt: int
    resume_at: float


class BlockedPartitions:
    """Partitions paused at an undecided record, each with its own backoff."""

    def __init__(self, initial_s: float, maximum_s: float, metrics: Metrics) -> None:
        self.initial_s = initial_s
        self.maximum_s = maximum_s
        self.metrics = metrics
        self._blocks: dict[TopicPartition, _Block] = {}

    def __len__(self) -> int:
        return len(self._blocks)

    def update(
        self,
        consumer: AIOKafkaConsumer,
        blocked_at: dict[TopicPartition, int],
        fetched: Iterable[TopicPartition],
    ) -> None:
        """Rewind and pause partitions blocked at an offset; lift blocks that have cleared."""
        now = time.monotonic()
        for tp in fetched:
            if tp in blocked_at:
                consumer.seek(tp, blocked_at[tp])
                consumer.pause(tp)
                previous = self._blocks.get(tp)
                attempt = 1 if previous is None else previous.attempt + 1
                delay = backoff_delay(self.initial_s, self.maximum_s, attempt)
                self._blocks[tp] = _Block(attempt, now + delay)
                logger.warning(
                    "partition %s blocked at offset %d: no majority decided; retry in %.2fs",
                    tp, blocked_at[tp], delay,
                    extra={"topic": tp.topic, "partition": tp.partition, "offset": blocked_at[tp]},
                )  # fmt: skip
            elif self._blocks.pop(tp, None) is not None:
                logger.info("partition %s unblocked", tp)
        self.metrics.partitions_blocked.set(len(self._blocks))

    def resume_due(self, consumer: AIOKafkaConsumer) -> None:
        """Resume the blocked partitions whose backoff has passed (they stay blocked
        until their next batch decides)."""
        now = time.monotonic()
        assigned = consumer.assignment()
        due = [tp for tp, b in self._blocks.items() if b.resume_at <= now and tp in assigned]
        if due:
            consumer.resume(*due)

    def holding(self, tp: TopicPartition, now: float) -> bool:
        """Whether `tp` is blocked and its backoff has not ended (it must stay paused)."""
        block = self._blocks.get(tp)
        return block is not None and block.resume_at > now

    def forget(self, partitions: Iterable[TopicPartition]) -> None:
        for tp in partitions:
            self._blocks.pop(tp, None)
        self.metrics.partitions_blocked.set(len(self._blocks))
