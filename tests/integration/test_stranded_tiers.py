"""`[delay]` switched off while records wait in a tier of a clean topic that was renamed
(gateway/delay/leftovers.py, `refuse_stranded_tiers`; check-config --connect)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient

from devtools.harness import (
    make_settings,
    produce,
    redis_urls,
    running,
    until,
)
from devtools.topics import create_topics, read_topic, wait_committed
from gateway.delay.leftovers import refuse_stranded_tiers
from gateway.errors import ConfigError
from gateway.ops.check_kafka import _leftover_findings
from gateway.ops.findings import Severity
from gateway.rules.tiers import tier_topics
from tests.integration.conftest import StackFactory


async def test_a_renamed_clean_topic_with_delay_off_is_refused_while_its_tier_holds_records(
    broker: str, stack: StackFactory, names: Callable[[str], str]
) -> None:
    """A record waits in a tier of the old clean topic (the delay group read that tier);
    the clean topic is renamed and `[delay]` switched off: nothing would ever deliver it
    and its id stays claimed. Start-up is refused and check-config warns, naming it."""
    s = await stack(members=0, raw_partitions=1, clean_partitions=1, delay={"enabled": False})
    topics, settings = s.topics, s.settings
    old_tier = f"{names('clean-old')}.delay.16s"
    await create_topics(broker, {old_tier: 1})
    producer = AIOKafkaProducer(bootstrap_servers=broker)
    await producer.start()
    try:
        for n in range(2):
            await producer.send_and_wait(old_tier, b"v", partition=0,
                                         headers=[("message-id", f"w-{n}".encode())])  # fmt: skip
    finally:
        await producer.stop()
    consumer = AIOKafkaConsumer(
        bootstrap_servers=broker, group_id=f"{topics.group}.delay", enable_auto_commit=False
    )
    await consumer.start()
    try:  # the delay loop moved the first record on, not the second
        consumer.assign([TopicPartition(old_tier, 0)])
        await consumer.commit({TopicPartition(old_tier, 0): 1})
    finally:
        await consumer.stop()

    with pytest.raises(ConfigError, match=f"tier topic\\(s\\) {old_tier} \\("):
        await refuse_stranded_tiers(settings)
    admin = AIOKafkaAdminClient(bootstrap_servers=broker)
    await admin.start()
    try:
        found = await _leftover_findings(admin, settings)
    finally:
        await admin.close()
    assert [(f.severity, f.where) for f in found] == [(Severity.WARN, f"topic {old_tier}")]
    assert "[delay] is off" in found[0].message


async def test_a_tier_drained_under_exactly_once_holds_nothing_and_delay_may_go_off(
    broker: str, stack: StackFactory
) -> None:
    """With `exactly_once` every tier write ends in a transaction's commit marker, an
    offset of its own after the last record: a drained tier's end offset is one past
    the delay group's commit. Only data records count as waiting: the backlog metric
    comes back to 0 and start-up with `[delay]` off is accepted."""
    s = await stack(
        raw_partitions=1, clean_partitions=1, tier_partitions=1,
        kafka={"exactly_once": "on"}, delay={"enabled": True, "tiers": ["1s"]},
    )  # fmt: skip
    topics, nodes, settings = s.topics, redis_urls(s.servers), s.settings
    (tier,) = tier_topics(settings)
    async with running(settings) as gateway:
        await until(gateway, lambda: bool(gateway.partitions()), timeout_s=60)
        await produce(broker, topics.raw, [
            (None, b"v", [("message-id", b"d-1"), ("deliver-after", b"2s")])
        ])  # fmt: skip
        await read_topic(broker, topics.clean, min_records=1, timeout_s=60)
        await wait_committed(broker, f"{topics.group}.delay", tier, {0: 1})
        backlog = gateway.metrics.delay_backlog.labels("1s")
        await until(gateway, lambda: backlog._value.get() == 0, timeout_s=10)
        await asyncio.sleep(2.5)  # two reports later: still 0
        assert backlog._value.get() == 0
    off = make_settings(broker, topics, nodes, kafka={"exactly_once": "on"},
                        delay={"enabled": False, "tiers": ["1s"]})  # fmt: skip
    await refuse_stranded_tiers(off)  # the tier is drained: not refused
