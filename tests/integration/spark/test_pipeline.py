"""The whole loop: raw traffic with duplicates -> gateway -> Spark job, whose
handler fails chosen ids twice -> release commands -> gateway retries -> Spark (on
Spark's Kafka connector). Every id ends in the output exactly once."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from devtools.handlers import failing_ids
from devtools.harness import (
    Topics,
    clean_ids,
    counter_value,
    eventually,
    make_settings,
    redis_urls,
    running,
)
from devtools.topics import wait_committed
from devtools.traffic import produce_traffic
from spark_sink.config import load_sink_settings
from spark_sink.job import run_until_idle

pytestmark = [pytest.mark.spark, pytest.mark.spark_compat]


async def test_failed_ids_are_retried_by_the_gateway_and_each_id_is_output_once(
    broker, redis_servers, names, spark, tmp_path
):
    topics = Topics(names)
    await topics.create(broker)
    traffic = await produce_traffic(broker, topics.raw, 600, duplicate_share=0.3, seed=21)
    chosen = sorted(traffic.unique_ids)[:5]
    sink_settings = load_sink_settings(
        kafka={"bootstrap_servers": broker, "clean_topic": topics.clean,
               "failure_topic": topics.failures},
        spark={"checkpoint_dir": str(tmp_path / "ckpt"), "output_path": str(tmp_path / "out")},
    )  # fmt: skip
    handler = failing_ids(chosen, reason="downstream API refused", up_to_attempt=2)
    settings = make_settings(
        broker, topics, redis_urls(redis_servers(3)),
        failures={"backoff_initial": "10ms", "backoff_max": "20ms"},
    )  # fmt: skip
    async with running(settings) as gateway:
        m = gateway.metrics
        await wait_committed(broker, topics.group, topics.raw, traffic.per_partition)
        for attempt in (1, 2):  # Spark fails the chosen ids; the gateway forwards them again
            report = run_until_idle(sink_settings, spark=spark, handler=handler)
            assert report.source == "kafka"
            assert report.failed == report.releases_published == len(chosen)
            await eventually(lambda a=attempt: counter_value(m.retries, str(a + 1)) == len(chosen))
            # Committed is not yet readable: Spark's read_committed end offset (the last
            # stable offset) moves once the broker wrote the commit markers.
            await readable(broker, topics.clean, chosen, copies=attempt + 1)
        final = run_until_idle(sink_settings, spark=spark, handler=handler)
        assert final.failed == 0 and final.written == len(chosen)

    output = spark.read.parquet(str(tmp_path / "out")).collect()
    ids = Counter(r.dedup_id for r in output)
    assert set(ids) == traffic.unique_ids
    assert max(ids.values()) == 1
    assert {r.dedup_id: r.dedup_attempt for r in output if r.dedup_id in chosen} == dict.fromkeys(
        chosen, 3
    )


async def readable(broker: str, topic: str, ids: list[str], copies: int) -> None:
    """Wait until a read_committed reader sees `copies` copies of each id."""
    for _ in range(100):
        seen = await clean_ids(broker, topic)
        if all(seen[i] == copies for i in ids):
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"{copies} copies of {ids} not readable: {[seen[i] for i in ids]}")
