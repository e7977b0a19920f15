"""Bad input: set aside with its reason, never lost, never a crash."""

from __future__ import annotations

import asyncio
import logging
import struct
import time

import pytest
from aiokafka import TopicPartition
from aiokafka.client import AIOKafkaClient
from aiokafka.protocol.produce import ProduceRequest
from aiokafka.record.default_records import DefaultRecordBatchBuilder
from aiokafka.record.util import calc_crc32c

from devtools.harness import (
    RawTuple,
    clean_ids,
    counter_value,
    eventually,
    produce,
    running,
)  # fmt: skip
from devtools.topics import read_topic, wait_committed
from gateway.contract.records import OutRecord, record_size
from gateway.kafka.clients import build_producer
from gateway.kafka.sink import Sink
from gateway.metrics import Metrics

GOOD = (b"k", b'{"order": {"id": "o-1"}}', [("message-id", b"m-1")])


@pytest.mark.parametrize(
    ("id_spec", "bad", "reason"),
    [
        ("header:message-id", (b"k", b"v", []), "missing_header"),
        ("header:message-id", (b"k", b"v", [("message-id", b"")]), "empty_id"),
        ("header:message-id", (b"k", b"v", [("message-id", b"x" * 2000)]), "oversize_id"),
        ("key", (None, b"v", []), "missing_key"),
        ("json:order.id", (b"k", b"not json", []), "not_json"),
        ("json:order.id", (b"k", b'{"order": {"no_id": 1}}', []), "missing_field"),
    ],
)
async def test_bad_record_is_quarantined_with_reason_and_good_records_flow(
    broker, stack, id_spec, bad, reason, caplog
):
    caplog.set_level(logging.WARNING)
    s = await stack(members=1, raw_partitions=1, dedup={"id": id_spec, "max_id_bytes": 1024})
    topics, settings = s.topics, s.settings
    await produce(broker, topics.raw, [bad, GOOD, bad])
    async with running(settings) as gateway:
        await wait_committed(broker, topics.group, topics.raw, {0: 3})
        assert counter_value(gateway.metrics.quarantined, reason) == 2
    quarantined = await read_topic(broker, topics.quarantine)
    assert [r.offset for r in quarantined] == [0, 1]
    for rec in quarantined:
        headers = dict(rec.headers)
        assert headers["dedup-error"].decode().startswith(f"{reason}:")
        assert headers["dedup-source"].decode().rsplit("/", 2)[1:] in (["0", "0"], ["0", "2"])
        assert (rec.key, rec.value) == (bad[0], bad[1])  # the record itself is kept
    for offset in (0, 2):
        assert f"quarantined {topics.raw}/0/{offset}: {reason}:" in caplog.text
    assert len(await clean_ids(broker, topics.clean)) == 1


async def test_gateway_waits_for_a_redis_majority_and_names_unreachable_instances(
    broker, stack, caplog
):
    caplog.set_level(logging.INFO)
    s = await stack(raw_partitions=1)
    topics, servers, settings = s.topics, s.servers, s.settings
    await produce(broker, topics.raw, [GOOD])
    for server in servers[1:]:
        server.stop()
    async with running(settings) as gateway:
        await eventually(lambda: "cannot reach a Redis majority" in caplog.text)
        assert gateway.source is None  # not consuming without a majority
        assert not gateway.readiness()[0]
        for server in servers[1:]:
            assert f"127.0.0.1:{server.port}/0" in caplog.text
        servers[1].start()  # a majority again: it starts serving
        await wait_committed(broker, topics.group, topics.raw, {0: 1})
    assert set(await clean_ids(broker, topics.clean)) == {"m-1"}


async def test_redis_password_is_used_and_never_logged(broker, stack, caplog):
    caplog.set_level(logging.DEBUG)
    s = await stack(raw_partitions=1, password="s3cret-pw")
    topics = s.topics
    await produce(broker, topics.raw, [GOOD])
    async with running(s.settings):
        await wait_committed(broker, topics.group, topics.raw, {0: 1})
    assert "s3cret-pw" not in caplog.text
    assert "starting: raw=" in caplog.text


def sized(size: int, key: bytes, headers: list[tuple[str, bytes]]) -> RawTuple:
    """A raw record of `size` bytes by the producer's own estimate (what its limit checks)."""
    empty = record_size(key, b"", headers)
    n = size - empty
    n -= record_size(key, b"v" * n, headers) - empty - n  # the value length's varint
    assert record_size(key, b"v" * n, headers) == size
    return key, b"v" * n, headers


async def test_a_record_whose_clean_copy_would_outgrow_the_broker_limit_is_quarantined(
    broker, stack, caplog
):
    caplog.set_level(logging.WARNING)
    limit = 1_048_576  # [kafka] max_request_bytes, default: the broker's message.max.bytes
    s = await stack(members=1, raw_partitions=1)
    topics, settings = s.topics, s.settings
    # Ids of 400 bytes: a clean copy adds about 480 bytes, a quarantine copy about 120.
    whole = sized(limit - 300, b"k", [("message-id", b"big-1".ljust(400, b"."))])
    cut = sized(limit - 10, b"k", [("message-id", b"big-2".ljust(400, b"."))])  # value left out
    await produce(broker, topics.raw, [GOOD, whole, cut, (b"k", b"v", [("message-id", b"m-2")])])
    async with running(settings) as gateway:
        await wait_committed(broker, topics.group, topics.raw, {0: 4})
        assert counter_value(gateway.metrics.quarantined, "too_large") == 2
    assert set(await clean_ids(broker, topics.clean)) == {"m-1", "m-2"}
    first, second = await read_topic(broker, topics.quarantine)
    for rec, offset in ((first, 1), (second, 2)):
        headers = dict(rec.headers)
        assert headers["dedup-error"].startswith(b"too_large: the clean copy would be up to ")
        assert headers["dedup-source"] == f"{topics.raw}/0/{offset}".encode()
        assert record_size(rec.key, rec.value, list(rec.headers)) <= limit
        assert f"quarantined {topics.raw}/0/{offset}: too_large" in caplog.text
    assert (first.key, first.value) == (b"k", whole[1])
    assert "dedup-dropped" not in dict(first.headers)
    assert (second.key, second.value) == (b"k", None)
    assert dict(second.headers)["dedup-dropped"] == b"value"
    assert dict(second.headers)["message-id"] == cut[2][0][1]


async def test_an_outgoing_record_over_the_limit_goes_to_quarantine_not_to_the_broker(
    broker, stack, caplog
):
    """The sink's backstop (retries and dead letters carry more headers than the raw record)."""
    caplog.set_level(logging.WARNING)
    s = await stack(members=0, kafka={"max_request_bytes": 4096})
    topics, kafka = s.topics, s.settings.kafka
    metrics = Metrics()
    producer = build_producer(kafka)
    await producer.start()
    try:
        big = OutRecord(
            b"k",
            b"v" * 5000,
            None,
            [("h", b"1"), ("dedup-id", b"m-9"), ("dedup-source", b"raw/1/5")],
            1,
        )
        small = OutRecord(b"k2", b"v", None, [("dedup-source", b"raw/1/6")], 1)  # fmt: skip
        await asyncio.gather(*await Sink(producer, kafka, metrics).send(topics.clean, [big, small]))
    finally:
        await producer.stop()
    assert [r.key for r in await read_topic(broker, topics.clean)] == [b"k2"]
    (copy,) = await read_topic(broker, topics.quarantine)
    assert (copy.key, copy.value) == (b"k", None)
    assert dict(copy.headers) == {
        "h": b"1",
        "dedup-error": f"too_large: {record_size(big.key, big.value, big.headers)} bytes for "
        f"{topics.clean}, limit 4096".encode(),
        "dedup-source": b"raw/1/5",
        "dedup-dropped": b"value",
    }
    assert counter_value(metrics.quarantined, "too_large") == 1
    assert "quarantined raw/1/5: too_large" in caplog.text


PLACEHOLDER = "\x01\x02\x03\x04\x05\x06"  # a header name, patched to bytes that are not UTF-8


def batch_with_bad_header_name(records: list[RawTuple], bad: int) -> bytes:
    """A v2 record batch of `records`, record `bad` with an extra header whose name is
    not UTF-8 (aiokafka only writes str names: one is patched in, the CRC redone)."""
    builder = DefaultRecordBatchBuilder(2, 0, 0, -1, -1, -1, 10**7)
    now = int(time.time() * 1000)
    for i, (key, value, headers) in enumerate(records):
        builder.append(i, now, key, value, [*headers, *([(PLACEHOLDER, b"h")] if i == bad else [])])
    data = bytearray(builder.build())
    at = data.index(PLACEHOLDER.encode())
    data[at : at + len(PLACEHOLDER)] = b"\xff\xfe\xfd\xfc\xfb\xfa"
    struct.pack_into(">I", data, 17, calc_crc32c(bytes(data[21:])))  # CRC: attributes to end
    return bytes(data)


async def produce_raw_batch(bootstrap: str, topic: str, partition: int, data: bytes) -> None:
    client = AIOKafkaClient(bootstrap_servers=bootstrap)
    await client.bootstrap()
    try:
        await client.force_metadata_update()
        leader = client.cluster.leader_for_partition(TopicPartition(topic, partition))
        request = ProduceRequest(None, -1, 10_000, [(topic, [(partition, data)])])
        response = await client.send(leader, request)
        ((_, ((_, error_code, *_),)),) = response.topics
        assert error_code == 0
    finally:
        await client.close()


def ids(*names: str) -> list[RawTuple]:
    return [(b"k", b"v", [("message-id", name.encode())]) for name in names]


async def test_a_header_name_that_is_not_utf8_is_quarantined_and_the_partitions_go_on(
    broker, stack, caplog
):
    caplog.set_level(logging.WARNING)
    s = await stack(members=1, raw_partitions=8)
    topics, settings = s.topics, s.settings
    await produce(broker, topics.raw, ids("a-0", "a-1", "a-2"), partition=0)
    # Partitions unpacked before the failing one in the same fetch moved past records
    # that fetch never returned: they must be read again, not skipped.
    others = {p: [f"g-{p}-{i}" for i in range(3)] for p in range(2, 8)}
    for p, names_of_p in others.items():
        await produce(broker, topics.raw, ids(*names_of_p), partition=p)
    bad_one = (b"bad-key", b"bad-value", [("message-id", b"b-1"), ("kept", b"1")])
    await produce_raw_batch(broker, topics.raw, 1, batch_with_bad_header_name(
        [*ids("c-0"), bad_one, *ids("c-2")], bad=1))  # fmt: skip
    await produce_raw_batch(broker, topics.raw, 0, batch_with_bad_header_name(
        [*ids("a-3"), (None, b"v", [("message-id", b"b-2")])], bad=1))  # fmt: skip
    async with running(settings) as gateway:
        await wait_committed(
            broker, topics.group, topics.raw, {0: 5, 1: 3, **dict.fromkeys(others, 3)}
        )
        assert counter_value(gateway.metrics.quarantined, "bad_header") == 2
        # It keeps serving both partitions.
        await produce(broker, topics.raw, ids("a-5"), partition=0)
        await produce(broker, topics.raw, ids("c-3"), partition=1)
        await wait_committed(broker, topics.group, topics.raw, {0: 6, 1: 4})
    clean = await clean_ids(broker, topics.clean)
    good = [
        "a-0",
        "a-1",
        "a-2",
        "a-3",
        "a-5",
        "c-0",
        "c-2",
        "c-3",
        *(n for ns in others.values() for n in ns),
    ]
    assert clean == dict.fromkeys(good, 1)
    quarantined = {dict(r.headers)["dedup-source"].decode(): r
                   for r in await read_topic(broker, topics.quarantine)}  # fmt: skip
    assert set(quarantined) == {f"{topics.raw}/1/1", f"{topics.raw}/0/4"}
    first = quarantined[f"{topics.raw}/1/1"]
    assert (first.key, first.value) == (b"bad-key", b"bad-value")
    assert first.headers == (
        ("message-id", b"b-1"),
        ("kept", b"1"),
        ("dedup-error", b"bad_header: 1 header name(s) not UTF-8, dropped"),
        ("dedup-source", f"{topics.raw}/1/1".encode()),
    )
    assert f"quarantined {topics.raw}/1/1: bad_header" in caplog.text
    assert f"quarantined {topics.raw}/0/4: bad_header" in caplog.text
