"""A gateway started without a Redis majority, or without its broker, says so in one
line naming what it cannot reach, at a falling rate, waits unready, and serves once
it is back (a real gateway process)."""

from __future__ import annotations

import asyncio
import time

from devtools.harness import (
    Topics,
    clean_ids,
    eventually,
    make_settings,
    produce,
    redis_urls,
    start_process,
    write_toml,
)
from devtools.localstack import free_port, kafka_broker
from devtools.topics import wait_committed

REPORT = "cannot reach a Redis majority"
WINDOW_S = 7.0  # reports due at 0, 2 and 6 s; once a second would be 8


async def test_without_a_redis_majority_the_gateway_reports_at_a_falling_rate_then_serves(
    broker, stack, tmp_path
):
    s = await stack(raw_partitions=1, clean_partitions=1)
    topics, servers = s.topics, s.servers
    for server in servers[1:]:
        server.stop()
    config = write_toml(tmp_path / "gateway.toml", s.settings)
    log = tmp_path / "gateway.log"
    gateway = start_process(config, log)
    try:
        await eventually(lambda: REPORT in log.read_text(), what="the first report")
        first = time.monotonic()
        # The observation window itself is what is measured: how many lines in it.
        await asyncio.sleep(WINDOW_S - (time.monotonic() - first))
        lines = log.read_text().splitlines()
        reports = [line for line in lines if REPORT in line]
        assert not [line for line in lines if " ERROR " in line], lines
        assert 2 <= len(reports) <= 4, reports
        for line in reports:
            assert " WARNING " in line
            assert all(f"127.0.0.1:{s.port}/0" in line for s in servers[1:]), line
        assert "next report in 2s" in reports[0] and "next report in 4s" in reports[1]

        for server in servers[1:]:
            server.start()
        await produce(broker, topics.raw, [(b"k", b"v", [("message-id", b"after-1")])])
        await wait_committed(broker, topics.group, topics.raw, {0: 1})
        assert set(await clean_ids(broker, topics.clean)) == {"after-1"}
    finally:
        gateway.terminate()
        gateway.wait(30)


BROKER_REPORT = "cannot reach the Kafka broker"


async def test_without_the_broker_the_gateway_reports_at_a_falling_rate_then_serves(
    redis_servers, names, tmp_path
):
    """No broker listens yet at the configured address: one WARNING line naming it at a
    falling rate (no aiokafka ERROR per attempt), then records flow once it is up."""
    port = free_port()
    topics = Topics(names)
    servers = redis_servers(3)
    address = f"127.0.0.1:{port}"
    config = write_toml(tmp_path / "gateway.toml",
                        make_settings(address, topics, redis_urls(servers)))  # fmt: skip
    log = tmp_path / "gateway.log"
    gateway = start_process(config, log)
    broker = kafka_broker(tmp_path / "broker", port=port)
    try:
        await eventually(lambda: BROKER_REPORT in log.read_text(), what="the first report")
        first = time.monotonic()
        await asyncio.sleep(WINDOW_S - (time.monotonic() - first))  # the window measured
        lines = log.read_text().splitlines()
        reports = [line for line in lines if BROKER_REPORT in line]
        assert not [line for line in lines if " ERROR " in line], lines
        assert 2 <= len(reports) <= 4, reports
        assert all(f"at {address} (" in line and " WARNING " in line for line in reports)

        await asyncio.to_thread(broker.start)
        await topics.create(address, raw_partitions=1, clean_partitions=1)
        await produce(address, topics.raw, [(b"k", b"v", [("message-id", b"late-1")])])
        await wait_committed(address, topics.group, topics.raw, {0: 1})
        assert set(await clean_ids(address, topics.clean)) == {"late-1"}
    finally:
        gateway.terminate()
        gateway.wait(30)
        broker.stop()
