"""Bad input: set aside with its reason, never lost, never a crash."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys

import pytest

from gateway.topics import read_topic, wait_committed
from tests.conftest import redis_urls
from tests.integration.gateway_harness import (
    Topics,
    clean_ids,
    counter_value,
    eventually,
    make_settings,
    produce,
    running,
    write_toml,
)  # fmt: skip

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
    broker, redis_servers, names, id_spec, bad, reason
):
    topics = Topics(names)
    await topics.create(broker, raw_partitions=1)
    await produce(broker, topics.raw, [bad, GOOD, bad])
    settings = make_settings(
        broker, topics, redis_urls(redis_servers(1)), dedup={"id": id_spec, "max_id_bytes": 1024}
    )
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
    assert len(await clean_ids(broker, topics.clean)) == 1


async def test_gateway_waits_for_a_redis_majority_and_names_unreachable_instances(
    broker, redis_servers, names, caplog
):
    caplog.set_level(logging.INFO)
    topics = Topics(names)
    await topics.create(broker, raw_partitions=1)
    await produce(broker, topics.raw, [GOOD])
    servers = redis_servers(3)
    for server in servers[1:]:
        server.stop()
    settings = make_settings(broker, topics, redis_urls(servers))
    async with running(settings) as gateway:
        await eventually(lambda: "waiting for a Redis majority" in caplog.text)
        assert gateway.consumer is None  # not consuming without a majority
        assert not gateway.readiness()[0]
        for server in servers[1:]:
            assert f"127.0.0.1:{server.port}/0" in caplog.text
        servers[1].start()  # a majority again: it starts serving
        await wait_committed(broker, topics.group, topics.raw, {0: 1})
    assert set(await clean_ids(broker, topics.clean)) == {"m-1"}


async def test_redis_password_is_used_and_never_logged(broker, redis_servers, names, caplog):
    caplog.set_level(logging.DEBUG)
    topics = Topics(names)
    await topics.create(broker, raw_partitions=1)
    await produce(broker, topics.raw, [GOOD])
    servers = redis_servers(3, password="s3cret-pw")
    urls = [f"redis://:s3cret-pw@127.0.0.1:{s.port}/0" for s in servers]
    async with running(make_settings(broker, topics, urls)):
        await wait_committed(broker, topics.group, topics.raw, {0: 1})
    assert "s3cret-pw" not in caplog.text
    assert "starting: raw=" in caplog.text


async def test_a_wrong_redis_password_stops_start_up_naming_the_instance_not_the_password(
    broker, redis_servers, names, tmp_path
):
    topics = Topics(names)
    await topics.create(broker, raw_partitions=1)
    servers = redis_servers(3, password="right-pw")
    urls = [f"redis://:{'wrong-pw' if i == 1 else 'right-pw'}@127.0.0.1:{s.port}/0"
            for i, s in enumerate(servers)]  # fmt: skip
    config = write_toml(tmp_path / "gateway.toml", make_settings(broker, topics, urls))
    started = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-m", "gateway", "run", "--config", str(config)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert started.returncode == 2, started.stderr[-2000:]
    (last_line,) = started.stderr.strip().splitlines()[-1:]
    assert last_line.startswith("dedup-gateway: redis.nodes: credentials refused by ")
    assert f"127.0.0.1:{servers[1].port}/0" in last_line
    assert f"127.0.0.1:{servers[0].port}/0" not in last_line  # the right ones are not blamed
    assert "wrong-pw" not in started.stderr + started.stdout
    assert "right-pw" not in started.stderr + started.stdout
