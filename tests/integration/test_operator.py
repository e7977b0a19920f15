"""Operator commands run as real CLI processes against the running system."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

from gateway.topics import read_topic, wait_committed
from tests.conftest import redis_urls
from tests.integration.gateway_harness import (
    Topics,
    counter_value,
    eventually,
    failure_command,
    make_settings,
    produce,
    running,
    write_toml,
)

COPY = (b"k", b"{}", [("message-id", b"m-1")])


async def cli(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "gateway", *args, "--config", str(config)]
    return await asyncio.to_thread(subprocess.run, argv, capture_output=True, text=True, timeout=60)


async def test_inspect_shows_owner_and_ttl_and_release_lets_a_resend_through(
    broker, redis_servers, names, tmp_path
):
    topics = Topics(names)
    await topics.create(broker, raw_partitions=1, clean_partitions=1)
    settings = make_settings(broker, topics, redis_urls(redis_servers(3)))
    config = write_toml(tmp_path / "g.toml", settings)
    async with running(settings) as gateway:
        await produce(broker, topics.raw, [COPY])
        (clean,) = await read_topic(broker, topics.clean, min_records=1)
        token = dict(clean.headers)["dedup-token"].decode()

        shown = await cli(config, "inspect", "m-1")
        assert shown.returncode == 0, shown.stderr
        assert shown.stdout.count(token) == 3  # the owner on every instance
        assert "absent" not in shown.stdout

        wrong = await cli(config, "release", "m-1", "--token", "123")
        assert wrong.returncode == 1 and "NOT released" in wrong.stdout
        right = await cli(config, "release", "m-1", "--token", token)
        assert right.returncode == 0 and "released on 3 of 3" in right.stdout

        await produce(broker, topics.raw, [COPY])
        await wait_committed(broker, topics.group, topics.raw, {0: 2})
        assert counter_value(gateway.metrics.forwarded) == 2


async def test_redrive_reinjects_a_dead_letter_which_is_then_forwarded_again(
    broker, redis_servers, names, tmp_path
):
    topics = Topics(names)
    await topics.create(broker, raw_partitions=1, clean_partitions=1)
    settings = make_settings(
        broker, topics, redis_urls(redis_servers(3)),
        failures={"max_attempts": 1, "backoff_initial": "1ms"},
    )  # fmt: skip
    config = write_toml(tmp_path / "g.toml", settings)
    async with running(settings) as gateway:
        m = gateway.metrics
        await produce(broker, topics.raw, [COPY])
        (clean,) = await read_topic(broker, topics.clean, min_records=1)
        await produce(broker, topics.failures, [failure_command(clean, "bad data")])
        await eventually(lambda: counter_value(m.dead_lettered) == 1)

        result = await cli(config, "redrive")
        assert result.returncode == 0, result.stderr
        assert "1 dead-lettered record(s) re-injected" in result.stdout
        await wait_committed(broker, topics.group, topics.raw, {0: 2})
        assert counter_value(m.forwarded) == 2  # the re-injected copy is new again
        again = await cli(config, "redrive")  # progress was committed: nothing twice
        assert "0 dead-lettered record(s) re-injected" in again.stdout
    raw = await read_topic(broker, topics.raw)
    assert [dict(r.headers) for r in raw] == [{"message-id": b"m-1"}] * 2
