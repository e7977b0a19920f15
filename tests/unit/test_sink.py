"""The sink's batch filling: aiokafka's record builder called directly."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import pytest
from aiokafka.errors import ProducerFenced
from aiokafka.producer.message_accumulator import BatchBuilder

from bench.datapath import BuildingProducer
from gateway.config import KafkaSettings
from gateway.contract.records import OutRow
from gateway.kafka.clients import build_producer
from gateway.kafka.sink import Sink, fill
from gateway.metrics import Metrics

ROWS: list[OutRow] = [
    (b"k%d" % i, b"v" * (i * 37 % 300), 1_700_000_000_000 + i,
     [("h", b"x"), ("dedup-id", b"id-%d" % i), ("dedup-source", b"raw/0/%d" % i)], 0)
    for i in range(200)
] + [(None, b"no key", None, [], 1), (b"no value", None, 1_700_000_000_999, [], 2)]  # fmt: skip


def by_public_api(batch_size: int, rows: list[OutRow]) -> list[bytes]:
    """The batches aiokafka's own `BatchBuilder.append` builds of `rows`."""
    batches, batch = [], BatchBuilder(batch_size, 0)
    for key, value, timestamp_ms, headers, _ in rows:
        if batch.append(key=key, value=value, timestamp=timestamp_ms, headers=headers) is None:
            batches.append(bytes(batch._build()))
            batch = BatchBuilder(batch_size, 0)
            batch.append(key=key, value=value, timestamp=timestamp_ms, headers=headers)
    return [*batches, bytes(batch._build())]


def by_fill(batch_size: int, rows: list[OutRow]) -> list[bytes]:
    batches, at = [], 0
    while at < len(rows):
        batch = BatchBuilder(batch_size, 0)
        end = fill(batch, rows, at)
        assert end > at and batch.record_count() == end - at
        batches.append(bytes(batch._build()))
        at = end
    return batches


def test_fill_builds_the_batches_batch_builder_append_builds():
    rows = [row for row in ROWS if row[2] is not None]  # a missing timestamp is the clock's
    for batch_size in (1_000_000, 4096, 300):
        expected = by_public_api(batch_size, rows)
        assert by_fill(batch_size, rows) == expected
        assert len(expected) > 1 or batch_size == 1_000_000


def test_fill_takes_a_record_over_the_batch_size_alone_and_ends_the_batch():
    big: OutRow = (b"k", b"v" * 5000, 1, [], 0)
    rows = [ROWS[0], big, ROWS[1]]
    batch = BatchBuilder(4096, 0)
    assert fill(batch, rows, 1) == 2  # the big one alone
    assert batch.size() > 4096 and batch.closed()
    assert fill(BatchBuilder(4096, 0), rows, 0) == 1  # the big one does not join a batch
    assert fill(BatchBuilder(1_000_000, 0), ROWS, 0) == len(ROWS)


async def test_the_producer_never_builds_a_batch_over_max_request_bytes():
    """The sink judges sizes once per batch (`Sink.prepare`): this is what makes it right."""
    kafka = KafkaSettings(bootstrap_servers="127.0.0.1:9", max_request_bytes=4096)
    producer = build_producer(kafka)  # never started: no connection
    try:
        batch = producer.create_batch()
        assert fill(batch, ROWS, 0) < len(ROWS)
        assert batch.size() <= 4096
    finally:
        await producer.stop()


async def test_a_batch_of_several_records_over_the_limit_is_sent_whole_never_cut_short():
    """Only a batch of ONE record over the limit is set aside: with a producer whose
    batches may outgrow the limit, no record of a bigger batch is dropped."""
    producer = BuildingProducer(partitions=1)  # batches of up to 1,000,000 bytes
    kafka = KafkaSettings(bootstrap_servers="127.0.0.1:9", max_request_bytes=4096)
    sink = Sink(cast(Any, producer), kafka, Metrics())
    rows: list[OutRow] = [(b"k", b"v" * 200, 1, [], 0) for _ in range(50)]  # ~11 KB
    await asyncio.gather(*await sink.send("clean", rows))
    assert producer.sent == [("clean", 50)]
    big: OutRow = (b"k", b"v" * 5000, 1, [("dedup-source", b"raw/0/7")], 0)
    await asyncio.gather(*await sink.send("clean", [big]))
    assert producer.sent[1:] == [(kafka.quarantine_topic, 1)]  # alone and over: set aside


class FencedAfterOne(BuildingProducer):
    """Queues the first batch (its future left pending), then is fenced."""

    def __init__(self) -> None:
        super().__init__(partitions=2)
        self.queued: list[asyncio.Future[Any]] = []

    async def send_batch(
        self, batch: BatchBuilder, topic: str, *, partition: int
    ) -> asyncio.Future[Any]:
        if self.queued:
            raise ProducerFenced()
        self.queued.append(asyncio.get_running_loop().create_future())
        return self.queued[0]


async def test_batches_queued_before_a_send_fails_have_their_failure_seen():
    """The send raises the fence; the batch queued before it fails the same way later,
    and nobody awaits it: asyncio logged it as a traceback (chaos seed 21003)."""
    producer = FencedAfterOne()
    sink = Sink(cast(Any, producer), KafkaSettings(bootstrap_servers="127.0.0.1:9"), Metrics())
    rows: list[OutRow] = [(None, b"v", 1, [], p) for p in (0, 1)]  # one batch per partition
    with pytest.raises(ProducerFenced):
        await sink.send("clean", rows)
    (queued,) = producer.queued
    queued.set_exception(ProducerFenced())
    await asyncio.sleep(0)  # done callbacks run on the next loop pass
    assert not queued._log_traceback  # type: ignore[attr-defined]
