"""The delivery dedup against Redis (`[spark] dedup_redis`, spark_sink/redis_dedup.py):
a real redis-server, the real job on Spark's Kafka connector and a real broker.

Records go to clean partition `n % 3` (`order(n, partitions=3)`), so every repeat of a
token is in its first delivery's partition, after it: the first claim is the lowest
clean offset."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis
from pyspark.errors import StreamingQueryException
from pyspark.sql import SparkSession

from devtools.localstack import free_port, redis_server
from devtools.topics import create_topics
from gateway.config import ConfigError
from spark_sink.__main__ import main
from spark_sink.config import SinkSettings, load_sink_settings
from spark_sink.job import make_sink, run_until_idle, start_query
from spark_sink.preflight import check_dedup_redis
from spark_sink.redis_dedup import KEY_PREFIX
from tests.integration.spark.session import Clean, order, produce
from tests.integration.spark.test_job import CrashAfterBatch

pytestmark = [pytest.mark.spark]

# (dedup_id, dedup_source, dedup_attempt, clean partition, clean offset) of an output row.
Row = tuple[str, str, int, int, int]


@pytest.fixture
def topics(broker: str, names: Callable[[str], str]) -> tuple[str, str]:
    clean, failures = names("clean"), names("failures")
    asyncio.run(create_topics(broker, {clean: 3, failures: 1}))
    return clean, failures


@pytest.fixture
def dedup_redis(redis_servers) -> str:
    (server,) = redis_servers(1)
    return f"redis://127.0.0.1:{server.port}/0"


def settings_for(
    broker: str, topics: tuple[str, str], work: Path, **spark: Any
) -> SinkSettings:  # fmt: skip
    """The job on `topics` with its checkpoint and output in `work`, the dedup on."""
    clean, failures = topics
    return load_sink_settings(
        kafka={"bootstrap_servers": broker, "clean_topic": clean, "failure_topic": failures},
        spark={"checkpoint_dir": str(work / "checkpoint"), "output_path": str(work / "output"),
               "handler": "spark_sink.handlers:orders", "delivery_dedup": "on", **spark},
    )  # fmt: skip


def kept(spark: SparkSession, settings: SinkSettings) -> list[Row]:
    rows = spark.read.parquet(settings.spark.output_path).collect()
    return sorted(
        (r.dedup_id, r.dedup_source, r.dedup_attempt, r.partition, r.offset) for r in rows
    )


def claims(url: str, topic: str) -> dict[str, str]:
    """The dedup's keys for `topic` in Redis: delivery key and attempt -> "partition:offset"."""
    prefix = f"{KEY_PREFIX}{topic}:"
    with redis.Redis.from_url(url, decode_responses=True) as r:
        return {name[len(prefix) :]: r.get(name) for name in r.scan_iter(f"{prefix}*")}


def with_offsets(records: list[Clean]) -> list[tuple[Clean, int, int]]:
    """Each record with the (partition, offset) it gets on a fresh 3-partition topic,
    produced in this order."""
    next_offset = [0, 0, 0]
    placed = []
    for rec in records:
        placed.append((rec, rec.partition, next_offset[rec.partition]))
        next_offset[rec.partition] += 1
    return placed


def first_claims(placed: list[tuple[Clean, int, int]]) -> list[Row]:
    """The rows the dedup keeps: the first record of each token and attempt."""
    seen, rows = set(), []
    for rec, partition, offset in placed:
        if (rec.token, rec.attempt or 1) not in seen:
            seen.add((rec.token, rec.attempt or 1))
            rows.append((str(rec.id), str(rec.source), rec.attempt or 1, partition, offset))
    return sorted(rows)


def test_repeats_of_a_token_keep_the_first_claim_within_a_batch_and_across_batches(
    spark, broker, topics, dedup_redis, tmp_path
):
    """First run, one batch: orders 0-5, a repeat of 1 and 2 in that batch, a retry of 3
    (attempt 2) and a resend of 4 (a new raw record: a new token). Second run, a new
    batch: repeats of 0, 3 (attempt 1 and 2) and 5 are dropped; order 6 is new."""
    settings = settings_for(broker, topics, tmp_path, dedup_redis=dedup_redis)
    first = [order(n, partitions=3) for n in range(6)]
    first += [order(1, partitions=3), order(2, partitions=3), order(3, partitions=3, attempt=2)]
    first += [order(4, partitions=3, raw_offset=104)]
    later = [order(n, partitions=3) for n in (0, 3, 5)]
    later += [order(3, partitions=3, attempt=2), order(6, partitions=3)]
    placed = with_offsets([*first, *later])
    produce(broker, topics[0], first)

    report = run_until_idle(settings, spark=spark)
    assert (report.batches, report.input_rows, report.processed) == (1, 10, 8)
    produce(broker, topics[0], later)
    again = run_until_idle(settings, spark=spark)
    assert (again.batches, again.input_rows, again.processed) == (1, 5, 1)

    expected = first_claims(placed)
    assert len(expected) == 9
    assert kept(spark, settings) == expected
    # Each key holds its first claim's coordinates, and expires with the window.
    held = claims(dedup_redis, topics[0])
    assert sorted(held.values()) == sorted(f"{p}:{o}" for *_, p, o in expected)
    with redis.Redis.from_url(dedup_redis) as r:
        ttl = r.pttl(next(iter(r.scan_iter(f"{KEY_PREFIX}*"))))
    assert 0 < ttl <= settings.spark.dedup_watermark.total_seconds() * 1000


def test_a_rerun_keeps_the_same_rows_and_a_new_attempt_or_token_passes(
    spark, broker, topics, dedup_redis, tmp_path
):
    """A batch that crashed after its output was out runs again and keeps exactly its
    first run's rows (the sink checks that its input is the same); a second job reading
    the topic from the start (a fresh checkpoint, the same Redis) keeps the same rows
    again. After that, a new attempt and a new raw record of a kept order pass."""
    records = [order(n, partitions=3) for n in range(6)]
    records += [order(n, partitions=3) for n in (0, 1, 2, 4)]
    placed = with_offsets(records)
    produce(broker, topics[0], records)
    settings = settings_for(broker, topics, tmp_path / "a", dedup_redis=dedup_redis,
                            max_records_per_batch=4)  # fmt: skip

    crashing = CrashAfterBatch(make_sink(settings), crash_in=1)
    query = start_query(spark, settings, crashing, available_now=True, delivery_dedup=True)
    with pytest.raises(StreamingQueryException, match="simulated crash after batch 1"):
        query.awaitTermination()
    query.stop()
    crashing.sink.close()
    run_until_idle(settings, spark=spark)
    expected = first_claims(placed)
    assert kept(spark, settings) == expected

    second = settings_for(broker, topics, tmp_path / "b", dedup_redis=dedup_redis)
    report = run_until_idle(second, spark=spark)
    assert (report.input_rows, report.processed) == (10, 6)
    assert kept(spark, second) == expected

    new = [order(1, partitions=3, attempt=2), order(2, partitions=3, raw_offset=202)]
    produce(broker, topics[0], [*new, order(1, partitions=3, attempt=2)])
    later = run_until_idle(settings, spark=spark)
    assert (later.input_rows, later.processed) == (3, 2)
    assert kept(spark, settings) == first_claims(with_offsets([*records, *new, new[0]]))


def test_the_state_store_and_redis_keep_the_same_rows(spark, broker, topics, dedup_redis, tmp_path):
    """One input, repeats within batches and across them, through both paths."""
    records = [order(n % 7, partitions=3, attempt=1 + n // 14) for n in range(28)]
    records += [order(n, partitions=3, raw_offset=100 + n) for n in range(3)]
    produce(broker, topics[0], records)
    state = settings_for(broker, topics, tmp_path / "state", max_records_per_batch=10)
    in_redis = settings_for(broker, topics, tmp_path / "redis", max_records_per_batch=10,
                            dedup_redis=dedup_redis)  # fmt: skip

    by_state, by_redis = run_until_idle(state, spark=spark), run_until_idle(in_redis, spark=spark)
    assert by_state.batches > 2 and by_redis.batches > 2
    assert by_state.processed == by_redis.processed == 7 * 2 + 3
    assert kept(spark, state) == kept(spark, in_redis) == first_claims(with_offsets(records))


def test_redis_failing_mid_run_fails_the_batch_naming_the_setting(spark, broker, topics, tmp_path):
    """The server goes away between two runs (the Python workers hold connections to
    it): the batch fails with the setting named and nothing of it is written; with the
    server back (empty), the next run processes the batch."""
    server = redis_server(tmp_path, "dedup")
    server.start()
    settings = settings_for(
        broker, topics, tmp_path, dedup_redis=f"redis://127.0.0.1:{server.port}/0"
    )
    try:
        produce(broker, topics[0], [order(n, partitions=3) for n in range(3)])
        assert run_until_idle(settings, spark=spark).written == 3
        server.stop()
        produce(broker, topics[0], [order(n, partitions=3) for n in range(3, 6)])
        sink = make_sink(settings)
        query = start_query(spark, settings, sink, available_now=True, delivery_dedup=True)
        with pytest.raises(StreamingQueryException, match=r'\[spark\] dedup_redis = "redis://'):
            query.awaitTermination()
        query.stop()
        sink.close()
        assert (sink.counts.batches, sink.counts.written) == (0, 0)

        server.start()
        report = run_until_idle(settings, spark=spark)
    finally:
        server.stop()
    assert (report.input_rows, report.written, report.output_rows) == (3, 3, 6)


def test_redis_down_at_start_stops_the_job_in_one_line(
    broker, topics, tmp_path, capsys, restore_logging
):
    path = tmp_path / "gateway.toml"
    url = f"redis://:s3cret@127.0.0.1:{free_port()}/0"
    path.write_text(
        f'[kafka]\nbootstrap_servers = "{broker}"\nclean_topic = "{topics[0]}"\n'
        f'failure_topic = "{topics[1]}"\n'
        f'[spark]\ndelivery_dedup = "on"\ndedup_redis = "{url}"\n'
    )
    assert main(["--config", str(path), "--until-idle"]) == 3
    (line,) = capsys.readouterr().err.strip().splitlines()
    masked = url.replace("s3cret", "***")
    assert line.startswith(
        f"spark_sink: cannot connect to the delivery dedup's Redis: [spark] dedup_redis = "
        f'"{masked}" (ConnectionError: '
    ), line


def test_a_server_that_refuses_the_claim_command_stops_the_job_naming_the_setting(redis_servers):
    """An ACL without SET on the dedup's keys (as a server before 7.0 refuses NX with
    GET): a ConfigError naming the setting, exit code 2 (`spark_sink.__main__`)."""
    (server,) = redis_servers(1, password="admin-pw")
    with redis.Redis(port=server.port, password="admin-pw") as admin:
        admin.execute_command("ACL", "SETUSER", "job", "on", ">job-pw", "~*", "+@all", "-set")
    url = f"redis://job:job-pw@127.0.0.1:{server.port}/0"
    with pytest.raises(ConfigError) as err:
        check_dedup_redis(url)
    message = str(err.value)
    assert message.startswith(
        f'[spark] dedup_redis = "redis://job:***@127.0.0.1:{server.port}/0" refuses SET'
    ), message
    assert "Redis 7.0 or later" in message and "job-pw" not in message
    check_dedup_redis(f"redis://:admin-pw@127.0.0.1:{server.port}/0")  # the default user may
