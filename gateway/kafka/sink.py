"""Produce records in batches, one BatchBuilder per partition.

Partitioning: by key (murmur2, as the Java client, so the clean topic keeps
per-key order); a keyless record keeps its source partition number (modulo the
target's partition count), so per-partition order carries over too.

A record the broker would refuse as too large (alone in a batch over `[kafka]
max_request_bytes`) is never sent: a copy cut down to fit goes to the
quarantine topic instead, with reason `too_large` (counted and logged with its
`dedup-source`), so no record can stop the process. The pipeline judges sizes
before the vote; this is the backstop for the failure loop's retries and dead
letters, which carry more headers than the raw record.
"""

from __future__ import annotations

import asyncio
import logging
import struct
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

from aiokafka import AIOKafkaProducer
from aiokafka.producer.message_accumulator import BatchBuilder

from gateway.config import KafkaSettings
from gateway.contract.records import (
    H_SOURCE,
    OutRecord,
    OutRow,
    coordinates,
    parse_source_ref,
    record_size,
    refused_record,
)
from gateway.metrics import Metrics

logger = logging.getLogger(__name__)

# Keys repeat (customer, account, device ids); murmur2 is pure Python here.
_KEY_HASH_CACHE = 65_536
_M = 0x5BD1E995
_MASK = 0xFFFFFFFF


def murmur2(data: bytes) -> int:
    """Kafka's murmur2 (the Java client's `Utils.murmur2`), as aiokafka's, ~2x faster:
    the 4-byte words unpacked at once, the tail read as one little-endian int."""
    length = len(data)
    h = 0x9747B28C ^ length
    for k in struct.unpack_from(f"<{length >> 2}I", data):
        k = (k * _M) & _MASK
        k = ((k ^ (k >> 24)) * _M) & _MASK
        h = ((h * _M) & _MASK) ^ k
    if tail := length & 3:
        h = ((h ^ int.from_bytes(data[length - tail :], "little")) * _M) & _MASK
    h ^= h >> 13
    h = (h * _M) & _MASK
    return h ^ (h >> 15)


def fill(batch: BatchBuilder, rows: Sequence[OutRow], start: int) -> int:
    """Append `rows[start:]` to an empty `batch` until it is full; the index of the
    first row left out (`len(rows)`: none). Always takes `rows[start]`.

    Calls aiokafka's record builder (Cython) directly: `BatchBuilder.append` is a
    Python wrapper around it that costs ~0.15 µs per record (bench/RESULTS.md).
    aiokafka is pinned to 0.14.x; `tests/unit/test_sink.py` checks the batch is
    byte for byte what `BatchBuilder.append` builds.
    """
    append = batch._builder.append
    offset = 0
    for key, value, timestamp_ms, headers, _ in islice(rows, start, None):
        if append(offset, timestamp_ms, key, value, headers) is None:
            break
        offset += 1
    batch._relative_offset = offset
    batch.close()  # nothing more goes in: the producer's own `send` could not add to it
    return start + offset


@dataclass
class Prepared:
    """The produce batches of some records for one topic, built and not yet sent."""

    topic: str
    batches: list[tuple[int, BatchBuilder]] = field(default_factory=list)  # (partition, batch)
    too_large: list[OutRow] = field(default_factory=list)  # each alone over the limit


class Sink:
    def __init__(self, producer: AIOKafkaProducer, kafka: KafkaSettings, metrics: Metrics) -> None:
        self.producer = producer
        self.max_bytes = kafka.max_request_bytes
        self.quarantine_topic = kafka.quarantine_topic
        self.metrics = metrics
        self._partitions: dict[str, list[int]] = {}
        self._key_hash: dict[bytes, int] = {}

    async def _partitions_of(self, topic: str) -> list[int]:
        if topic not in self._partitions:
            parts = await self.producer.partitions_for(topic)
            if not parts:
                raise RuntimeError(f"topic {topic!r} has no partitions")
            self._partitions[topic] = sorted(parts)
        return self._partitions[topic]

    async def send(self, topic: str, records: Iterable[OutRow]) -> list[asyncio.Future[Any]]:
        """Queue `records` on `topic`; returns one delivery future per produced batch."""
        return await self.ship(await self.prepare(topic, records))

    async def prepare(self, topic: str, records: Iterable[OutRow]) -> Prepared:
        """Partition `records` and build their batches; nothing is sent yet (`ship`).

        The pipeline builds a batch's produce batches as soon as it is decided,
        while its records are still in the CPU's cache, and sends them when the
        batch before it is committed: appended later, cold, the same records
        cost aiokafka's builder three times as much (bench/RESULTS.md, "the
        batch builder on cold records"). The records may be dropped once this
        returns: the batches hold their bytes.
        """
        parts = await self._partitions_of(topic)
        count = len(parts)
        by_partition: dict[int, list[OutRow]] = defaultdict(list)
        key_hash = self._key_hash
        for rec in records:
            key = rec[0]
            if key is None:
                index = rec[4]  # the source partition
            elif (index := key_hash.get(key, -1)) < 0:
                if len(key_hash) >= _KEY_HASH_CACHE:
                    key_hash.clear()
                index = key_hash[key] = murmur2(key) & 2147483647
            by_partition[parts[index % count]].append(rec)

        prepared = Prepared(topic)
        for partition, recs in by_partition.items():
            at = 0
            while at < len(recs):
                batch = self.producer.create_batch()
                end = fill(batch, recs, at)
                # Judged once per batch, not per record: the producer's batches are
                # at most `max_request_bytes` (`build_producer`), and a builder only
                # goes past its limit with its first record, which then ends it. Only
                # a batch of that ONE record is set aside.
                if batch.size() > self.max_bytes and batch.record_count() == 1:
                    prepared.too_large.append(recs[at])
                else:
                    prepared.batches.append((partition, batch))
                at = end
        return prepared

    async def deliver(self, topic: str, records: Sequence[OutRow]) -> None:
        """Send `records` and wait for the broker's acknowledgement of every one."""
        if records:
            await asyncio.gather(*await self.send(topic, records))

    async def shipped(self, prepared: Prepared) -> None:
        """`ship`, then wait for the broker's acknowledgements."""
        await asyncio.gather(*await self.ship(prepared))

    async def ship(self, prepared: Prepared) -> list[asyncio.Future[Any]]:
        """Send what `prepare` built; a record the broker would refuse goes to the
        quarantine topic instead. One delivery future per produced batch."""
        topic = prepared.topic
        futures: list[asyncio.Future[Any]] = []
        try:
            for partition, batch in prepared.batches:
                futures.append(await self.producer.send_batch(batch, topic, partition=partition))
            if prepared.too_large:  # the copies fit (a reason and a source within 1 KiB)
                futures += await self.send(
                    self.quarantine_topic,
                    [self._refused(topic, OutRecord(*rec)) for rec in prepared.too_large],
                )
        except BaseException:
            # Nobody awaits the batches queued before the failure: their own (a fenced
            # producer's) is the one raised here. Unseen, asyncio logged each as a
            # traceback ("Future exception was never retrieved", chaos seed 21003).
            for fut in futures:
                fut.add_done_callback(_seen)
            raise
        return futures

    def _refused(self, topic: str, rec: OutRecord) -> OutRecord:
        size = record_size(rec.key, rec.value, rec.headers)
        source = dict(rec.headers).get(H_SOURCE, b"").decode("ascii", "replace")
        try:
            fields = coordinates(*parse_source_ref(source))
        except ValueError:  # every record we write names its source; keep going if not
            fields = {}
        reason = f"too_large: {size} bytes for {topic}, limit {self.max_bytes}"
        self.metrics.quarantined.labels("too_large").inc()
        logger.warning(
            "quarantined %s: %s", source or "a record", reason,
            extra={**fields, "target": topic, "bytes": size},
        )  # fmt: skip
        return refused_record(rec, reason, self.max_bytes)


def _seen(future: asyncio.Future[Any]) -> None:
    """Mark a delivery future's failure as seen (it is reported by the send that raised)."""
    if not future.cancelled():
        future.exception()
