"""Run gateways against local servers: in-process tasks, or real processes (for
SIGKILL tests), with settings built through the real config loader. Used by the
tests, the demo and the benchmark."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import subprocess
import sys
from collections import Counter
from collections.abc import AsyncIterator, Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

from aiokafka import AIOKafkaProducer, ConsumerRecord

from devtools.localstack import ManagedProcess
from devtools.topics import create_topics, read_topic
from gateway.config import Settings, load_settings
from gateway.metrics import total
from gateway.service.app import Gateway


class Topics:
    def __init__(self, names: Callable[[str], str]) -> None:
        self.raw = names("raw")
        self.clean = names("clean")
        self.failures = names("failures")
        self.quarantine = names("quarantine")
        self.dead = names("dead")
        self.group = names("group")

    async def create(
        self, bootstrap: str, raw_partitions: int = 4, clean_partitions: int = 4
    ) -> None:
        await create_topics(
            bootstrap,
            {self.raw: raw_partitions, self.clean: clean_partitions, self.failures: 2,
             self.quarantine: 1, self.dead: 1},
        )  # fmt: skip


def make_settings(bootstrap: str, topics: Topics, redis: list[str], **sections: Any) -> Settings:
    config: dict[str, Any] = {
        "kafka": {
            "bootstrap_servers": bootstrap, "raw_topics": [topics.raw],
            "clean_topic": topics.clean, "failure_topic": topics.failures,
            "quarantine_topic": topics.quarantine, "dead_letter_topic": topics.dead,
            "group_id": topics.group, "max_batch_records": 500,
        },
        "redis": {"nodes": redis, "timeout": "300ms"},
        "dedup": {"retry_backoff_initial": "50ms", "retry_backoff_max": "500ms"},
        "metrics": {"host": "127.0.0.1", "port": 0},
    }  # fmt: skip
    for section, values in sections.items():
        if isinstance(values, dict):
            config.setdefault(section, {}).update(values)
        else:  # a list of tables, e.g. lanes
            config[section] = values
    if "lanes" in sections:  # the lanes name the raw topics
        del config["kafka"]["raw_topics"]
    return load_settings(**config)


@contextlib.asynccontextmanager
async def running(settings: Settings | Gateway) -> AsyncIterator[Gateway]:
    """A gateway as a task of this event loop; stopped (drained) on exit."""
    stop = asyncio.Event()
    gateway = settings if isinstance(settings, Gateway) else Gateway(settings)
    task = asyncio.create_task(gateway.run(stop))
    gateway_tasks[gateway] = task
    try:
        yield gateway
    finally:
        stop.set()
        gateway_tasks.pop(gateway, None)
        await asyncio.wait_for(task, 30)


# The task running each gateway started by `running`, to surface its errors.
gateway_tasks: dict[Gateway, asyncio.Task[None]] = {}


async def until(
    gateway: Gateway,
    done: Callable[[], bool],
    *,
    poll_s: float = 0.01,
    timeout_s: float | None = None,
) -> None:
    """Wait until `done()` holds for a gateway started by `running`.

    Raises the gateway's own error if it stops first, TimeoutError after `timeout_s`.
    """
    task = gateway_tasks[gateway]
    loop = asyncio.get_running_loop()
    deadline = None if timeout_s is None else loop.time() + timeout_s
    while not done():
        if task.done():
            task.result()  # surface the gateway's error
            raise RuntimeError("the gateway stopped before the run finished")
        if deadline is not None and loop.time() > deadline:
            raise TimeoutError(f"gateway not done within {timeout_s}s")
        await asyncio.sleep(poll_s)


async def run_gateway_until(
    gateway: Gateway,
    done: Callable[[], bool],
    *,
    poll_s: float = 0.01,
    timeout_s: float | None = None,
) -> None:
    """Run `gateway` until `done()` holds, then stop it (drained)."""
    async with running(gateway):
        await until(gateway, done, poll_s=poll_s, timeout_s=timeout_s)


def write_toml(path: Path, settings: Settings) -> Path:
    """The settings as a TOML file, for a gateway run as a real process."""
    k, r, d = settings.kafka, settings.redis, settings.dedup
    lines = [
        "[kafka]",
        f'bootstrap_servers = "{k.bootstrap_servers}"',
        f"raw_topics = {k.raw_topics!r}".replace("'", '"'),
        f'clean_topic = "{k.clean_topic}"',
        f'failure_topic = "{k.failure_topic}"',
        f'quarantine_topic = "{k.quarantine_topic}"',
        f'dead_letter_topic = "{k.dead_letter_topic}"',
        f'group_id = "{k.group_id}"',
        f"max_batch_records = {k.max_batch_records}",
        f'session_timeout = "{int(k.session_timeout.total_seconds() * 1000)}ms"',
        f'exactly_once = "{k.exactly_once}"',
        f'transaction_timeout = "{int(k.transaction_timeout.total_seconds() * 1000)}ms"',
        f'drain_timeout = "{int(k.drain_timeout.total_seconds() * 1000)}ms"',
        *([f'group_instance_id = "{k.group_instance_id}"'] if k.group_instance_id else []),
        "[redis]",
        "nodes = [" + ", ".join(f'"{n}"' for n in r.nodes) + "]",
        f'timeout = "{int(r.timeout.total_seconds() * 1000)}ms"',
        "[failures]",
        f'mode = "{settings.failures.mode}"',
        f"max_attempts = {settings.failures.max_attempts}",
        f'backoff_initial = "{settings.failures.backoff_initial.total_seconds() * 1000:g}ms"',
        f'backoff_max = "{settings.failures.backoff_max.total_seconds() * 1000:g}ms"',
        "[dedup]",
        f'id = "{d.id}"',
        f'on_no_quorum = "{d.on_no_quorum}"',
        "[metrics]",
        'host = "127.0.0.1"',
        "port = 0",
    ]
    delay = settings.delay
    if delay.enabled:
        tiers = ", ".join(f'"{t // timedelta(milliseconds=1)}ms"' for t in delay.tiers)
        lines += [
            "[delay]",
            "enabled = true",
            f"tiers = [{tiers}]",
            f'max_delay = "{delay.max_delay // timedelta(milliseconds=1)}ms"',
            f'deliver_at_header = "{delay.deliver_at_header}"',
            f'deliver_after_header = "{delay.deliver_after_header}"',
        ]
    coalesce = settings.coalesce
    if coalesce.enabled:
        ms = timedelta(milliseconds=1)
        lines += [
            "[coalesce]",
            "enabled = true",
            f'key = "{coalesce.key}"',
            f'mode = "{coalesce.mode}"',
            f'window = "{coalesce.window // ms}ms"',
            f'max_window = "{coalesce.max_window // ms}ms"',
            f'grace = "{coalesce.grace // ms}ms"',
        ]
    path.write_text("\n".join(lines) + "\n")
    return path


def start_process(config: Path, log: Path) -> subprocess.Popen[bytes]:
    """`python -m gateway run --config FILE` as a child process."""
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "gateway", "run", "--config", str(config)],
            stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )  # fmt: skip


def ids_of(records: list[ConsumerRecord[bytes, bytes]]) -> Counter[str]:
    return Counter(dict(r.headers)["dedup-id"].decode() for r in records)


async def clean_ids(bootstrap: str, topic: str, committed: bool = True) -> Counter[str]:
    """The ids on the clean topic, as a `read_committed` reader sees them (or not)."""
    return ids_of(await read_topic(bootstrap, topic, committed=committed))


RawTuple = tuple[bytes | None, bytes | None, list[tuple[str, bytes]]]


async def produce(bootstrap: str, topic: str, records: list[RawTuple], partition: int = 0) -> None:
    """Produce (key, value, headers) records to one partition, in order."""
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap)
    await producer.start()
    try:
        for key, value, headers in records:
            await producer.send_and_wait(
                topic, value, key=key, partition=partition, headers=headers
            )
    finally:
        await producer.stop()


def counter_value(counter: Any, *labels: str) -> float:
    """Current value of a prometheus_client counter (the child with these label values)."""
    return total(counter, **dict(zip(counter._labelnames, labels, strict=True)))


async def eventually(condition: Callable[[], bool], timeout_s: float = 30, what: str = "") -> None:
    """Poll `condition` until it holds; fail the test after `timeout_s`."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"not within {timeout_s}s: {what or condition}")
        await asyncio.sleep(0.02)


def failure_command(clean: ConsumerRecord[bytes, bytes], reason: str) -> RawTuple:
    """The release command the Spark job sends for a clean record that failed: the id
    readable (invalid UTF-8 replaced, as Spark's string cast does) and exact (`id_b64`)."""
    headers = dict(clean.headers)
    topic, partition, offset = headers["dedup-source"].decode().rsplit("/", 2)
    body = {
        "id": headers["dedup-id"].decode(errors="replace"),
        "id_b64": base64.b64encode(headers["dedup-id"]).decode(),
        "token": headers["dedup-token"].decode(),
        "reason": reason,
        "source": {"topic": topic, "partition": int(partition), "offset": int(offset)},
        "attempt": int(headers.get("dedup-attempt", b"1")),
        "reasons": json.loads(headers.get("dedup-reasons", b"[]")),
    }
    return headers["dedup-id"], json.dumps(body).encode(), []


def redis_urls(servers: list[ManagedProcess]) -> list[str]:
    """The members' URLs of `redis-server`s started by the tests' fixtures."""
    return [f"redis://127.0.0.1:{s.port}/0" for s in servers]
