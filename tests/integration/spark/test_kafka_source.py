"""The Python Kafka source against a real broker, inside real Spark queries (a subset of
its own, `-m spark_python_source`: the job reads with Spark's connector by default)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from pyspark.errors import StreamingQueryException
from pyspark.sql import DataFrame, Row, SparkSession

from devtools.topics import create_topics
from tests.integration.spark.session import (
    PYTHON_SOURCE,
    Clean,
    order,
    produce,
    skip_module_without_python_source,
    source_token,
)

skip_module_without_python_source()

from spark_sink.kafka_source import SCHEMA, register  # noqa: E402 (needs PySpark 4.2)

pytestmark = [pytest.mark.spark, *PYTHON_SOURCE]


def source(spark: SparkSession, bootstrap: str, topic: str, stream: bool = True, **options: str):
    reader = spark.readStream if stream else spark.read
    reader = reader.format(register(spark))
    for key, value in {"kafka.bootstrap.servers": bootstrap, "subscribe": topic, **options}.items():
        reader = reader.option(key, value)
    return reader.load()


def run_available_now(
    spark: SparkSession,
    df: DataFrame,
    checkpoint: Path,
    sink: Any = None,
    batches: list[tuple[int, list[Row]]] | None = None,
) -> list[tuple[int, list[Row]]]:
    """Run `df` with availableNow; returns (batch_id, rows) of every non-empty batch
    (also appended to `batches`, which survives a failing query). `sink(batch_id)`
    runs after each batch was collected."""
    batches = [] if batches is None else batches

    def collect(batch: DataFrame, batch_id: int) -> None:
        rows = batch.collect()
        if rows:
            batches.append((batch_id, rows))
        if sink is not None:
            sink(batch_id)

    query = (
        df.writeStream.foreachBatch(collect)
        .option("checkpointLocation", str(checkpoint))
        .trigger(availableNow=True)
        .start()
    )
    try:
        query.awaitTermination()
    finally:
        query.stop()
    return batches


def coords(rows: list[Row]) -> list[tuple[int, int]]:
    return sorted((r.partition, r.offset) for r in rows)


def test_batch_read_has_the_native_kafka_schema_keys_values_and_headers(spark, broker, names):
    topic = names("src-batch")
    asyncio.run(create_topics(broker, {topic: 3}))
    records = [order(n, partitions=3) for n in range(12)]
    records.append(Clean(id=None, value=None, partition=1, extra_headers=(("x", b"\x00\x01"),)))
    produce(broker, topic, records)

    df = source(spark, broker, topic, stream=False)
    assert df.schema == SCHEMA
    rows = df.collect()
    assert coords(rows) == sorted(
        [(p, o) for p in (0, 2) for o in range(4)] + [(1, o) for o in range(5)]
    )
    by_id = {r.key: r for r in rows}
    first = by_id[b"o-4"]
    assert first.topic == topic and first.partition == 1
    assert json.loads(first.value)["order_id"] == "o-4"
    assert [(h.key, bytes(h.value)) for h in first.headers] == [
        ("dedup-id", b"o-4"), ("dedup-source", b"raw/1/4"),
        ("dedup-token", source_token(1, 4).encode()),
    ]  # fmt: skip
    assert first.timestampType == 0 and first.timestamp is not None
    tombstone = by_id[None]
    assert tombstone.value is None and [(h.key, bytes(h.value)) for h in tombstone.headers] == [
        ("x", b"\x00\x01")
    ]


def test_empty_topic_gives_no_rows_and_the_stream_finishes(spark, broker, names, tmp_path):
    topic = names("src-empty")
    asyncio.run(create_topics(broker, {topic: 2}))
    assert source(spark, broker, topic, stream=False).count() == 0
    assert run_available_now(spark, source(spark, broker, topic), tmp_path / "ck") == []


def test_stream_reads_every_record_once_within_max_records_per_batch(
    spark, broker, names, tmp_path
):
    topic = names("src-limit")
    asyncio.run(create_topics(broker, {topic: 3}))
    produce(broker, topic, [order(n, partitions=3) for n in range(50)])
    # Partition 2 gets more, so the budget must be spread unevenly.
    produce(broker, topic, [Clean(id=f"x-{n}", value=b"x", partition=2) for n in range(10)])

    checkpoint = tmp_path / "ck"
    batches = run_available_now(
        spark, source(spark, broker, topic, maxOffsetsPerTrigger="7"), checkpoint
    )
    sizes = [len(rows) for _, rows in batches]
    assert max(sizes) <= 7 and sum(sizes) == 60, sizes
    rows = [r for _, batch in batches for r in batch]
    assert coords(rows) == sorted(
        [(0, o) for o in range(17)] + [(1, o) for o in range(17)] + [(2, o) for o in range(26)]
    )
    # The checkpoint journals per-partition offsets, Spark Kafka style.
    offsets_dir = checkpoint / "offsets"
    last = max((p for p in offsets_dir.iterdir() if p.name.isdigit()), key=lambda p: int(p.name))
    assert json.loads(last.read_text().splitlines()[-1]) == {topic: {"0": 17, "1": 17, "2": 26}}


def test_restart_replays_an_unfinished_batch_and_then_continues(spark, broker, names, tmp_path):
    """A query that dies in batch 1 re-runs batch 1 with the same records after a
    restart, then reads on; records produced later come in the next run only."""
    topic = names("src-restart")
    asyncio.run(create_topics(broker, {topic: 2}))
    produce(broker, topic, [order(n, partitions=2) for n in range(20)])
    checkpoint = tmp_path / "ck"

    def die_in_batch_1(batch_id: int) -> None:
        if batch_id == 1:
            raise RuntimeError("simulated crash in batch 1")

    first: list[tuple[int, list[Row]]] = []
    with pytest.raises(StreamingQueryException, match="simulated crash"):
        run_available_now(
            spark,
            source(spark, broker, topic, maxOffsetsPerTrigger="6"),
            checkpoint,
            sink=die_in_batch_1,
            batches=first,
        )
    assert [b for b, _ in first] == [0, 1]
    second = run_available_now(
        spark, source(spark, broker, topic, maxOffsetsPerTrigger="6"), checkpoint
    )
    assert second[0][0] == 1  # batch 0 committed, batch 1 re-run with the same records
    assert coords(second[0][1]) == coords(first[1][1])
    produce(broker, topic, [order(n, partitions=2) for n in range(20, 25)])
    third = run_available_now(
        spark, source(spark, broker, topic, maxOffsetsPerTrigger="6"), checkpoint
    )
    later = [r for _, rows in third for r in rows]
    assert sorted(r.key for r in later) == sorted(f"o-{n}".encode() for n in range(20, 25))
    replayed = [r for _, rows in second for r in rows]
    # batch 0 (6 records) was committed before the crash: the rest came exactly once.
    assert len(replayed) == 14 and len(set(coords(replayed))) == 14


def test_partitions_that_appear_while_running_are_read_from_their_beginning(
    spark, broker, names, tmp_path
):
    """The new partitions here are those of a subscribed topic created between two
    runs: the same path as partitions added to a topic (partitions missing from the
    checkpoint start at offset 0)."""
    first_topic, later_topic = names("src-first"), names("src-later")
    asyncio.run(create_topics(broker, {first_topic: 2}))
    produce(broker, first_topic, [order(n, partitions=2) for n in range(6)])
    checkpoint = tmp_path / "ck"
    both = f"{first_topic},{later_topic}"
    first = run_available_now(spark, source(spark, broker, both), checkpoint)
    assert {(r.topic, r.key) for _, rows in first for r in rows} == {
        (first_topic, f"o-{n}".encode()) for n in range(6)
    }

    asyncio.run(create_topics(broker, {later_topic: 3}))
    produce(broker, later_topic, [order(n, partitions=3) for n in range(6, 15)])
    produce(broker, first_topic, [order(n, partitions=2) for n in range(15, 17)])
    second = run_available_now(spark, source(spark, broker, both), checkpoint)
    rows = [r for _, batch in second for r in batch]
    assert sorted((r.topic, r.partition, r.offset) for r in rows if r.topic == later_topic) == [
        (later_topic, p, o) for p in range(3) for o in range(3)
    ]
    assert sorted(r.key for r in rows) == sorted(f"o-{n}".encode() for n in range(6, 17))
