"""`dedup-gateway run --workers 2`: SIGKILL one worker mid-stream. The supervisor
restarts it, no id is lost, duplicates stay within the batch in flight at the
kill, one /metrics serves both workers' counters, and SIGTERM drains them all.
And no worker outlives its supervisor."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from devtools.harness import clean_ids, write_toml
from devtools.localstack import free_port
from devtools.topics import committed_offsets, wait_committed
from devtools.traffic import produce_traffic

BATCH = 500


def start_supervisor(config: Path, workers: int, port: int, log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "gateway", "run", "--config", str(config),
             "--workers", str(workers)],
            stdout=out, stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", "GATEWAY_METRICS__PORT": str(port)},
        )  # fmt: skip


def tail(log: Path, chars: int = 3000) -> str:
    return log.read_text()[-chars:]


def alive(pids: set[int]) -> set[int]:
    """The pids still running (an exited, unreaped process counts as gone)."""
    running = set()
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
        except OSError:
            continue
        if state != "Z":
            running.add(pid)
    return running


def workers_of(supervisor: int) -> set[int]:
    children = Path(f"/proc/{supervisor}/task/{supervisor}/children").read_text()
    return {int(pid) for pid in children.split()}


async def wait_for(
    what: str, condition: Callable[[], bool | Awaitable[bool]], log: Path, timeout_s: float = 60
) -> None:
    """Poll `condition()` (plain or async) until true; fail with the log's tail."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        result = condition()
        if not isinstance(result, bool):
            result = await result
        if result:
            return
        assert asyncio.get_running_loop().time() < deadline, (
            f"not within {timeout_s}s: {what}\n{tail(log)}"
        )
        await asyncio.sleep(0.05)


async def ready(port: int) -> bool:
    async with aiohttp.ClientSession() as http, http.get(f"http://127.0.0.1:{port}/readyz") as r:
        return r.status == 200


async def scrape(port: int) -> dict[str, float]:
    async with aiohttp.ClientSession() as http, http.get(f"http://127.0.0.1:{port}/metrics") as r:
        text = await r.text()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


async def test_killed_worker_is_restarted_and_nothing_is_lost(broker, stack, tmp_path: Path):
    # 4 raw partitions: 2 per worker
    s = await stack(kafka={"max_batch_records": BATCH, "session_timeout": "2s"})
    topics, settings = s.topics, s.settings
    traffic = await produce_traffic(broker, topics.raw, 60_000, duplicate_share=0.3, seed=8)
    total = sum(traffic.per_partition.values())
    config = write_toml(tmp_path / "gateway.toml", settings)
    port = free_port()
    log = tmp_path / "gateway.log"
    supervisor = start_supervisor(config, 2, port, log)
    try:
        await wait_for("two workers", lambda: len(workers_of(supervisor.pid)) == 2, log)
        first = workers_of(supervisor.pid)
        await wait_for("every worker ready", lambda: ready(port), log)

        async def committing() -> bool:
            # Not every partition: on Apache Kafka the pair can read the whole stream
            # between their join and the last partition's first commit.
            return any((await committed_offsets(broker, topics.group, topics.raw)).values())

        await wait_for("the workers committing", committing, log)
        victim = min(first)
        os.kill(victim, signal.SIGKILL)
        progress = sum((await committed_offsets(broker, topics.group, topics.raw)).values())
        assert progress < total, "the stream ended before the kill: make it longer"

        def restarted() -> bool:
            now = workers_of(supervisor.pid)
            return len(now) == 2 and victim not in now

        await wait_for("the killed worker restarted", restarted, log)
        assert not await ready(port)  # until the new worker reports ready
        await wait_committed(broker, topics.group, topics.raw, traffic.per_partition, timeout_s=120)
        metrics = await scrape(port)
        assert metrics["dedup_gateway_worker_restarts_total"] == 1
        # Both workers' counters, and the killed one's, summed on the one endpoint.
        assert metrics["dedup_gateway_records_in_total"] >= total
        assert f"(pid {victim}) exited with signal SIGKILL; restarting" in tail(log, 10**7)
        survivors = workers_of(supervisor.pid)
    finally:
        supervisor.send_signal(signal.SIGTERM)  # every worker drains and commits, then exit 0
        code = supervisor.wait(timeout=60)
    assert code == 0, tail(log)
    assert not alive(survivors)

    ids = await clean_ids(broker, topics.clean)
    assert set(ids) == traffic.unique_ids  # nothing lost
    assert sum(ids.values()) - len(ids) <= BATCH  # only what was in flight at the kill


async def test_workers_do_not_outlive_a_killed_supervisor(stack, tmp_path: Path):
    s = await stack(members=1)
    settings = s.settings
    config = write_toml(tmp_path / "gateway.toml", settings)
    log = tmp_path / "gateway.log"
    port = free_port()
    supervisor = start_supervisor(config, 2, port, log)
    try:
        await wait_for("two workers", lambda: len(workers_of(supervisor.pid)) == 2, log)
        workers = workers_of(supervisor.pid)
        await wait_for("both running their data path", lambda: ready(port), log)
    finally:
        supervisor.kill()  # no chance to pass anything on
        supervisor.wait()
    # The kernel's parent-death signal stops them (they drain: nothing is in flight).
    await wait_for("the workers gone", lambda: not alive(workers), log)
