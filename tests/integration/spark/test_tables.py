"""Table output (`[spark] output_format = "delta" | "iceberg"`, spark_sink/tables.py)
against a real broker: the job writes the clean topic's ok rows into the table, and a
batch re-run after a crash, whether the crash came after the append or after the whole
batch, leaves each id once. On every Spark line with a build of the format
(`spark_sink.tables.TABLE_ARTIFACTS`): Delta on 4.0-4.2, Iceberg on 4.0 and 4.1 (`make
spark-compat SPARK=4.0.0`); skipped elsewhere."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyspark
import pytest
from pyspark.errors import StreamingQueryException
from pyspark.sql import DataFrame, SparkSession

from devtools.handlers import failing_ids
from devtools.topics import create_topics
from spark_sink.config import SinkSettings, load_sink_settings
from spark_sink.connector import spark_version
from spark_sink.job import make_sink, run_until_idle, start_query
from spark_sink.tables import (
    TABLE_ARTIFACTS,
    DeltaSink,
    IcebergSink,
    TableSink,
    use_hadoop_catalog,
)
from tests.integration.spark.session import order, produce

pytestmark = [pytest.mark.spark, pytest.mark.spark_compat]


def built_here(output_format: str) -> Any:
    return pytest.param(
        output_format,
        marks=pytest.mark.skipif(
            (output_format, spark_version()) not in TABLE_ARTIFACTS,
            reason=f"no {output_format} build for Spark {pyspark.__version__}",
        ),
    )


FORMATS = [built_here("delta"), built_here("iceberg")]
FAILING = ["o-1", "o-7", "o-8", "o-13"]


@pytest.fixture
def make_settings(broker: str, names: Callable[[str], str], tmp_path: Path):
    def make(output_format: str) -> SinkSettings:
        clean, failures = names("clean"), names("failures")
        asyncio.run(create_topics(broker, {clean: 3, failures: 1}))
        return load_sink_settings(
            kafka={"bootstrap_servers": broker, "clean_topic": clean, "failure_topic": failures},
            spark={
                "checkpoint_dir": str(tmp_path / "checkpoint"),
                "output_path": str(tmp_path / "table"),
                "output_format": output_format,
                "handler": "spark_sink.handlers:orders",
                "max_records_per_batch": 5,
            },
        )

    return make


def table_ids(spark: SparkSession, settings: SinkSettings) -> Counter[str]:
    if settings.spark.output_format == "delta":
        rows = spark.read.format("delta").load(settings.spark.output_path).collect()
    else:
        rows = spark.table(use_hadoop_catalog(spark, settings.spark.output_path)).collect()
    return Counter(r.dedup_id for r in rows)


EXPECTED = Counter(f"o-{n}" for n in range(15) if f"o-{n}" not in FAILING)


def crash(spark: SparkSession, settings: SinkSettings, sink: Any, match: str) -> None:
    query = start_query(spark, settings, sink, available_now=True)
    with pytest.raises(StreamingQueryException, match=match):
        query.awaitTermination()
    query.stop()


class CrashAfterBatch:
    """Runs the real sink, then dies in batch `crash_in`: its rows are in the table and
    its commands out, Spark has not committed the batch."""

    def __init__(self, sink: TableSink, crash_in: int) -> None:
        self.sink, self.crash_in = sink, crash_in

    def __call__(self, records: DataFrame, batch_id: int) -> None:
        self.sink(records, batch_id)
        if batch_id == self.crash_in:
            raise RuntimeError(f"simulated crash after batch {batch_id}")


@pytest.mark.parametrize("output_format", FORMATS)
def test_the_job_writes_the_table_and_a_rerun_batch_leaves_each_id_once(
    spark, broker, make_settings, output_format
):
    settings = make_settings(output_format)
    produce(broker, settings.kafka.clean_topic, [order(n, partitions=3) for n in range(15)])
    handler = failing_ids(FAILING, reason="customer blocked")
    sink = make_sink(settings, handler)
    assert isinstance(sink, DeltaSink if output_format == "delta" else IcebergSink)

    crashing = CrashAfterBatch(sink, crash_in=1)
    crash(spark, settings, crashing, "simulated crash after batch 1")
    sink.close()
    before = table_ids(spark, settings)
    assert before and max(before.values()) == 1

    report = run_until_idle(settings, spark=spark, handler=handler)
    assert table_ids(spark, settings) == EXPECTED
    assert report.output_rows == 11
    assert report.releases_published + sink.counts.releases_published == len(FAILING)


def crash_after_append(cls: type[TableSink]) -> type[TableSink]:
    """`cls` whose first append raises after it committed: the batch dies with its rows
    in the table and its staging still there, so the re-run appends them again."""

    @dataclass
    class Crashing(cls):  # type: ignore[valid-type,misc]
        crashes: int = 1

        def append(self, spark: SparkSession, rows: DataFrame, batch_id: int) -> None:
            super().append(spark, rows, batch_id)
            if self.crashes > 0:
                self.crashes -= 1
                raise RuntimeError(f"simulated crash after appending batch {batch_id}")

    return Crashing


@pytest.mark.parametrize("output_format", FORMATS)
def test_a_batch_appended_again_after_a_crash_is_not_in_the_table_twice(
    spark, broker, make_settings, output_format
):
    settings = make_settings(output_format)
    produce(broker, settings.kafka.clean_topic, [order(n, partitions=3) for n in range(15)])
    handler = failing_ids(FAILING, reason="customer blocked")
    first = make_sink(settings, handler)
    cls = crash_after_append(type(first))  # type: ignore[arg-type]
    crashing = cls(**{k: getattr(first, k) for k in first.__dataclass_fields__})
    crash(spark, settings, crashing, "simulated crash after appending batch 0")
    crashing.close()
    first_batch = table_ids(spark, settings)
    assert sum(first_batch.values()) >= 1 and max(first_batch.values()) == 1

    report = run_until_idle(settings, spark=spark, handler=handler)
    assert table_ids(spark, settings) == EXPECTED
    assert report.output_rows == 11
