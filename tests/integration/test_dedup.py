"""Exact dedup through real Redis instances and a real broker."""

from __future__ import annotations

import pytest

from devtools.harness import ids_of, running
from devtools.topics import read_topic, wait_committed
from devtools.traffic import produce_traffic


@pytest.mark.parametrize("instances", [1, 3, 5])
async def test_each_id_forwarded_exactly_once_with_30pct_duplicates_across_partitions(
    stack, instances
):
    s = await stack(members=instances)
    broker, topics, settings = s.broker, s.topics, s.settings
    traffic = await produce_traffic(broker, topics.raw, 6000, duplicate_share=0.3)
    assert traffic.duplicates > 1500  # the generator really produced duplicates
    async with running(settings) as gateway:
        await wait_committed(broker, topics.group, topics.raw, traffic.per_partition)
        metrics = gateway.metrics
    clean = await read_topic(broker, topics.clean)
    ids = ids_of(clean)
    assert set(ids) == traffic.unique_ids
    assert max(ids.values()) == 1
    assert metrics.duplicates._value.get() == traffic.duplicates
    assert metrics.forwarded._value.get() == len(traffic.unique_ids)


async def test_clean_record_keeps_raw_fields_and_gains_dedup_headers(stack):
    s = await stack(raw_partitions=1, clean_partitions=1)
    broker, topics, settings = s.broker, s.topics, s.settings
    traffic = await produce_traffic(broker, topics.raw, 5, duplicate_share=0.0)
    async with running(settings):
        await wait_committed(broker, topics.group, topics.raw, traffic.per_partition)
    raw = {r.offset: r for r in await read_topic(broker, topics.raw)}
    for rec in await read_topic(broker, topics.clean):
        headers = dict(rec.headers)
        source_topic, partition, offset = headers["dedup-source"].decode().rsplit("/", 2)
        original = raw[int(offset)]
        assert (source_topic, int(partition)) == (topics.raw, 0)
        assert (rec.key, rec.value, rec.timestamp) == (
            original.key,
            original.value,
            original.timestamp,
        )
        assert headers["message-id"] == headers["dedup-id"] == dict(original.headers)["message-id"]
        assert headers["dedup-token"].decode().isdigit()
