"""The integration tests' `stack`: the topics of one test, N Redis members and the
settings that join them, the lines ~70 tests opened with."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from devtools.harness import Topics, make_settings, redis_urls
from devtools.localstack import ManagedProcess
from devtools.proxy import TcpProxy, proxied
from devtools.topics import create_topics
from gateway.config import Settings
from gateway.rules.tiers import tier_topics

# The members' URL for a test of the Kafka side alone (`members=0`): nothing listens there.
NO_MEMBER = "redis://127.0.0.1:1/0"


@dataclass
class Stack:
    broker: str
    topics: Topics
    servers: list[ManagedProcess]  # the members' redis-servers, in `[redis] nodes` order
    settings: Settings


StackFactory = Callable[..., Awaitable[Stack]]


@pytest.fixture
def stack(broker: str, redis_servers: Any, names: Any) -> StackFactory:
    """`await stack(members=3, raw_partitions=4, clean_partitions=4, **sections)`: the
    topics created, the members started, the settings with `sections` as overrides
    (`make_settings`).

    `members=0`: no redis-server, the settings name one nothing listens on.
    `password`, `aof`, `native`: how the members are started (`redis_servers`); the
    settings' URLs carry the password.
    `tier_partitions`: the settings' delay tier topics created too, with as many
    partitions each (none by default)."""

    async def build(
        members: int = 3,
        raw_partitions: int = 4,
        clean_partitions: int = 4,
        *,
        password: str = "",
        aof: bool = False,
        native: bool = False,
        tier_partitions: int = 0,
        **sections: Any,
    ) -> Stack:
        topics = Topics(names)
        await topics.create(
            broker, raw_partitions=raw_partitions, clean_partitions=clean_partitions
        )
        servers = redis_servers(members, password=password, aof=aof, native=native)
        urls = redis_urls(servers) or [NO_MEMBER]
        if password:  # redis://:PASSWORD@host:port/db
            urls = [url.replace("redis://", f"redis://:{password}@", 1) for url in urls]
        settings = make_settings(broker, topics, urls, **sections)
        if tier_partitions:
            await create_topics(broker, dict.fromkeys(tier_topics(settings), tier_partitions))
        return Stack(broker, topics, servers, settings)

    return build


@pytest.fixture
async def proxied_broker(tmp_path: Path) -> AsyncIterator[tuple[str, TcpProxy]]:
    async with proxied(tmp_path) as broker:
        yield broker
