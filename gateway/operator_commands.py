"""Operator commands: `inspect ID`, `release ID`, `redrive`.

They use the same settings file as the service, and the same scripts, so a
manual action follows the same rules as the gateway's own.
"""

from __future__ import annotations

import logging

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from rich.console import Console
from rich.table import Table

from gateway.app import build_producer, kafka_client_options
from gateway.config import Settings
from gateway.keys import dead_token, mark_digest, parse_source_ref
from gateway.metrics import Metrics
from gateway.pipeline import H_SOURCE
from gateway.quorum import Quorum
from gateway.topics import partitions_of

logger = logging.getLogger(__name__)
console = Console()


async def inspect(settings: Settings, message_id: str) -> int:
    """Print each instance's mark for `message_id`: owner token, TTL, bucket encoding."""
    quorum = Quorum(settings.redis, Metrics())
    try:
        digest = mark_digest(message_id.encode())
        views = await quorum.inspect(digest)
    finally:
        await quorum.close()
    table = Table(title=f"marks for id {message_id!r} (digest {digest.hex()})")
    table.add_column("instance", overflow="fold")
    table.add_column("owner token", min_width=19, no_wrap=True)  # copied into --token: whole
    for column in ("ttl", "bucket", "last handover by"):
        table.add_column(column, overflow="fold")
    for inst, view in zip(quorum.instances, views, strict=True):
        if view is None:
            table.add_row(inst.name, "[red]no answer[/]", "", "", "")
            continue
        bucket = view.encoding or ""  # "listpack": compact; "hashtable": raise buckets
        by = view.handed_over_by or ""
        table.add_row(inst.name, view.owner or "(none)", _ttl(view.ttl_ms), bucket, by)
    console.print(table)
    return 0


async def release(settings: Settings, message_id: str, token: str | None) -> int:
    """Delete the id's mark: only where it holds `token` when given, else everywhere."""
    quorum = Quorum(settings.redis, Metrics())
    try:
        digest = mark_digest(message_id.encode())
        if token is not None:
            replies = await quorum.release([digest], [token])
            results = [None if r is None else r[0] for r in replies]
        else:
            results = await quorum.delete(digest)
    finally:
        await quorum.close()
    deleted = sum(1 for r in results if r)
    for inst, result in zip(quorum.instances, results, strict=True):
        state = "no answer" if result is None else "deleted" if result else "not held / absent"
        console.print(f"{inst.name}: {state}")
    ok = deleted >= quorum.majority
    console.print(
        f"released on {deleted} of {quorum.size} instances: {'ok' if ok else 'NOT released'}"
    )
    return 0 if ok else 1


async def redrive(settings: Settings, limit: int | None) -> int:
    """Re-inject dead-lettered records into their raw topic, as new records.

    Each record's mark is deleted where it still holds the dead-letter token
    (so the re-injected copy is new, not a duplicate), then the original key,
    value and headers go back to the raw topic. Progress is committed in group
    `<group_id>.redrive`, so a second run does not re-inject the same records.
    """
    kafka = settings.kafka
    consumer = AIOKafkaConsumer(
        **kafka_client_options(kafka),
        group_id=f"{kafka.group_id}.redrive",
        enable_auto_commit=False,
        auto_offset_reset="earliest",
    )
    producer: AIOKafkaProducer = build_producer(kafka)
    quorum = Quorum(settings.redis, Metrics())
    await consumer.start()
    await producer.start()
    redriven = 0
    try:
        tps = [
            TopicPartition(kafka.dead_letter_topic, p)
            for p in await partitions_of(consumer, kafka.dead_letter_topic)
        ]
        consumer.assign(tps)
        while limit is None or redriven < limit:
            batch = await consumer.getmany(*tps, timeout_ms=1000, max_records=100)
            if not batch:
                break
            todo = [(tp, rec) for tp, records in batch.items() for rec in records]
            for tp, rec in todo[: None if limit is None else limit - redriven]:
                headers = dict(rec.headers)
                topic, partition, offset = parse_source_ref(headers[H_SOURCE].decode())
                digest = mark_digest(headers["dedup-id"])
                await quorum.release([digest], [dead_token(topic, partition, offset)])
                original = [(k, v) for k, v in rec.headers if not k.startswith("dedup-")]
                await producer.send_and_wait(topic, rec.value, key=rec.key, headers=original)
                await consumer.commit({tp: rec.offset + 1})
                redriven += 1
                console.print(f"redriven {headers['dedup-id'].decode()!r} to {topic}")
    finally:
        await quorum.close()
        await producer.stop()
        await consumer.stop()
    console.print(f"{redriven} dead-lettered record(s) re-injected")
    return 0


def _ttl(ttl_ms: int) -> str:
    if ttl_ms == -2:
        return "absent"
    if ttl_ms == -1:
        return "no TTL"
    return f"{ttl_ms / 1000:.1f}s"
