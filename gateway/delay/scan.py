"""`inspect`'s look into the delay tiers: is a record with this id waiting, and where."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from aiokafka import AIOKafkaConsumer, TopicPartition

from gateway.config import ConfigError, Settings
from gateway.contract.records import (
    H_DELIVER_AT,
    H_ID,
    H_SOURCE,
    H_TIER_AT,
    Record,
)
from gateway.delay.leftovers import leftover_tiers
from gateway.kafka.clients import build_consumer, partitions_of
from gateway.progress import Progress
from gateway.rules.tiers import (
    Tiers,
    epoch_ms_header,
    next_step_ms,
)

SCAN_LIMIT = 1_000_000  # `inspect`: most tier records read looking for an id


SCAN_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Waiting:
    """One tier copy of an id that has not been moved on (what `inspect` shows)."""

    topic: str
    partition: int
    offset: int
    tier: str
    due_ms: int
    tier_at_ms: int
    step_ms: int
    source: str  # the raw record's coordinates (dedup-source)


@dataclass
class Scan:
    waiting: list[Waiting]
    scanned: int  # tier records read
    complete: bool  # False: stopped at SCAN_LIMIT or SCAN_TIMEOUT_S


async def find_waiting(
    settings: Settings, message_id: bytes, progress: Progress | None = None
) -> Scan:
    """The uncommitted tier records of `message_id`: a read of every tier partition from
    the delay group's commit to its high watermark (what waits), bounded by SCAN_LIMIT;
    `progress` counts the records read."""
    kafka = settings.kafka
    tiers = Tiers(settings)
    # Names the group to read its commits; only assigns, so it never joins it.
    consumer = build_consumer(kafka, f"{kafka.group_id}.delay")
    scan = Scan([], 0, True)
    try:
        await consumer.start()  # in the try: a start that fails is closed too
        # Left-over tiers too (gateway/delay/leftovers.py): the delay loop drains them.
        leftover = await leftover_tiers(consumer, settings, await consumer.topics())
        tier_of_topic = {t: (tiers.labels[i], tiers.ms[i]) for t, i in tiers.by_topic.items()}
        tier_of_topic |= {topic: (topic, ms) for topic, ms in leftover.items()}
        tps = []
        for topic in tier_of_topic:
            try:
                tps += [TopicPartition(topic, p) for p in await partitions_of(consumer, topic)]
            except TimeoutError as exc:
                raise ConfigError(f"delay.tiers: {exc}") from None
        consumer.assign(tps)
        for tp in tps:
            committed = await consumer.committed(tp)
            if committed is not None:
                consumer.seek(tp, committed)
        deadline = time.monotonic() + SCAN_TIMEOUT_S
        while True:
            batch = await consumer.getmany(timeout_ms=200)
            for tp, records in batch.items():
                scan.scanned += len(records)
                if progress is not None:
                    progress.advance(len(records))
                label, tier_ms = tier_of_topic[tp.topic]
                scan.waiting.extend(
                    _waiting(rec, label, tier_ms)
                    for rec in records
                    if dict(rec.headers).get(H_ID) == message_id
                )
            if await _all_read(consumer, tps):
                return scan
            if scan.scanned >= SCAN_LIMIT or time.monotonic() > deadline:
                scan.complete = False
                return scan
    finally:
        await consumer.stop()


def _waiting(rec: Record, tier: str, tier_ms: int) -> Waiting:
    """What `inspect` shows of a tier copy (an unreadable time shows as 0)."""
    times = []
    for name in (H_DELIVER_AT, H_TIER_AT):
        try:
            times.append(epoch_ms_header(rec.headers, name))
        except ValueError:
            times.append(0)
    due, tier_at = times
    source = dict(rec.headers).get(H_SOURCE) or b""
    return Waiting(
        rec.topic, rec.partition, rec.offset, tier, due, tier_at,
        next_step_ms(tier_at, tier_ms, due), source.decode("utf-8", "replace"),
    )  # fmt: skip


async def _all_read(consumer: AIOKafkaConsumer, tps: Sequence[TopicPartition]) -> bool:
    """Every partition read up to its fetch-response high watermark (never ListOffsets)."""
    for tp in tps:
        high = consumer.highwater(tp)
        if high is None or await consumer.position(tp) < high:
            return False
    return True
