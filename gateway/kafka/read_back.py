"""Read a raw record back by its coordinates, for a retry or a dead letter.

A Kafka client's job, apart from the failure loop that asks for it
(gateway/failures/retry.py): the fetch, the lenient read of a record whose header
name is not UTF-8 (gateway/kafka/salvage.py), and what the broker's answer means
when there is no record there (`Absent`)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import KafkaError, OffsetOutOfRangeError

from gateway.contract.records import Record, source_ref
from gateway.errors import RawFetchError
from gateway.kafka.salvage import read_leniently

FETCH_TIMEOUT_MS = 200
RAW_FETCH_DEADLINE_S = 10.0  # longest one raw read waits for the broker before trying later
FRESH_ANSWER_S = 2.0  # a high watermark this recent is the broker's current word


@dataclass(frozen=True)
class Absent:
    """The broker's answer that no record is at a command's coordinates."""

    reason: str  # the invalid-command metric label
    detail: str


class RawFetcher:
    """Reads single raw records back by coordinates (no group; retries are rare)."""

    def __init__(
        self, consumer: AIOKafkaConsumer, deadline_s: float = RAW_FETCH_DEADLINE_S
    ) -> None:
        self.consumer = consumer
        self.deadline_s = deadline_s

    async def fetch(self, topic: str, partition: int, offset: int) -> Record | Absent:
        """The record at that offset, or `Absent` when the broker says there is none:

        - `raw_record_gone`: below the log start offset (retention), or the fetch
          returned a later record (compacted away, or an aborted transaction's);
        - `beyond_end`: past the end of the partition, as the broker still says at
          the deadline (a leader's high watermark that lags for a moment after an
          election is waited out);
        - `unknown_source`: the partition does not exist.

        Raises RawFetchError when the broker gives no such answer within the
        deadline (paused or slow broker, leader election, open transaction).
        """
        tp = TopicPartition(topic, partition)
        ref = source_ref(topic, partition, offset)
        deadline = time.monotonic() + self.deadline_s
        if self.consumer.assignment() != {tp}:
            # This partition only: records prefetched for another one would hold the next
            # fetch from their broker for aiokafka's prefetch backoff (100 ms a read back;
            # about 4 ms with one partition, measured on a local Apache Kafka).
            self.consumer.assign([tp])
        if not await self._exists(tp, ref, deadline):
            self.consumer.assign([])
            return Absent("unknown_source", f"no partition {tp.topic}/{tp.partition}")
        self.consumer.seek(tp, offset)
        while (left_ms := int((deadline - time.monotonic()) * 1000)) > 0:
            try:
                batch = await self.consumer.getmany(
                    tp, timeout_ms=min(FETCH_TIMEOUT_MS, left_ms), max_records=1
                )
            except OffsetOutOfRangeError:
                return await self._out_of_range(tp, ref, offset, deadline)
            except UnicodeDecodeError:
                # A header name that is not UTF-8 in the record's batch (gateway/kafka/salvage.py).
                return await self._read_leniently(tp, ref, offset)
            for rec in batch.get(tp, []):
                if rec.offset == offset:
                    return rec
                return Absent("raw_record_gone", f"{ref}: the next record is at {rec.offset}")
        high = self.consumer.highwater(tp)
        answered_ms = self.consumer.last_poll_timestamp(tp)
        if (
            high is not None
            and high <= offset
            and answered_ms is not None
            and answered_ms >= (time.time() - FRESH_ANSWER_S) * 1000
        ):
            return Absent("beyond_end", f"{ref}: the partition ends at {high}")
        raise RawFetchError(f"{ref}: not read within {self.deadline_s:g}s")

    async def _read_leniently(self, tp: TopicPartition, ref: str, offset: int) -> Record | Absent:
        """The record at `offset` when aiokafka cannot parse its batch."""
        consumer = self.consumer
        found = await read_leniently(
            consumer._client, tp, offset, 1, consumer._max_partition_fetch_bytes
        )
        for rec in found.records:
            if rec.offset == offset:
                return rec
        if any(rec.offset == offset for rec, _ in found.bad):
            return Absent("bad_header", f"{ref}: a header name is not UTF-8")
        return Absent("raw_record_gone", f"{ref}: not found by a lenient read")

    async def _exists(self, tp: TopicPartition, ref: str, deadline: float) -> bool:
        """Whether the partition exists, refreshing metadata when it is not known yet."""
        parts = self.consumer.partitions_for_topic(tp.topic)
        if parts and tp.partition in parts:
            return True
        try:
            refreshed = await asyncio.wait_for(
                self.consumer._client.force_metadata_update(), deadline - time.monotonic()
            )
        except TimeoutError:
            refreshed = False
        if not refreshed:
            raise RawFetchError(f"{ref}: no metadata for {tp.topic} within {self.deadline_s:g}s")
        parts = self.consumer.partitions_for_topic(tp.topic)
        return bool(parts) and tp.partition in parts

    async def _out_of_range(
        self, tp: TopicPartition, ref: str, offset: int, deadline: float
    ) -> Absent:
        """The broker has nothing at `offset`: below the log start, or past the end."""
        try:
            starts = await asyncio.wait_for(
                self.consumer.beginning_offsets([tp]), max(deadline - time.monotonic(), 0.001)
            )
        except (TimeoutError, KafkaError) as exc:
            raise RawFetchError(f"{ref}: out of range, log start unknown ({exc!r})") from exc
        if offset < starts[tp]:
            return Absent("raw_record_gone", f"{ref}: below the log start offset {starts[tp]}")
        return Absent("beyond_end", f"{ref}: past the end of the partition")
