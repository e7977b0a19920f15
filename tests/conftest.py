"""Real servers for the tests: one Tansu broker per session, fresh redis-server
processes per test (cheap to start, and fault tests kill them), all on free
loopback ports under pytest's temporary folder."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from devtools.localstack import ManagedProcess, redis_server, tansu_broker


@pytest.fixture(autouse=True)
def restore_logging() -> Iterator[None]:
    """Undo what a command run in-process (`bench.run.main`, `gateway.cli`) did to the
    logging set-up: root handlers and levels are process-wide, and a later test's
    caplog would miss records below the level it left behind."""
    root, aiokafka = logging.getLogger(), logging.getLogger("aiokafka")
    handlers, level, aiokafka_level = root.handlers[:], root.level, aiokafka.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    aiokafka.setLevel(aiokafka_level)


@pytest.fixture(scope="session")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Bootstrap address of a session-wide Kafka-protocol broker."""
    proc = tansu_broker(tmp_path_factory.mktemp("broker"))
    proc.start()
    try:
        yield f"127.0.0.1:{proc.port}"
    finally:
        proc.stop()


RedisFactory = Callable[..., list[ManagedProcess]]


@pytest.fixture
def redis_servers(tmp_path: Path) -> Iterator[RedisFactory]:
    """Start `n` fresh redis-server processes; all are stopped after the test."""
    started: list[ManagedProcess] = []

    def start(n: int, password: str = "", aof: bool = False) -> list[ManagedProcess]:
        servers = [redis_server(tmp_path, f"redis-{len(started) + i}", password=password, aof=aof)
                   for i in range(n)]  # fmt: skip
        for server in servers:
            server.start()
            started.append(server)
        return servers

    yield start
    for server in started:
        server.stop()


def redis_urls(servers: list[ManagedProcess]) -> list[str]:
    return [f"redis://127.0.0.1:{s.port}/0" for s in servers]


@pytest.fixture
def names() -> Callable[[str], str]:
    """Unique topic/group names per test, so tests share the broker safely."""
    suffix = uuid.uuid4().hex[:8]
    return lambda base: f"{base}-{suffix}"
