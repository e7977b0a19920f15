"""The whole job (run_until_idle) against a real broker: exactly-once Parquet output,
dropped duplicate deliveries, and one release command per failure."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from pyspark.errors import StreamingQueryException
from pyspark.sql import DataFrame, SparkSession

from gateway.topics import create_topics, read_topic
from spark_sink.config import SinkSettings, load_sink_settings
from spark_sink.handlers import failing_ids, orders
from spark_sink.job import connector_available, make_sink, run_until_idle, start_query
from spark_sink.sink import BatchSink
from tests.integration.spark.session import Clean, order, produce

pytestmark = pytest.mark.spark


@pytest.fixture
def make_settings(broker: str, names: Callable[[str], str], tmp_path: Path):
    """Settings on fresh clean/failure topics (3 and 1 partitions), Python source."""

    def make(**spark: Any) -> SinkSettings:
        clean, failures = names("clean"), names("failures")
        asyncio.run(create_topics(broker, {clean: 3, failures: 1}))
        return load_sink_settings(
            kafka={"bootstrap_servers": broker, "clean_topic": clean, "failure_topic": failures},
            spark={
                "checkpoint_dir": str(tmp_path / "checkpoint"),
                "output_path": str(tmp_path / "output"),
                "source": "auto",  # no connector here: picks the Python source
                **spark,
            },
        )

    return make


def output(spark: SparkSession, settings: SinkSettings) -> list[Any]:
    return spark.read.parquet(settings.spark.output_path).collect()


def release_commands(broker: str, settings: SinkSettings, expected: int) -> list[dict[str, Any]]:
    records = asyncio.run(read_topic(broker, settings.kafka.failure_topic, min_records=expected))
    commands = [json.loads(r.value) for r in records]
    assert [r.key.decode() for r in records] == [c["id"] for c in commands]
    return commands


def test_orders_are_written_once_and_invalid_ones_released_with_their_token(
    spark, broker, make_settings
):
    settings = make_settings(max_records_per_batch=10)
    records = [order(n, partitions=3) for n in range(24)]
    records[5] = order(5, partitions=3, amount=-3)
    records[9] = order(9, partitions=3, amount=None)
    records[9] = Clean(**{**records[9].__dict__, "value": b'{"order_id": "o-9", "customer": "c"}'})
    records[11] = order(11, partitions=3, amount=-1, attempt=3)
    produce(broker, settings.kafka.clean_topic, records)

    assert not connector_available(spark)  # so "auto" runs the Python source
    report = run_until_idle(settings, spark=spark)

    assert (report.input_rows, report.processed, report.failed) == (24, 24, 3)
    assert (report.written, report.output_rows, report.releases_published) == (21, 21, 3)
    assert report.batches >= 3  # 24 records, at most 10 per batch
    rows = output(spark, settings)
    assert sorted(r.dedup_id for r in rows) == sorted(
        f"o-{n}" for n in range(24) if n not in (5, 9, 11)
    )
    row = next(r for r in rows if r.dedup_id == "o-4")
    assert (row.order_id, row.customer, row.amount) == ("o-4", "c-1", 4.5)
    assert (row.dedup_source, row.partition, row.topic) == (
        "raw/1/4",
        1,
        settings.kafka.clean_topic,
    )
    assert "dedup_token" not in row.asDict()

    commands = sorted(release_commands(broker, settings, 3), key=lambda c: c["id"])
    assert commands == [
        {"id": "o-11", "token": "900011", "reason": "negative amount: -1",
         "source": {"topic": "raw", "partition": 2, "offset": 11}, "attempt": 3, "reasons": []},
        {"id": "o-5", "token": "900005", "reason": "negative amount: -3",
         "source": {"topic": "raw", "partition": 2, "offset": 5}, "attempt": 1, "reasons": []},
        {"id": "o-9", "token": "900009", "reason": "missing amount",
         "source": {"topic": "raw", "partition": 0, "offset": 9}, "attempt": 1, "reasons": []},
    ]  # fmt: skip

    # Nothing new: a second run reads nothing and publishes nothing.
    again = run_until_idle(settings, spark=spark)
    assert (again.input_rows, again.written, again.output_rows) == (0, 0, 21)
    assert len(release_commands(broker, settings, 0)) == 3


def test_duplicate_deliveries_of_an_id_are_dropped_but_a_retry_attempt_passes(
    spark, broker, make_settings
):
    """The gateway's crash window re-forwards a record under the same id (another
    offset); the sink keeps the first. A deliberate retry (attempt 2) is new work."""
    settings = make_settings(max_records_per_batch=4)
    first = [order(n, partitions=3) for n in range(6)]
    crash_copies = [order(n, partitions=3, raw_offset=100 + n) for n in (1, 2, 4)]
    retry = [order(3, partitions=3, attempt=2)]
    produce(broker, settings.kafka.clean_topic, first + crash_copies + retry)

    report = run_until_idle(settings, spark=spark)
    assert (report.input_rows, report.processed) == (10, 7)

    # A copy arriving in a later run is still inside the window (state is checkpointed).
    produce(broker, settings.kafka.clean_topic, [order(0, partitions=3, raw_offset=200)])
    later = run_until_idle(settings, spark=spark)
    assert (later.input_rows, later.processed) == (1, 0)

    ids = Counter((r.dedup_id, r.dedup_attempt) for r in output(spark, settings))
    assert ids == Counter({(f"o-{n}", 1): 1 for n in range(6)} | {("o-3", 2): 1})
    sources = {r.dedup_source for r in output(spark, settings) if r.dedup_attempt == 1}
    assert sources == {f"raw/{n % 3}/{n}" for n in range(6)}  # the first copy of each won


class CrashAfterBatch:
    """A foreachBatch function that runs the real sink, then dies in batch `crash_in`:
    output and release commands are out, Spark has not committed the batch."""

    def __init__(self, sink: BatchSink, crash_in: int) -> None:
        self.sink = sink
        self.crash_in = crash_in

    def __call__(self, records: DataFrame, batch_id: int) -> None:
        self.sink(records, batch_id)
        if batch_id == self.crash_in:
            raise RuntimeError(f"simulated crash after batch {batch_id}")


def test_rerun_batch_after_crash_outputs_each_record_once_and_releases_each_failure_once(
    spark, broker, make_settings
):
    settings = make_settings(max_records_per_batch=5)
    produce(broker, settings.kafka.clean_topic, [order(n, partitions=3) for n in range(15)])
    handler = failing_ids(["o-1", "o-7", "o-8", "o-13"], reason="customer blocked")

    crashing = CrashAfterBatch(make_sink(settings, handler), crash_in=1)
    query = start_query(spark, settings, crashing, available_now=True)
    with pytest.raises(StreamingQueryException, match="simulated crash after batch 1"):
        query.awaitTermination()
    query.stop()
    crashing.sink.close()
    published_before_crash = crashing.sink.counts.releases_published
    assert published_before_crash >= 1

    report = run_until_idle(settings, spark=spark, handler=handler)
    assert report.releases_published == 4 - published_before_crash
    rows = output(spark, settings)
    assert sorted(r.dedup_id for r in rows) == sorted(
        f"o-{n}" for n in range(15) if n not in (1, 7, 8, 13)
    )
    assert report.output_rows == 11
    commands = release_commands(broker, settings, 4)
    assert sorted(c["id"] for c in commands) == ["o-1", "o-13", "o-7", "o-8"]
    assert all(c["token"] == f"900{int(c['id'][2:]):03d}" for c in commands)
    assert {c["reason"] for c in commands} == {"customer blocked"}


def test_handler_crash_fails_the_whole_batch_and_the_stream_goes_on(spark, broker, make_settings):
    settings = make_settings(max_records_per_batch=4)
    produce(broker, settings.kafka.clean_topic, [order(n, partitions=1) for n in range(8)])

    def explodes_on_o_5(records: DataFrame) -> DataFrame:
        if records.where("dedup_id = 'o-5'").count():
            raise ValueError("cannot price o-5")
        return orders(records)

    report = run_until_idle(settings, spark=spark, handler=explodes_on_o_5)
    assert (report.processed, report.failed, report.written) == (8, 4, 4)
    assert sorted(r.dedup_id for r in output(spark, settings)) == ["o-0", "o-1", "o-2", "o-3"]
    commands = release_commands(broker, settings, 4)
    assert sorted(c["id"] for c in commands) == ["o-4", "o-5", "o-6", "o-7"]
    assert all("ValueError: cannot price o-5" in c["reason"] for c in commands)
