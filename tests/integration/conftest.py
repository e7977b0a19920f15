"""The integration tests' `stack`: the topics of one test, N Redis members and the
settings that join them, the lines ~70 tests opened with."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import pytest

from devtools.harness import Topics, make_settings, redis_urls
from devtools.localstack import ManagedProcess
from gateway.config import Settings


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
    (`make_settings`)."""

    async def build(
        members: int = 3, raw_partitions: int = 4, clean_partitions: int = 4, **sections: Any
    ) -> Stack:
        topics = Topics(names)
        await topics.create(
            broker, raw_partitions=raw_partitions, clean_partitions=clean_partitions
        )
        servers = redis_servers(members)
        settings = make_settings(broker, topics, redis_urls(servers), **sections)
        return Stack(broker, topics, servers, settings)

    return build
