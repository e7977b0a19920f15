"""A record whose header name is not UTF-8 on the failure topic or on a delay tier
topic: aiokafka cannot parse it (its `getmany` raises, every time). It is set aside
with a metric and a log line naming its coordinates, and the loop reads on; before,
the whole gateway stopped, and every restart met the same record again. Also a
well-formed tier record due beyond `max_delay`: set aside, not cycled in the tiers."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import re

import pytest
from aiokafka import TopicPartition

from devtools.harness import (
    clean_ids,
    counter_value,
    eventually,
    failure_command,
    produce,
    running,
)
from devtools.topics import create_topics, read_topic, wait_committed
from gateway.contract.records import H_DELIVER_AT, H_ID, H_TIER_AT
from gateway.delay.coalescer import now_ms
from gateway.kafka import salvage as salvage_module
from gateway.kafka.clients import build_consumer, build_producer
from gateway.kafka.completion import PlainCompletions
from gateway.kafka.read_back import RawFetcher
from gateway.kafka.salvage import EMPTY_WAIT_S, Fetched, Salvage
from gateway.kafka.sink import Sink
from gateway.metrics import Metrics
from gateway.quorum.quorum import Quorum
from gateway.rules.tiers import tier_topics
from gateway.service.app import failure_loop
from tests.integration.test_bad_input import batch_with_bad_header_name, produce_raw_batch


def copy_of(message_id: str) -> tuple[bytes, bytes, list[tuple[str, bytes]]]:
    return b"k", b"{}", [("message-id", message_id.encode())]


async def test_a_failure_command_with_a_header_name_not_utf8_is_skipped_and_the_next_acted_on(
    stack, caplog
):
    caplog.set_level(logging.INFO)
    s = await stack(raw_partitions=1, clean_partitions=1, failures={"mode": "release"})
    broker, topics, settings = s.broker, s.topics, s.settings
    async with running(settings) as gateway:
        m = gateway.metrics
        await produce(broker, topics.raw, [copy_of("m-1")])
        (first,) = await read_topic(broker, topics.clean, min_records=1)
        command = failure_command(first, "boom")
        # The same command twice in one batch: the first with a header name that is not
        # UTF-8 (skipped), the second as the Spark job writes it (acted on).
        await produce_raw_batch(
            broker, topics.failures, 0, batch_with_bad_header_name([command, command], bad=0)
        )
        await eventually(lambda: counter_value(m.releases, "released") == 1)
        assert counter_value(m.invalid_commands, "bad_header") == 1
        await wait_committed(broker, f"{topics.group}.failures", topics.failures, {0: 2})
        # It keeps reading the failure topic.
        await produce(broker, topics.failures, [failure_command(first, "late replay")])
        await eventually(lambda: counter_value(m.releases, "stale") == 1)
    assert f"invalid failure command at {topics.failures}/0/0 skipped (bad_header)" in caplog.text


async def test_a_tier_record_with_a_header_name_not_utf8_is_quarantined_and_the_next_delivered(
    stack, caplog
):
    caplog.set_level(logging.INFO)
    delay = {"enabled": True, "tiers": ["1s"]}
    s = await stack(members=1, raw_partitions=1, clean_partitions=1, delay=delay)
    broker, topics, settings = s.broker, s.topics, s.settings
    (tier,) = tier_topics(settings)
    await create_topics(broker, {tier: 1})
    now = str(now_ms()).encode()

    def waiting(message_id: bytes) -> tuple[bytes, bytes, list[tuple[str, bytes]]]:
        """A tier record as a gateway writes it, due now."""
        return message_id, b"v", [(H_ID, message_id), (H_DELIVER_AT, now), (H_TIER_AT, now)]

    await produce_raw_batch(
        broker, tier, 0, batch_with_bad_header_name([waiting(b"t-bad"), waiting(b"t-1")], bad=0)
    )
    async with running(settings) as gateway:
        await eventually(lambda: counter_value(gateway.metrics.quarantined, "bad_tier_record") == 1)
        await wait_committed(broker, f"{topics.group}.delay", tier, {0: 2})
        # It keeps serving the tiers: a raw record asking for a delay is delivered.
        await produce(broker, topics.raw, [(b"k", b"v", [("message-id", b"d-1"),
                                                         ("deliver-after", b"1s")])])  # fmt: skip
        await wait_committed(broker, f"{topics.group}.delay", tier, {0: 3})
    assert await clean_ids(broker, topics.clean) == {"t-1": 1, "d-1": 1}
    (quarantined,) = await read_topic(broker, topics.quarantine, min_records=1)
    assert quarantined.key == b"t-bad"
    assert (
        dict(quarantined.headers)["dedup-error"]
        == b"bad_tier_record: 1 header name(s) not UTF-8, dropped"
    )
    assert f"quarantined tier record {tier}/0/0: bad_tier_record" in caplog.text


async def test_a_tier_record_due_beyond_max_delay_is_quarantined_not_cycled_in_the_tiers(
    stack, caplog
):
    """A well-formed tier record due further ahead than `[delay] max_delay` (written
    before max_delay was lowered, or by another writer) would step through the largest
    tier past its mark's life: it is quarantined as `delay_too_long`, the next delivered."""
    caplog.set_level(logging.INFO)
    delay = {"enabled": True, "tiers": ["1s"], "max_delay": "30s"}
    s = await stack(members=1, raw_partitions=1, clean_partitions=1, delay=delay)
    broker, topics, settings = s.broker, s.topics, s.settings
    (tier,) = tier_topics(settings)
    await create_topics(broker, {tier: 1})
    now = now_ms()

    def waiting(message_id: bytes, due: int) -> tuple[bytes, bytes, list[tuple[str, bytes]]]:
        headers = [(H_ID, message_id), (H_DELIVER_AT, str(due).encode()), (H_TIER_AT, b"%d" % now)]
        return message_id, b"v", headers

    await produce(broker, tier, [waiting(b"t-far", now + 3_600_000), waiting(b"t-1", now)])
    async with running(settings) as gateway:
        quarantined = gateway.metrics.quarantined
        await eventually(lambda: counter_value(quarantined, "delay_too_long") == 1)
        await wait_committed(broker, f"{topics.group}.delay", tier, {0: 2})
    assert await clean_ids(broker, topics.clean) == {"t-1": 1}
    (copy,) = await read_topic(broker, topics.quarantine, min_records=1)
    assert copy.key == b"t-far"
    error = dict(copy.headers)["dedup-error"]
    pattern = rb"delay_too_long: due ([\d.]+)s from now; \[delay\] max_delay is 30s"
    due = re.fullmatch(pattern, error)
    assert due is not None, error
    assert 3_500 < float(due[1]) <= 3_600  # an hour ahead, less the moments it took
    assert f"quarantined tier record {tier}/0/0: delay_too_long" in caplog.text


async def test_a_revoke_while_reading_past_a_bad_command_waits_for_what_was_read(
    stack, monkeypatch
):
    """The failure loop reads past a command it cannot parse under its lock, as every
    loop on the skeleton does: a revoke that comes during the lenient read waits until
    what was read is handled, then drops the partition's state. Handled after the
    revoke, it would have made the revoked partition's state anew and committed it
    past retries the revoke dropped (chaos seed 9709, retry mode, ids never retried)."""
    s = await stack(members=1, raw_partitions=1, clean_partitions=1)
    broker, topics, settings = s.broker, s.topics, s.settings
    kafka, metrics = settings.kafka, Metrics()
    quorum = Quorum(settings.redis, metrics)
    producer = build_producer(kafka)
    commands = build_consumer(kafka, f"{kafka.group_id}.failures")
    await producer.start()
    await commands.start()
    # Its fetcher reads raw records back for due retries: none come due here.
    sink = Sink(producer, kafka, metrics)
    loop = await failure_loop(
        settings, quorum, PlainCompletions(sink), metrics, commands, RawFetcher(commands)
    )
    listener = loop.listener()
    commands.subscribe([kafka.failure_topic], listener=listener)
    try:
        for _ in range(200):  # joined once the group assigns the partitions
            await commands.getmany(timeout_ms=50)
            if commands.assignment():
                break
        tp = TopicPartition(kafka.failure_topic, 0)
        assert tp in commands.assignment()
        body = {
            "id": "m-1", "id_b64": base64.b64encode(b"m-1").decode(), "token": "1",
            "reason": "boom", "source": {"topic": topics.raw, "partition": 0, "offset": 0},
            "attempt": 1, "reasons": [],
        }  # fmt: skip
        command = (b"m-1", json.dumps(body).encode(), [])
        await produce_raw_batch(
            broker, kafka.failure_topic, 0, batch_with_bad_header_name([command, command], bad=1)
        )
        with pytest.raises(UnicodeDecodeError) as failed:
            for _ in range(100):
                await commands.getmany(tp, timeout_ms=100)
        events: list[str] = []
        read, take, forget = salvage_module.read_past_bad_headers, loop.take, loop.forget
        revoking: list[asyncio.Task[None]] = []

        async def revoked_meanwhile(*args, **kwargs):
            found = await read(*args, **kwargs)
            events.append("read")
            revoking.append(
                asyncio.create_task(listener.on_partitions_revoked(set(commands.assignment())))
            )
            return found

        async def taken(fetched):
            stopped = await take(fetched)
            events.append("taken")
            return stopped

        def forgotten(partitions):
            events.append("revoked")
            forget(partitions)

        monkeypatch.setattr(salvage_module, "read_past_bad_headers", revoked_meanwhile)
        loop.forget = forgotten  # type: ignore[method-assign]
        listener.forget = forgotten
        async with loop.loop.lock:
            await loop.loop.salvage(failed.value, 500, taken)
        await revoking[0]
        assert events == ["read", "taken", "revoked"]
        assert len(loop.mode.due) == 0 and not loop.book.parts  # retry mode
        assert counter_value(metrics.invalid_commands, "bad_header") == 1
    finally:
        await commands.stop()
        await producer.stop()
        await quorum.close()


async def test_a_salvage_reads_on_towards_a_bad_record_beyond_max_records(broker, stack):
    """Issue 41: a lenient read that found no unparseable record within `max_records`
    of where the loop stands (here 2, with 3 batches before the bad one) took nothing,
    counted a failure and backed the loop off, at every try: the partition never got
    past it. Now the records read are taken, the partition reads on after them, and
    the next salvage meets the bad record."""
    s = await stack(members=0, raw_partitions=1)
    topics, settings = s.topics, s.settings
    tp = TopicPartition(topics.raw, 0)
    for i in range(3):  # a batch each
        await produce(broker, topics.raw, [copy_of(f"g-{i}")], partition=0)
    await produce_raw_batch(
        broker, topics.raw, 0, batch_with_bad_header_name([copy_of("c-3"), copy_of("c-4")], bad=1)
    )
    consumer = build_consumer(settings.kafka, f"{topics.group}.salvage")  # no commits yet
    await consumer.start()
    consumer.assign([tp])
    stands: dict[TopicPartition, int] = {}
    salvage = Salvage(consumer, settings.kafka, "raw", stands.get, stands.__setitem__)
    taken: list[tuple[list[int], dict[int, int]]] = []

    async def take(fetched: Fetched) -> set[TopicPartition]:
        taken.append(([r.offset for r in fetched.records[tp]], dict(fetched.bad.get(tp, {}))))
        return set()

    try:
        with pytest.raises(UnicodeDecodeError) as failed:
            for _ in range(100):
                await consumer.getmany(tp, timeout_ms=100, max_records=10)
        assert await salvage(failed.value, 2, take) == 0
        assert await salvage(failed.value, 2, take) == 0
        assert taken == [([0, 1], {}), ([2, 3, 4], {4: 1})]
        assert stands[tp] == 5 and await consumer.position(tp) == 5
    finally:
        await consumer.stop()


async def test_a_salvage_that_finds_its_partition_paused_holds_the_loop_back_little(broker, stack):
    """Issue 41: a block can pause the partition holding the bad record between the
    failed fetch and the lenient read, which then reads nothing: the raw loop counted a
    failure and slept, doubling up to 30 s, whole, even once the quorum was back. Now
    it waits at most `EMPTY_WAIT_S`'s last, and reads the partition when it resumes."""
    s = await stack(members=0, raw_partitions=1)
    topics, settings = s.topics, s.settings
    tp = TopicPartition(topics.raw, 0)
    await produce_raw_batch(
        broker, topics.raw, 0, batch_with_bad_header_name([copy_of("c-0"), copy_of("c-1")], bad=1)
    )
    consumer = build_consumer(settings.kafka, f"{topics.group}.salvage")  # no commits yet
    await consumer.start()
    consumer.assign([tp])
    salvage = Salvage(consumer, settings.kafka, "raw")
    taken: list[Fetched] = []

    async def take(fetched: Fetched) -> set[TopicPartition]:
        taken.append(fetched)
        return set()

    try:
        with pytest.raises(UnicodeDecodeError) as failed:
            for _ in range(100):
                await consumer.getmany(tp, timeout_ms=100)
        consumer.pause(tp)  # blocked meanwhile
        waits = [await salvage(failed.value, 500, take) for _ in range(8)]
        assert not taken and max(waits) <= EMPTY_WAIT_S[1]
        consumer.resume(tp)  # the block ends: the record is read past at once
        assert await salvage(failed.value, 500, take) == 0
        assert [r.offset for r in taken[0].records[tp]] == [0, 1] and taken[0].bad[tp] == {1: 1}
    finally:
        await consumer.stop()
