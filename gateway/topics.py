"""Topic administration and whole-topic reads, over aiokafka.

`read_topic` finds the end of each partition from the high watermark carried in
fetch responses, never from ListOffsets: the test broker's ListOffsets "latest"
is wrong for multi-record batches (see ENVIRONMENT.md), and the fetch-response
watermark is right on every broker.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Mapping

from aiokafka import AIOKafkaConsumer, ConsumerRecord, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import TopicAlreadyExistsError


async def create_topics(bootstrap: str, partitions: Mapping[str, int]) -> None:
    """Create each topic with its partition count; existing topics are left alone."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        for name, count in partitions.items():
            with contextlib.suppress(TopicAlreadyExistsError):
                await admin.create_topics([NewTopic(name, count, replication_factor=1)])
    finally:
        await admin.close()


async def partitions_of(consumer: AIOKafkaConsumer, topic: str, timeout_s: float = 10) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while True:
        parts = consumer.partitions_for_topic(topic)
        if parts:
            return sorted(parts)
        if time.monotonic() > deadline:
            raise TimeoutError(f"topic {topic!r} has no partitions in metadata")
        await consumer._client.force_metadata_update()
        await asyncio.sleep(0.05)


async def read_topic(
    bootstrap: str, topic: str, *, min_records: int = 0, timeout_s: float = 30
) -> list[ConsumerRecord[bytes, bytes]]:
    """Every record in `topic`, reading until each partition's high watermark.

    With `min_records`, keep reading until at least that many arrived (the
    topic is still being written) or `timeout_s` passes.
    """
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap, enable_auto_commit=False, auto_offset_reset="earliest"
    )
    await consumer.start()
    try:
        tps = [TopicPartition(topic, p) for p in await partitions_of(consumer, topic)]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        records: list[ConsumerRecord[bytes, bytes]] = []
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            batch = await consumer.getmany(*tps, timeout_ms=200)
            for recs in batch.values():
                records.extend(recs)
            at_end = True
            for tp in tps:
                high = consumer.highwater(tp)
                at_end = at_end and high is not None and await consumer.position(tp) >= high
            if at_end and len(records) >= min_records:
                return records
        raise TimeoutError(
            f"read {len(records)} records of {topic!r}, wanted {min_records} within {timeout_s}s"
        )
    finally:
        await consumer.stop()
