"""Topic administration and whole-topic reads for the demo, the benchmark and the tests.

`read_topic` finds the end of each partition from the high watermark carried in
fetch responses (it needs no ListOffsets request).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Mapping

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRecord, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import TopicAlreadyExistsError

from gateway.kafka.clients import partitions_of

TOPICS_VISIBLE_WITHIN_S = 30.0


async def create_topics(bootstrap: str, partitions: Mapping[str, int]) -> None:
    """Create each topic with its partition count; existing topics are left alone.

    Returns once the broker's metadata lists every topic with a leader for each
    partition: Apache Kafka answers CreateTopics when its controller has the topic,
    and its broker learns of it a moment later.
    """
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        for name, count in partitions.items():
            with contextlib.suppress(TopicAlreadyExistsError):
                await admin.create_topics([NewTopic(name, count, replication_factor=1)])
        deadline = time.monotonic() + TOPICS_VISIBLE_WITHIN_S
        while missing := await _not_led(admin, partitions):
            if time.monotonic() > deadline:
                raise TimeoutError(f"topics {missing} not in the broker's metadata")
            await asyncio.sleep(0.02)
    finally:
        await admin.close()


async def _not_led(admin: AIOKafkaAdminClient, partitions: Mapping[str, int]) -> list[str]:
    """The topics whose partitions do not all have a leader in the metadata yet."""
    described = await admin.describe_topics(list(partitions))
    led = {
        topic["topic"]
        for topic in described
        if topic["error_code"] == 0
        and len([p for p in topic["partitions"] if p["leader"] >= 0]) >= partitions[topic["topic"]]
    }
    return [name for name in partitions if name not in led]


async def read_topic(
    bootstrap: str,
    topic: str,
    *,
    min_records: int = 0,
    timeout_s: float = 30,
    committed: bool = True,
) -> list[ConsumerRecord[bytes, bytes]]:
    """Every record in `topic`, reading until each partition's high watermark.

    `committed`: as a `read_committed` reader sees it (no record of an aborted
    transaction; a transaction still open holds the read until it ends), else every
    record written.
    With `min_records`, keep reading until at least that many arrived (the
    topic is still being written) or `timeout_s` passes.
    """
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        isolation_level="read_committed" if committed else "read_uncommitted",
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


async def partitions_of_producer(producer: AIOKafkaProducer, topic: str) -> list[int]:
    parts = await producer.partitions_for(topic)
    if not parts:
        raise RuntimeError(f"topic {topic!r} has no partitions")
    return sorted(parts)


async def committed_offsets(bootstrap: str, group_id: str, topic: str) -> dict[int, int]:
    """The group's committed offsets (next offset to read) per partition of `topic`.

    Read through a consumer that names the group but only `assign`s, so it
    never joins the group (which would trigger a rebalance of its members).
    """
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap, group_id=group_id, enable_auto_commit=False
    )
    await consumer.start()
    try:
        tps = [TopicPartition(topic, p) for p in await partitions_of(consumer, topic)]
        consumer.assign(tps)
        return {tp.partition: (await consumer.committed(tp)) or 0 for tp in tps}
    finally:
        await consumer.stop()


async def wait_committed(
    bootstrap: str, group_id: str, topic: str, ends: Mapping[int, int], timeout_s: float = 60
) -> None:
    """Wait until `group_id` committed `ends[partition]` on every partition of `topic`."""
    deadline = time.monotonic() + timeout_s
    while True:
        committed = await committed_offsets(bootstrap, group_id, topic)
        behind = {p: (committed[p], end) for p, end in ends.items() if committed[p] < end}
        if not behind:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"group {group_id} still behind on {topic}: {behind}")
        await asyncio.sleep(0.1)
