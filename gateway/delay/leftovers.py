"""Tier topics the configuration no longer names, still read until they are empty.

A record waiting in a tier topic has its id claimed: if no gateway read that
topic again, a resend would be a duplicate and the record lost. So the delay
loop also reads, besides `[delay] tiers`, every existing topic that follows the
tier naming rule `<clean_topic>.delay.<tier>` and is left over:

- of the configured `clean_topic` but a tier `[delay] tiers` no longer lists
  (a tier removed, or its delay changed);
- of another clean topic, when the delay group (`<group_id>.delay`) has committed
  offsets on one of that clean topic's tiers: the tiers of a `clean_topic` that
  was renamed (all of them: a tier that never had a record moved on has none).

A left-over tier's records take their step by the delay of the tier they
entered (its name says it), then move on through the configured tiers like any
other, so they are delivered when due; records of a renamed clean topic go to
the clean topic configured now (the delay loop has one clean topic). Found at
start-up: a configuration change takes a restart anyway.

With `[delay]` switched off no gateway reads a tier topic, so start-up is refused
while one of the clean topic's tiers, or of a clean topic the delay group read (one
renamed meanwhile), holds records the delay group has not moved on
(`refuse_stranded_tiers`), naming it: keep `[delay]` on until they are
delivered, or delete the topic to give them up.
"""

from __future__ import annotations

import asyncio
import re
from collections import defaultdict
from collections.abc import Iterable

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import KafkaError

from gateway.config import Settings, parse_duration
from gateway.errors import ConfigError
from gateway.kafka.clients import build_consumer, partitions_of, stop_within
from gateway.kafka.count import count_records
from gateway.rules.tiers import millis, tier_label, tier_topics

_TIER_TOPIC = re.compile(r"(?P<clean>.+)\.delay\.(?P<label>[0-9]+(?:ms|s|m|h|d))")


def tier_of(topic: str) -> tuple[str, int] | None:
    """(clean topic, tier delay in ms) of a topic named like a tier; None otherwise.
    Only the canonical spelling counts (`tier_label`): `60s` is not a tier, `1m` is."""
    found = _TIER_TOPIC.fullmatch(topic)
    if found is None:
        return None
    ms = millis(parse_duration(found["label"]))
    if ms <= 0 or tier_label(parse_duration(found["label"])) != found["label"]:
        return None
    return found["clean"], ms


def unnamed_tiers(settings: Settings, topics: Iterable[str]) -> dict[str, int]:
    """Of `topics`, those named like a tier of the configured clean topic that `[delay]
    tiers` does not list: topic -> its delay in ms."""
    configured = set(tier_topics(settings))
    out = {}
    for topic in topics:
        if topic not in configured and (tier := tier_of(topic)) is not None:
            clean, ms = tier
            if clean == settings.kafka.clean_topic:
                out[topic] = ms
    return out


async def leftover_tiers(
    consumer: AIOKafkaConsumer, settings: Settings, topics: Iterable[str]
) -> dict[str, int]:
    """The left-over tier topics among `topics` (module docstring): topic -> delay in ms.
    `consumer` is in the delay group, not yet subscribed (it asks for committed offsets)."""
    topics = set(topics)
    found = unnamed_tiers(settings, topics)
    configured = set(tier_topics(settings))
    by_clean: dict[str, dict[str, int]] = defaultdict(dict)
    for topic in sorted(topics - configured - set(found)):
        if (tier := tier_of(topic)) is not None:
            by_clean[tier[0]][topic] = tier[1]
    candidates = [(clean, topic) for clean, tiers in by_clean.items() for topic in tiers]
    # Side by side: a shared broker may hold many deployments' tiers.
    read = await asyncio.gather(*(_committed_on(consumer, topic) for _, topic in candidates))
    for clean in {clean for (clean, _), yes in zip(candidates, read, strict=True) if yes}:
        found.update(by_clean[clean])  # a clean topic's tiers are one set: all of them
    return found


def read_clean_topics(settings: Settings, committed: Iterable[str]) -> set[str]:
    """The other clean topics whose tiers the delay group read: of the topics it has
    committed offsets on (`committed`), those named like a tier, by their clean topic."""
    configured = set(tier_topics(settings))
    return {
        tier[0]
        for topic in committed
        if topic not in configured and (tier := tier_of(topic)) is not None
    }


async def _committed_on(consumer: AIOKafkaConsumer, topic: str) -> bool:
    partitions = [TopicPartition(topic, p) for p in await partitions_of(consumer, topic)]
    committed = await asyncio.gather(*(consumer.committed(tp) for tp in partitions))
    return any(offset is not None for offset in committed)


async def refuse_stranded_tiers(settings: Settings) -> None:
    """`[delay]` off: ConfigError naming every tier topic of the clean topic (or of one
    the delay group read: a renamed clean topic's) that holds records the delay group
    has not moved on (module docstring)."""
    kafka = settings.kafka
    consumer = build_consumer(kafka, f"{kafka.group_id}.delay")
    await consumer.start()
    try:
        named = {t: tier for t in await consumer.topics() if (tier := tier_of(t))}
        own = [t for t, tier in named.items() if tier[0] == kafka.clean_topic]
        # A renamed clean topic's tiers: those of a clean topic the delay group read.
        others = sorted(t for t in named if t not in own)
        read = await asyncio.gather(*(_committed_on(consumer, t) for t in others))
        cleans = {named[t][0] for t, yes in zip(others, read, strict=True) if yes}
        tiers = sorted([*own, *(t for t in others if named[t][0] in cleans)])
        waiting = await _not_moved_on(consumer, tiers)
    finally:
        await stop_within(consumer)
    stranded = [f"{topic} ({n} records)" for topic, n in zip(tiers, waiting, strict=True) if n]
    if stranded:
        raise ConfigError(
            f"delay.enabled: [delay] is off but tier topic(s) {', '.join(stranded)} hold records "
            "waiting to be delivered, whose ids stay claimed; keep [delay] on until they are "
            "delivered (dedup_delay_backlog_records 0), or delete the topics to give them up "
            "(docs/operations.md, Changing the configuration safely)"
        )


async def _not_moved_on(consumer: AIOKafkaConsumer, topics: list[str]) -> list[int]:
    """Data records of each topic after the delay group's committed offsets, read
    (`count_records`): with `exactly_once` a drained tier's end offset is one past
    the commit, its transaction's commit marker."""
    partitions = [
        TopicPartition(topic, p) for topic in topics for p in await partitions_of(consumer, topic)
    ]
    if not partitions:
        return [0 for _ in topics]
    begins = await consumer.beginning_offsets(partitions)
    ends = await consumer.end_offsets(partitions)  # read_committed: the last stable offsets
    # No right to read the delay group's offsets (a deployment that never used [delay]):
    # every record counts as waiting.
    committed = await asyncio.gather(*(_committed(consumer, tp) for tp in partitions))
    spans = {
        tp: (start, ends[tp])
        for tp, done in zip(partitions, committed, strict=True)
        if (start := max(done or 0, begins[tp])) < ends[tp]
    }
    counted = await count_records(consumer, spans) if spans else {}
    return [sum(n for tp, n in counted.items() if tp.topic == topic) for topic in topics]


async def _committed(consumer: AIOKafkaConsumer, tp: TopicPartition) -> int | None:
    try:
        offset: int | None = await consumer.committed(tp)
    except KafkaError:
        return None
    return offset
