"""The gateway killed while it handles failure commands: no retry lost, and none
repeated for a `read_committed` reader (`[kafka] exactly_once` resolves on here: the
retries go out in the failure loop's transactions; with it off, a retry is repeated
when the kill falls between its acknowledgement and the Redis note that it was done:
test_exactly_once.py::test_a_kill_between_a_retrys_acknowledgement_and_its_commit)."""

from __future__ import annotations

import asyncio
import random
import signal
import time
from collections import Counter
from pathlib import Path

from aiokafka import ConsumerRecord

from devtools.harness import (
    RawTuple,
    Topics,
    failure_command,
    produce,
    start_process,
    write_toml,
)
from devtools.topics import read_topic, wait_committed
from devtools.traffic import produce_traffic

IDS = 400
KILLS = 3
COMMANDS_AT_ONCE = 10


async def feed(broker: str, topics: Topics, commands: list[RawTuple]) -> None:
    """The commands as Spark sends them, a few at a time, each few once the retries of
    all but the last two are out: retries are under way until the last command, however
    long the gateway takes to start. (All at once, a read back taking milliseconds, the
    retries were over before the first kill; over a fixed 12 s, a slow start on a loaded
    host let them pile up and the same happened.)"""
    for start in range(0, len(commands), COMMANDS_AT_ONCE):
        if (done := start - 2 * COMMANDS_AT_ONCE) > 0:
            await read_topic(broker, topics.clean, min_records=IDS + done, timeout_s=120)
        await produce(broker, topics.failures, commands[start : start + COMMANDS_AT_ONCE])


def retried(records: list[ConsumerRecord[bytes, bytes]]) -> Counter[bytes]:
    """Per id, its copies with `dedup-attempt: 2` (its first retry)."""
    return Counter(
        dict(r.headers)["dedup-id"] for r in records if dict(r.headers).get("dedup-attempt") == b"2"
    )


async def test_kill_during_commands_loses_no_retry(broker, stack, tmp_path: Path):
    s = await stack(
        raw_partitions=2, clean_partitions=2,
        kafka={"session_timeout": "2s"}, failures={"backoff_initial": "1ms", "backoff_max": "5ms"},
    )  # fmt: skip
    topics, settings = s.topics, s.settings
    traffic = await produce_traffic(broker, topics.raw, IDS, duplicate_share=0.0)
    config = write_toml(tmp_path / "gateway.toml", settings)
    log = tmp_path / "gateway.log"
    proc = start_process(config, log)
    try:
        await wait_committed(broker, topics.group, topics.raw, traffic.per_partition)
        clean = await read_topic(broker, topics.clean, min_records=IDS)
        commands = [failure_command(r, "boom") for r in clean]
        feeding = asyncio.create_task(feed(broker, topics, commands))
        rng = random.Random(3)
        seen = IDS
        for _ in range(KILLS):
            # This incarnation is retrying (new clean records appear): kill it at a random moment.
            seen = len(await read_topic(broker, topics.clean, min_records=seen + 1, timeout_s=60))
            assert seen < 2 * IDS, "retries finished before the kill: make the stream longer"
            await asyncio.sleep(rng.uniform(0.0, 0.2))
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            proc = start_process(config, log)
        await feeding
        retries = await read_topic(broker, topics.clean, min_records=2 * IDS, timeout_s=120)
        # A retry repeated by a kill counts towards 2 * IDS: read on until every id's
        # retry came (it did not, ending here: the last one was taken for lost).
        deadline = time.monotonic() + 60
        while len(retried(retries)) < IDS and time.monotonic() < deadline:
            retries = await read_topic(
                broker, topics.clean, min_records=len(retries) + 1, timeout_s=5
            )
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    second = retried(retries)
    assert len(second) == IDS  # every failed record was retried: none lost
    assert max(second.values()) == 1  # each retry once: a killed one's copy was aborted
