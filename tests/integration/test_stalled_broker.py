"""A broker that stops answering while connections stay open (a stalled network, a
hung broker): every client of the gateway goes through a TcpProxy that is paused.

A transaction whose end (offsets and commit) does not come within
`transaction_timeout` and a round trip is ended by a new producer under the same id,
and its step is read again; a SIGTERM's drain is bounded by `[kafka] drain_timeout`
(chaos seed 52204: the failure loop's commit waited for good, and so did the stop)."""

from __future__ import annotations

import asyncio
import functools
import gc
import logging
import signal
import time
from datetime import timedelta
from pathlib import Path

import pytest
from aiokafka import AIOKafkaProducer, TopicPartition

from devtools.harness import (
    Topics,
    clean_ids,
    eventually,
    make_settings,
    redis_urls,
    start_process,
    write_toml,
)
from devtools.proxy import proxied
from devtools.topics import committed_offsets, create_topics, read_topic, wait_committed
from devtools.traffic import produce_traffic
from gateway.config import Settings
from gateway.kafka.clients import build_consumer, build_transactional_producer
from gateway.kafka.exactly_once import StepAborted, Transactions
from gateway.kafka.transactions import group_member


@pytest.fixture(scope="module")
async def silent_broker(tmp_path_factory):
    """One broker behind a TcpProxy for the module (each test resumes what it paused)."""
    async with proxied(tmp_path_factory.mktemp("silent")) as broker:
        yield broker


async def test_a_transaction_whose_end_stalls_is_ended_by_a_new_producer(
    silent_broker, names, caplog
):
    bootstrap, proxy = silent_broker
    raw, clean, group = names("raw"), names("clean"), names("group")
    await create_topics(bootstrap, {raw: 1, clean: 1})
    async with AIOKafkaProducer(bootstrap_servers=bootstrap) as producer:
        await producer.send_and_wait(raw, b"record")
    kafka = Settings.model_validate(
        {"kafka": {"bootstrap_servers": bootstrap, "transaction_timeout": "1s"}}
    ).kafka
    consumer = build_consumer(kafka, group)
    await consumer.start()
    consumer.subscribe([raw])
    build = functools.partial(build_transactional_producer, kafka, names("txn"))
    first = build()
    await first.start()
    transactions = Transactions("raw", first, build, end_within_s=3.0)
    try:
        assert await consumer.getmany(timeout_ms=30_000, max_records=1), "no raw record"
        member = group_member(consumer)

        async def step() -> dict[TopicPartition, int]:
            await (await transactions.producer.send(clean, b"copy"))  # acknowledged
            proxy.pause()  # the offsets and the commit meet a silent broker
            return {TopicPartition(raw, 0): 1}

        caplog.set_level(logging.WARNING, logger="gateway.kafka.exactly_once")
        run = asyncio.create_task(transactions.run(step(), consumer, member))
        await eventually(lambda: "did not end within 3s" in caplog.text, what="the end given up")
        proxy.resume()  # the new producer starts, and so ends the old one's transaction
        with pytest.raises(StepAborted):
            await asyncio.wait_for(run, 60)
        assert transactions.producer is not first
    finally:
        proxy.resume()
        await transactions.stop()
        await consumer.stop()
    gc.collect()  # asyncio logs a failure nobody retrieved when its future is collected
    assert "never retrieved" not in caplog.text, caplog.text
    # Committed or aborted, as one: the copy is read exactly when the offset moved.
    copies = await read_topic(bootstrap, clean, timeout_s=30)
    committed = (await committed_offsets(bootstrap, group, raw)).get(0) or 0
    assert (len(copies), committed) in {(0, 0), (1, 1)}


async def test_sigterm_while_the_broker_is_silent_stops_within_the_drain_timeout(
    silent_broker, redis_servers, names, tmp_path: Path
):
    bootstrap, proxy = silent_broker
    topics = Topics(names)
    await topics.create(bootstrap, raw_partitions=2, clean_partitions=2)
    settings = make_settings(
        bootstrap, topics, redis_urls(redis_servers(3)),
        kafka={"exactly_once": "on", "max_batch_records": 100, "drain_timeout": "2s"},
    )  # fmt: skip
    config = write_toml(tmp_path / "gateway.toml", settings)
    log = tmp_path / "gateway.log"
    traffic = await produce_traffic(bootstrap, topics.raw, 8_000, duplicate_share=0.2, seed=52)
    total = sum(traffic.per_partition.values())
    gateway = start_process(config, log)
    try:

        async def forwarded() -> int:
            return sum((await committed_offsets(bootstrap, topics.group, topics.raw)).values())

        deadline = time.monotonic() + 90
        while (done := await forwarded()) < 500:  # running, the backlog in hand
            assert time.monotonic() < deadline and gateway.poll() is None, log.read_text()[-3000:]
            await asyncio.sleep(0.05)
        assert done < total, "the backlog was gone before the broker went silent"
        proxy.pause()
        stopped_at = time.monotonic()
        gateway.send_signal(signal.SIGTERM)
        code = await asyncio.to_thread(gateway.wait, 30)  # 2 s drain + at most 10 s cancel
        took = time.monotonic() - stopped_at
    finally:
        proxy.resume()
        if gateway.poll() is None:
            gateway.kill()
            gateway.wait()
    text = log.read_text()
    assert code == 1, text[-3000:]
    assert took < 2 + 10 + 3, took
    assert "not stopped 2s after the signal ([kafka] drain_timeout)" in text
    assert "Traceback" not in text, text[-3000:]

    # What was in flight is read again by the next run: nothing lost, each id once.
    kafka = settings.kafka.model_copy(update={"drain_timeout": timedelta(seconds=30)})
    config = write_toml(tmp_path / "again.toml", settings.model_copy(update={"kafka": kafka}))
    again = start_process(config, log)
    try:
        await wait_committed(bootstrap, topics.group, topics.raw, traffic.per_partition, 120)
    finally:
        again.send_signal(signal.SIGTERM)
        assert again.wait(60) == 0, log.read_text()[-3000:]
    ids = await clean_ids(bootstrap, topics.clean)
    assert set(ids) == traffic.unique_ids and max(ids.values()) == 1
