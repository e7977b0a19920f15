"""deploy/loadgen/loadgen.py, the compose stack's demo producer, run as compose
runs it (a script with only aiokafka) against the test broker: what it
produces, its duplicate share, its pacing, and its stop on SIGTERM."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from tests.deployment.conftest import DEPLOY

pytestmark = pytest.mark.timeout(120)

LOADGEN = DEPLOY / "loadgen" / "loadgen.py"
PARTITIONS = 3
DEADLINE_S = 30.0


async def create_topic(broker: str, topic: str) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=broker)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(topic, PARTITIONS, 1)])
    finally:
        await admin.close()


async def read(broker: str, topic: str, at_least: int) -> list[Any]:
    """Every record of `topic` from the start, once at least `at_least` are there
    (fails after DEADLINE_S), plus what three more fetches bring: it reads by
    fetching, asking the broker for no offsets."""
    consumer = AIOKafkaConsumer(bootstrap_servers=broker, enable_auto_commit=False)
    await consumer.start()
    try:
        consumer.assign([TopicPartition(topic, p) for p in range(PARTITIONS)])
        await consumer.seek_to_beginning()
        records: list[Any] = []
        deadline = time.monotonic() + DEADLINE_S
        while len(records) < at_least:
            assert time.monotonic() < deadline, f"{len(records)} of {at_least} records"
            batches = await consumer.getmany(timeout_ms=200)
            records.extend(r for batch in batches.values() for r in batch)
        for _ in range(3):  # anything beyond `at_least` that is already there
            batches = await consumer.getmany(timeout_ms=200)
            records.extend(r for batch in batches.values() for r in batch)
        return records
    finally:
        await consumer.stop()


def loadgen_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("LOADGEN_")}


async def start(broker: str, topic: str, *args: str) -> asyncio.subprocess.Process:
    argv = [str(LOADGEN), "--bootstrap", broker, "--topic", topic, *args]
    return await asyncio.create_subprocess_exec(
        sys.executable, *argv, env=loadgen_env(),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip


async def finish(proc: asyncio.subprocess.Process) -> dict[str, Any]:
    out, err = await asyncio.wait_for(proc.communicate(), DEADLINE_S)
    assert proc.returncode == 0, err.decode()
    summary: dict[str, Any] = json.loads(out.decode().strip().splitlines()[-1])
    return summary


async def test_loadgen_sends_json_orders_with_ids_and_the_requested_share_of_duplicates(
    broker: str, names: Callable[[str], str]
) -> None:
    topic = names("loadgen")
    await create_topic(broker, topic)
    proc = await start(broker, topic, "--records", "3000", "--duplicates", "0.3",
                       "--rate", "0", "--seed", "7")  # fmt: skip
    summary = await finish(proc)
    assert summary["sent"] == 3000
    records = await read(broker, topic, 3000)
    assert len(records) == 3000

    values: dict[str, set[bytes]] = defaultdict(set)
    partitions: dict[str, set[int]] = defaultdict(set)
    for record in records:
        (message_id,) = [v.decode() for k, v in record.headers if k == "message-id"]
        order = json.loads(record.value)
        assert order["order_id"] == message_id
        assert order["customer"] and float(order["amount"]) >= 0
        values[message_id].add(record.value)
        partitions[message_id].add(record.partition)
    assert all(len(v) == 1 for v in values.values()), "a duplicate must repeat the value"
    assert len(values) == summary["sent"] - summary["duplicates"]
    assert 0.25 < summary["duplicates"] / summary["sent"] < 0.35
    assert any(len(p) > 1 for p in partitions.values()), "copies should spread over partitions"


async def test_loadgen_keeps_its_rate_and_flushes_everything_on_sigterm(
    broker: str, names: Callable[[str], str]
) -> None:
    topic = names("loadgen")
    await create_topic(broker, topic)
    rate = 100
    started = time.monotonic()
    proc = await start(broker, topic, "--rate", str(rate), "--duplicates", "0")
    try:
        await read(broker, topic, 20)  # it is producing
    except BaseException:
        proc.kill()
        raise
    proc.send_signal(signal.SIGTERM)
    summary = await finish(proc)
    elapsed = time.monotonic() - started
    assert summary["duplicates"] == 0
    assert 20 <= summary["sent"] <= rate * elapsed + 10, "paced at --rate"
    records = await read(broker, topic, summary["sent"])
    assert len(records) == summary["sent"], "everything sent before SIGTERM is on the topic"


def test_loadgen_refuses_a_duplicate_share_of_one_or_more(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(LOADGEN), "--duplicates", "1"],
        capture_output=True, text=True, timeout=30, env=loadgen_env(), cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 2 and "--duplicates" in result.stderr
