"""Produce records in batches, one BatchBuilder per partition.

Partitioning: by key (murmur2, as the Java client, so the clean topic keeps
per-key order); a keyless record keeps its source partition number (modulo the
target's partition count), so per-partition order carries over too.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

from aiokafka import AIOKafkaProducer
from aiokafka.partitioner import murmur2

Headers = Sequence[tuple[str, bytes]]


class OutRecord(NamedTuple):  # a tuple: built once per forwarded record
    key: bytes | None
    value: bytes | None
    timestamp_ms: int | None
    headers: Headers
    source_partition: int


# Keys repeat (customer, account, device ids); murmur2 is pure Python here.
_KEY_HASH_CACHE = 65_536


class Sink:
    def __init__(self, producer: AIOKafkaProducer) -> None:
        self.producer = producer
        self._partitions: dict[str, list[int]] = {}
        self._key_hash: dict[bytes, int] = {}

    async def _partitions_of(self, topic: str) -> list[int]:
        if topic not in self._partitions:
            parts = await self.producer.partitions_for(topic)
            if not parts:
                raise RuntimeError(f"topic {topic!r} has no partitions")
            self._partitions[topic] = sorted(parts)
        return self._partitions[topic]

    async def send(self, topic: str, records: Iterable[OutRecord]) -> list[asyncio.Future[Any]]:
        """Queue `records` on `topic`; returns one delivery future per produced batch."""
        parts = await self._partitions_of(topic)
        by_partition: dict[int, list[OutRecord]] = defaultdict(list)
        key_hash = self._key_hash
        for rec in records:
            if rec.key is None:
                index = rec.source_partition
            elif (index := key_hash.get(rec.key, -1)) < 0:
                if len(key_hash) >= _KEY_HASH_CACHE:
                    key_hash.clear()
                index = key_hash[rec.key] = murmur2(rec.key) & 2147483647
            by_partition[parts[index % len(parts)]].append(rec)

        futures: list[asyncio.Future[Any]] = []
        for partition, recs in by_partition.items():
            batch = self.producer.create_batch()
            for rec in recs:
                if (
                    batch.append(
                        key=rec.key,
                        value=rec.value,
                        timestamp=rec.timestamp_ms,
                        headers=rec.headers,
                    )
                    is None
                ):  # batch full: ship it, start another
                    futures.append(
                        await self.producer.send_batch(batch, topic, partition=partition)
                    )
                    batch = self.producer.create_batch()
                    batch.append(
                        key=rec.key, value=rec.value, timestamp=rec.timestamp_ms,
                        headers=rec.headers,
                    )  # fmt: skip
            futures.append(await self.producer.send_batch(batch, topic, partition=partition))
        return futures
