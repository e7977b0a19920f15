"""A mistyped topic name (issue 58): never created, even on a broker that would
auto-create it (the fixture broker keeps Kafka's default
auto.create.topics.enable=true), and the gateway stays unready saying so."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import aiohttp
import pytest
from aiokafka.admin import AIOKafkaAdminClient

from devtools.harness import (
    Topics,
    clean_ids,
    make_settings,
    produce,
    redis_urls,
    running,
)
from devtools.topics import create_topics, wait_committed
from gateway.service.app import Gateway


async def _readyz(port: int) -> tuple[int, str]:
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session,
        session.get(f"http://127.0.0.1:{port}/readyz") as response,
    ):
        return response.status, await response.text()


async def listed_topics(broker: str) -> set[str]:
    admin = AIOKafkaAdminClient(bootstrap_servers=broker)
    await admin.start()
    try:
        return set(await admin.list_topics())
    finally:
        await admin.close()


async def _until_readyz(gateway: Gateway, wanted: int, timeout_s: float = 20) -> str:
    """The /readyz body once it answers `wanted` (fail after `timeout_s`)."""
    seen: list[tuple[int, str]] = []

    async def poll() -> bool:
        seen.append(await _readyz(gateway.health.port))
        return seen[-1][0] == wanted

    deadline = asyncio.get_running_loop().time() + timeout_s
    while gateway.health.port == 0 or not await poll():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"/readyz never answered {wanted}; last {seen[-1:]}")
        await asyncio.sleep(0.2)
    return seen[-1][1]


def _typo(name: str) -> tuple[str, str]:
    """`orders-<suffix>` -> `ordres-<suffix>`; `orders-clean-<suffix>` -> `orders-clen-<suffix>`."""
    if "-clean-" in name:
        return name, name.replace("-clean-", "-clen-")
    return name, name.replace("orders-", "ordres-")


@pytest.mark.parametrize("role", ["raw", "clean"])
async def test_a_mistyped_topic_is_never_created_and_holds_readyz_at_503_naming_it(
    broker, redis_servers, names, tmp_path, caplog, role
):
    topics = Topics(names)
    topics.raw, topics.clean = names("orders"), names("orders-clean")
    await topics.create(broker)
    real, typo = _typo(topics.raw if role == "raw" else topics.clean)
    key = "raw_topics" if role == "raw" else "clean_topic"
    settings = make_settings(
        broker, topics, redis_urls(redis_servers(1)),
        kafka={key: [typo] if role == "raw" else typo},
    )  # fmt: skip
    await produce(broker, topics.raw, [(b"k", b"v", [("message-id", f"m-{i}".encode())])
                                       for i in range(30)])  # fmt: skip
    config = tmp_path / "gateway.toml"
    caplog.set_level(logging.WARNING, logger="gateway")
    async with running(Gateway(settings, config=config)) as gateway:
        body = await _until_readyz(gateway, 503)
        while body.strip() == "starting":  # before the topics are checked
            body = await _until_readyz(gateway, 503)
        line = (
            f"{role} topic {typo!r} does not exist (did you mean {real!r}?): "
            f"create it: dedup-gateway topics --create --config {config}"
        )
        assert body == f"{line}\n"
        # Some more metadata refreshes and fetch rounds: still missing, still unready.
        for _ in range(10):
            assert (await _readyz(gateway.health.port))[0] == 503
            assert typo not in await listed_topics(broker)
        assert gateway.source is None  # no consumer subscribed, no record read
    assert typo not in await listed_topics(broker)
    assert not await clean_ids(broker, topics.clean, committed=False)  # none forwarded
    assert [r.getMessage() for r in caplog.records if typo in r.getMessage()][:1] == [
        f"{line}; not ready, checking again every 1s (next report in 2s)"
    ]


async def test_a_missing_topic_created_while_the_gateway_waits_makes_it_ready_by_itself(
    broker, stack, names
):
    late = names("late-raw")
    s = await stack(members=1, kafka={"raw_topics": [late]})
    topics, settings = s.topics, s.settings
    async with running(Gateway(settings, config=Path("g.toml"))) as gateway:
        body = await _until_readyz(gateway, 503)
        while body.strip() == "starting":  # before the topics are checked
            body = await _until_readyz(gateway, 503)
        assert body.startswith(f"raw topic {late!r} does not exist"), body
        assert late not in await listed_topics(broker)
        await create_topics(broker, {late: 1})
        body = await _until_readyz(gateway, 200)
        assert body == "ready\n"
        await produce(broker, late, [(b"k", b"v", [("message-id", b"late-1")])])
        await wait_committed(broker, topics.group, late, {0: 1})
    assert set(await clean_ids(broker, topics.clean)) == {"late-1"}
