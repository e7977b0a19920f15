"""A real Prometheus scrapes a real gateway process: every series the dashboard
and the alert rules query exists and has data, every query and rule evaluates
without error, and /readyz follows the Redis majority.

The gateway runs as `python -m gateway run --config FILE` against the session
broker and three redis-server processes; Prometheus (the Debian `prometheus`
binary) uses deploy/prometheus/prometheus.yml with a static target and a 1 s
scrape interval, and loads deploy/prometheus/alerts.yml.
"""

from __future__ import annotations

import asyncio
import functools
import json
import subprocess
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from devtools.harness import (
    RawTuple,
    Topics,
    failure_command,
    produce,
    redis_urls,
    start_process,
)
from devtools.localstack import ManagedProcess, free_port, wait_for_port
from devtools.topics import create_topics, read_topic
from tests.deployment.conftest import (
    ALERTS,
    PROMETHEUS_CONFIG,
    alert_exprs,
    as_instant_query,
    dashboard_exprs,
    queried_series_names,
    tool,
)

pytestmark = pytest.mark.timeout(180)

DEADLINE_S = 40.0
# Series that exist only after Redis calls fail (the fault phase of the test).
FAULT_SERIES = {"dedup_gateway_redis_errors_total", "dedup_gateway_votes_undecided_total"}


def gateway_toml(path: Path, broker: str, topics: Topics, redis: list[str], port: int) -> Path:
    path.write_text(
        f"""
[kafka]
bootstrap_servers = "{broker}"
raw_topics = ["{topics.raw}"]
clean_topic = "{topics.clean}"
failure_topic = "{topics.failures}"
quarantine_topic = "{topics.quarantine}"
dead_letter_topic = "{topics.dead}"
group_id = "{topics.group}"
max_batch_records = 500

[redis]
nodes = {json.dumps(redis)}
timeout = "200ms"

[dedup]
id = "header:message-id"
on_no_quorum = "block"
retry_backoff_initial = "100ms"
retry_backoff_max = "500ms"

[failures]
mode = "retry"
max_attempts = 2
backoff_initial = "100ms"
backoff_max = "200ms"

[delay]
enabled = true
tiers = ["1s"]

[metrics]
host = "127.0.0.1"
port = {port}
"""
    )
    return path


def prometheus_config(tmp: Path, target_port: int) -> Path:
    """deploy/prometheus/prometheus.yml with a static target and 1 s intervals."""
    config: dict[str, Any] = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    config["global"].update(scrape_interval="1s", evaluation_interval="1s")
    config["rule_files"] = [str(ALERTS)]
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "dedup-gateway"]
    config["scrape_configs"] = [job]  # no Spark job runs here (test_cluster.py scrapes one)
    del job["dns_sd_configs"]
    job["static_configs"] = [{"targets": [f"127.0.0.1:{target_port}"]}]
    path = tmp / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[Callable[[int], ManagedProcess]]:
    started: list[ManagedProcess] = []

    def start(target_port: int) -> ManagedProcess:
        port = free_port()
        work = tmp_path / "prometheus"
        work.mkdir()
        argv = [tool("prometheus"), f"--config.file={prometheus_config(work, target_port)}",
                f"--storage.tsdb.path={work / 'data'}", f"--web.listen-address=127.0.0.1:{port}",
                "--log.level=warn"]  # fmt: skip
        proc = ManagedProcess("prometheus", port, argv, work / "prometheus.log")
        proc.start()
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.stop()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
        yield session


class PromAPI:
    def __init__(self, http: aiohttp.ClientSession, port: int) -> None:
        self.http = http
        self.base = f"http://127.0.0.1:{port}/api/v1"

    async def query(self, expr: str) -> list[dict[str, Any]]:
        async with self.http.get(f"{self.base}/query", params={"query": expr}) as resp:
            body = await resp.json()
        assert body["status"] == "success", f"{expr!r}: {body}"
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    async def rules(self) -> list[dict[str, Any]]:
        async with self.http.get(f"{self.base}/rules") as resp:
            body = await resp.json()
        return [rule for group in body["data"]["groups"] for rule in group["rules"]]

    async def missing(self, names: set[str]) -> set[str]:
        """The series names Prometheus has no sample of right now."""
        return {n for n in names if not await self.query(f'{{__name__="{n}"}}')}

    async def until_present(self, names: set[str], what: str) -> None:
        deadline = time.monotonic() + DEADLINE_S
        while missing := await self.missing(names):
            if time.monotonic() > deadline:
                raise AssertionError(f"{what}: no samples of {sorted(missing)} in {DEADLINE_S}s")
            await asyncio.sleep(0.25)


async def until(check: Callable[[], Any], what: str, timeout_s: float = DEADLINE_S) -> Any:
    """Poll the async `check` until it returns a truthy value; fail after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        last = await check()
        if last:
            return last
        await asyncio.sleep(0.25)
    raise AssertionError(f"not within {timeout_s}s: {what} (last: {last!r})")


async def status(http: aiohttp.ClientSession, port: int, path: str) -> int | None:
    try:
        async with http.get(f"http://127.0.0.1:{port}{path}") as resp:
            return resp.status
    except aiohttp.ClientError:
        return None


def copies(prefix: str, count: int) -> list[RawTuple]:
    return [(b"k", b'{"n": %d}' % i, [("message-id", f"{prefix}-{i}".encode())])
            for i in range(count)]  # fmt: skip


async def test_prometheus_scrapes_every_queried_series_and_readyz_follows_the_redis_majority(
    broker: str, redis_servers: Any, names: Callable[[str], str], prometheus: Any,
    http: aiohttp.ClientSession, tmp_path: Path,
) -> None:  # fmt: skip
    topics = Topics(names)
    await topics.create(broker, raw_partitions=2, clean_partitions=1)
    await create_topics(broker, {f"{topics.clean}.delay.1s": 1})  # scheduled delivery's tier
    servers = redis_servers(3)
    port = free_port()
    config = gateway_toml(tmp_path / "gateway.toml", broker, topics, redis_urls(servers), port)
    gateway = start_process(config, tmp_path / "gateway.log")
    try:
        await asyncio.to_thread(wait_for_port, port, gateway, "gateway")
        prom = PromAPI(http, prometheus(port).port)
        await run_scenario(broker, topics, servers, port, http, prom)
    except BaseException:
        print((tmp_path / "gateway.log").read_text()[-5000:])
        raise
    finally:
        gateway.terminate()
        try:
            gateway.wait(timeout=30)
        except subprocess.TimeoutExpired:
            gateway.kill()
            gateway.wait()


async def run_scenario(
    broker: str, topics: Topics, servers: list[ManagedProcess], port: int,
    http: aiohttp.ClientSession, prom: PromAPI,
) -> None:  # fmt: skip
    queried = queried_series_names()

    # Traffic: new records, duplicates of some, one record without an id.
    await produce(broker, topics.raw, copies("m", 10), partition=0)
    await produce(broker, topics.raw, copies("m", 5), partition=1)
    await produce(broker, topics.raw, [(b"k", b"{}", [])], partition=1)
    delayed = [("message-id", b"later-1"), ("deliver-after", b"10m")]  # waits in the tier
    await produce(broker, topics.raw, [(b"k", b"{}", delayed)], partition=1)
    await until(lambda: _is(status(http, port, "/readyz"), 200), "/readyz 200")

    # Failure loop: one retry (attempt 1 of 2), one dead letter (attempt 2 of 2),
    # one command that is not JSON.
    clean = await read_topic(broker, topics.clean, min_records=10)
    first, second = clean[0], clean[1]
    key, value, headers = failure_command(second, "still failing")
    assert value is not None
    dead = json.loads(value)
    dead["attempt"] = 2
    await produce(broker, topics.failures, [
        failure_command(first, "api down"), (key, json.dumps(dead).encode(), headers),
        (b"x", b"not json", []),
    ])  # fmt: skip

    healthy_series = queried - FAULT_SERIES
    await prom.until_present(healthy_series, "after traffic and failure commands")

    # Lose the majority: 2 of 3 instances hang (SIGSTOP: a restart would come back
    # empty, i.e. recovering, and rightly stay uncounted); records cannot be decided.
    servers[0].pause()
    servers[1].pause()
    await produce(broker, topics.raw, copies("n", 5), partition=0)
    await until(lambda: _is(status(http, port, "/readyz"), 503), "/readyz 503 without a majority")
    await prom.until_present(queried, "after losing the Redis majority")
    for alert in ("DedupGatewayQuorumLost", "DedupGatewayPartitionsBlocked"):
        firing = f'ALERTS{{alertname="{alert}"}}'  # pending until its `for:` has passed
        await until(functools.partial(prom.query, firing), f"{alert} pending")
    assert (await prom.query("dedup_gateway_quorum_healthy"))[0]["value"][1] == "0"

    # The majority is back: the blocked partition is retried and the gateway is ready.
    servers[0].resume()
    servers[1].resume()
    await until(lambda: _is(status(http, port, "/readyz"), 200), "/readyz 200 again")

    # Every query of the dashboard and every alert rule evaluates on real data.
    for expr in [*dashboard_exprs(), *alert_exprs()]:
        await prom.query(as_instant_query(expr))
    rules = await until(prom.rules, "rules loaded")
    assert len(rules) == len(alert_exprs())
    for rule in rules:
        assert rule["health"] != "err", f"{rule['name']}: {rule.get('lastError')}"
    redis_labels = await prom.query("dedup_gateway_redis_up")
    assert {r["metric"].get("redis") for r in redis_labels} == {s.name_label for s in servers}, (
        "Redis metrics name their member in the `redis` label"
    )


async def _is(awaitable: Any, expected: Any) -> bool:
    return bool(await awaitable == expected)
