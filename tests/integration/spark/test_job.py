"""The whole job (run_until_idle) against a real broker: exactly-once Parquet output,
dropped duplicate deliveries, and one release command per failure. On Spark's Kafka
connector (the shared session has it, as the job has it by default); the tests
parametrized with `source` run on the Python source too (`-m spark_python_source`)."""

from __future__ import annotations

import asyncio
import base64
import json
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Producer
from pyspark.errors import StreamingQueryException
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from devtools.handlers import failing_ids
from devtools.topics import create_topics, read_topic
from spark_sink.config import SinkSettings, load_sink_settings
from spark_sink.connector import connector_available, spark_version
from spark_sink.files import CheckpointFiles
from spark_sink.handlers import orders
from spark_sink.job import make_sink, run_until_idle, start_query
from spark_sink.sink import OUTCOMES_MARKER, BatchSink, parse_outcomes_marker
from tests.integration.spark.session import PYTHON_SOURCE, Clean, order, produce, source_token

pytestmark = [pytest.mark.spark, pytest.mark.spark_compat]

# "kafka": `source = "auto"`, which finds the connector; "python": the Python source.
SOURCES = ["kafka", pytest.param("python", marks=PYTHON_SOURCE)]


def rerun_input(rows: int) -> int:
    """The input rows a run reports for a batch it re-ran after a crash: none on Spark 4.1,
    whose connector fails that batch's progress report (SPARK-55271; the job then starts
    the query again, `job.connector_progress_bug`)."""
    return 0 if spark_version() == (4, 1) else rows


@pytest.fixture
def make_settings(broker: str, names: Callable[[str], str], tmp_path: Path):
    """Settings on fresh clean/failure topics (3 and 1 partitions); `source` "kafka"
    (the default: `auto`, which picks Spark's connector) or "python"."""

    def make(source: str = "kafka", **spark: Any) -> SinkSettings:
        clean, failures = names("clean"), names("failures")
        asyncio.run(create_topics(broker, {clean: 3, failures: 1}))
        return load_sink_settings(
            kafka={"bootstrap_servers": broker, "clean_topic": clean, "failure_topic": failures},
            spark={
                "checkpoint_dir": str(tmp_path / "checkpoint"),
                "output_path": str(tmp_path / "output"),
                "source": "auto" if source == "kafka" else source,
                # The tests' records are JSON orders; the default handler passes everything.
                "handler": "spark_sink.handlers:orders",
                **spark,
            },
        )

    return make


def output(spark: SparkSession, settings: SinkSettings) -> list[Any]:
    return spark.read.parquet(settings.spark.output_path).collect()


def release_commands(broker: str, settings: SinkSettings, expected: int) -> list[dict[str, Any]]:
    records = asyncio.run(read_topic(broker, settings.kafka.failure_topic, min_records=expected))
    commands = [json.loads(r.value) for r in records]
    assert [r.key for r in records] == [base64.b64decode(c["id_b64"]) for c in commands]
    return commands


@pytest.mark.parametrize("source", SOURCES)
def test_orders_are_written_once_and_invalid_ones_released_with_their_token(
    spark, broker, make_settings, source
):
    settings = make_settings(source, max_records_per_batch=10)
    records = [order(n, partitions=3) for n in range(24)]
    records[5] = order(5, partitions=3, amount=-3)
    records[9] = order(9, partitions=3, amount=None)
    records[9] = Clean(**{**records[9].__dict__, "value": b'{"order_id": "o-9", "customer": "c"}'})
    records[11] = order(11, partitions=3, amount=-1, attempt=3)
    produce(broker, settings.kafka.clean_topic, records)

    assert connector_available(spark)  # so "auto" picks it
    report = run_until_idle(settings, spark=spark)
    assert report.source == source

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
        {"id": "o-11", "id_b64": "by0xMQ==", "token": source_token(2, 11, 3),
         "reason": "negative amount: -1",
         "source": {"topic": "raw", "partition": 2, "offset": 11}, "attempt": 3, "reasons": []},
        {"id": "o-5", "id_b64": "by01", "token": source_token(2, 5),
         "reason": "negative amount: -3",
         "source": {"topic": "raw", "partition": 2, "offset": 5}, "attempt": 1, "reasons": []},
        {"id": "o-9", "id_b64": "by05", "token": source_token(0, 9), "reason": "missing amount",
         "source": {"topic": "raw", "partition": 0, "offset": 9}, "attempt": 1, "reasons": []},
    ]  # fmt: skip

    # Nothing new: a second run reads nothing and publishes nothing.
    again = run_until_idle(settings, spark=spark)
    assert (again.input_rows, again.written, again.output_rows) == (0, 0, 21)
    assert len(release_commands(broker, settings, 0)) == 3


@pytest.mark.parametrize("source", SOURCES)
def test_a_replayed_delivery_is_dropped_and_each_new_source_record_or_attempt_passes(
    spark, broker, make_settings, source
):
    """The gateway's crash window forwards one raw record again, with the same token:
    the sink keeps the first. A retry (next attempt), a producer resend after a
    release and an operator redrive are new source records or attempts under the same
    id, with new tokens: each is new work. `delivery_dedup = "auto"` on an at-least-once
    clean topic (`[kafka] exactly_once = "off"`) is on."""
    settings = make_settings(source, max_records_per_batch=4)
    settings.kafka.exactly_once = "off"
    first = [order(n, partitions=3) for n in range(6)]
    replays = [order(n, partitions=3) for n in (1, 2, 4)]  # the same raw records again
    retry = order(3, partitions=3, attempt=2)
    resent = order(4, partitions=3, raw_offset=104)  # released, then sent again by the producer
    redriven = order(5, partitions=3, raw_offset=205)  # dead letter re-injected into raw
    produce(broker, settings.kafka.clean_topic, [*first, *replays, retry, resent, redriven])

    report = run_until_idle(settings, spark=spark)
    assert report.delivery_dedup
    assert (report.input_rows, report.processed) == (12, 9)

    # A replay arriving in a later run is still inside the window (state is checkpointed);
    # a new raw record of the same id is not a replay.
    produce(broker, settings.kafka.clean_topic, [order(0, partitions=3), order(0, raw_offset=300)])
    later = run_until_idle(settings, spark=spark)
    assert (later.input_rows, later.processed) == (2, 1)

    deliveries = Counter(
        (r.dedup_id, r.dedup_source, r.dedup_attempt) for r in output(spark, settings)
    )
    assert deliveries == Counter(
        [(f"o-{n}", f"raw/{n % 3}/{n}", 1) for n in range(6)]
        + [("o-3", "raw/0/3", 2), ("o-4", "raw/1/104", 1), ("o-5", "raw/2/205", 1)]
        + [("o-0", "raw/0/300", 1)]
    )


def produce_in_transactions(broker: str, topic: str, batches: list[tuple[list[Clean], bool]]):
    """Each batch in a transaction of its own, committed or aborted (as the gateway's
    exactly-once output does with a raw batch's copies)."""
    producer = Producer({"bootstrap.servers": broker, "transactional.id": f"{topic}-txn",
                         "log_level": 3})  # fmt: skip
    producer.init_transactions(30)
    for records, commit in batches:
        producer.begin_transaction()
        for rec in records:
            producer.produce(topic, key=rec.key, value=rec.value, partition=rec.partition,
                             headers=rec.headers())  # fmt: skip
        producer.flush(30)
        (producer.commit_transaction if commit else producer.abort_transaction)(30)


def test_without_the_delivery_dedup_aborted_copies_are_never_read_and_committed_ones_once(
    spark, broker, make_settings
):
    """`delivery_dedup = "auto"` where every path into the clean topic is transactional:
    off, no state store. A batch the gateway wrote in a transaction that aborted (killed
    between its copies' acknowledgement and its commit) is never read under
    read_committed; its replay, committed, is processed once. A repeat committed under
    the same token (what only a non-transactional path can write) is not dropped."""
    settings = make_settings(max_records_per_batch=5)
    settings.kafka.exactly_once = "on"
    settings.failures.mode = "release"
    first = [order(n, partitions=3) for n in range(4)]
    crashed = [order(n, partitions=3) for n in range(4, 8)]
    produce_in_transactions(
        broker, settings.kafka.clean_topic,
        [(first, True), (crashed, False), (crashed, True), ([order(0, partitions=3)], True)],
    )  # fmt: skip

    report = run_until_idle(settings, spark=spark)
    assert not report.delivery_dedup
    assert (report.input_rows, report.processed, report.written) == (9, 9, 9)
    ids = Counter(r.dedup_id for r in output(spark, settings))
    assert ids == Counter([f"o-{n}" for n in range(8)] + ["o-0"])


def test_a_failed_record_whose_id_is_not_utf8_is_released_under_its_exact_bytes(
    spark, broker, make_settings
):
    settings = make_settings()
    raw_id = b"\xff\xfe-bin"  # e.g. a binary Kafka key with [dedup] id = "key"
    bad = Clean(id=raw_id, value=b"not json", key=raw_id, token=source_token(0, 40),
                source="raw/0/40")  # fmt: skip
    produce(broker, settings.kafka.clean_topic, [order(1), bad])

    report = run_until_idle(settings, spark=spark)
    assert (report.written, report.failed, report.releases_published) == (1, 1, 1)
    (command,) = release_commands(broker, settings, 1)  # also checks key == id_b64 bytes
    assert base64.b64decode(command["id_b64"]) == raw_id
    assert command["id"] == raw_id.decode(errors="replace")
    assert (command["token"], command["source"]) == (
        source_token(0, 40),
        {"topic": "raw", "partition": 0, "offset": 40},
    )


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


@pytest.mark.parametrize("source", SOURCES)
def test_rerun_batch_after_crash_outputs_each_record_once_and_releases_each_failure_once(
    spark, broker, make_settings, source
):
    settings = make_settings(source, max_records_per_batch=5)
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
    assert all(c["token"] == source_token(int(c["id"][2:]) % 3, int(c["id"][2:])) for c in commands)
    assert {c["reason"] for c in commands} == {"customer blocked"}


@dataclass
class FailingOutputWrite(BatchSink):
    """The real sink, except that publishing the output raises `failures` times: the
    batch dies after its outcomes were stored (the ok rows staged, the marker written),
    before its output and commands are out."""

    failures: int = 1

    def publish_output(self, out: CheckpointFiles, batch_id: int) -> None:
        if self.failures > 0:
            self.failures -= 1
            raise RuntimeError(f"simulated crash writing the output of batch {batch_id}")
        super().publish_output(out, batch_id)


def crash_first_run(spark: SparkSession, settings: SinkSettings, sink: Any, match: str) -> None:
    """Run the stream until `sink` crashes it (Spark has not committed that batch)."""
    query = start_query(spark, settings, sink, available_now=True)
    with pytest.raises(StreamingQueryException, match=match):
        query.awaitTermination()
    query.stop()


def test_a_rerun_batch_keeps_the_first_runs_success_though_the_handler_now_fails_it(
    spark, broker, make_settings
):
    """First run: o-1 succeeds, output and (no) commands are out, then the batch dies
    before Spark commits it. The re-run's handler would fail o-1: the stored outcome
    wins, so o-1 stays in the output and no command is published."""
    settings = make_settings()
    produce(broker, settings.kafka.clean_topic, [order(n, partitions=3) for n in range(6)])
    crashing = CrashAfterBatch(make_sink(settings, orders), crash_in=0)
    crash_first_run(spark, settings, crashing, "simulated crash after batch 0")
    crashing.sink.close()
    assert (crashing.sink.counts.written, crashing.sink.counts.failed) == (6, 0)

    report = run_until_idle(settings, spark=spark, handler=failing_ids(["o-1"], reason="now no"))
    assert (report.input_rows, report.written, report.failed) == (rerun_input(6), 6, 0)
    assert sorted(r.dedup_id for r in output(spark, settings)) == [f"o-{n}" for n in range(6)]
    assert release_commands(broker, settings, 0) == []


def test_a_rerun_batch_releases_the_first_runs_failure_once_though_the_handler_now_passes_it(
    spark, broker, make_settings
):
    """First run: o-1 fails; the batch dies after storing its outcomes, before its output
    and commands. The re-run's handler would pass o-1: the stored outcome wins, so o-1
    is released once, with the first run's reason, and is not in the output."""
    settings = make_settings()
    produce(broker, settings.kafka.clean_topic, [order(n, partitions=3) for n in range(6)])
    first = make_sink(settings, failing_ids(["o-1"], reason="first answer"))
    crashing = FailingOutputWrite(**{f.name: getattr(first, f.name) for f in fields(first)})
    crash_first_run(spark, settings, crashing, "simulated crash writing the output of batch 0")
    crashing.close()
    assert crashing.counts.releases_published == 0
    # The first run's ok rows are staged where readers of the output do not see them.
    assert not Path(settings.spark.output_path, "batch_id=0").exists()
    assert Path(settings.spark.output_path, "_pending", "batch_id=0").is_dir()

    report = run_until_idle(settings, spark=spark, handler=orders)
    assert (report.input_rows, report.written, report.failed) == (rerun_input(6), 5, 1)
    assert report.releases_published == 1
    assert sorted(r.dedup_id for r in output(spark, settings)) == [
        f"o-{n}" for n in (0, 2, 3, 4, 5)
    ]
    (command,) = release_commands(broker, settings, 1)
    assert (command["id"], command["reason"]) == ("o-1", "first answer")


def test_markers_outcomes_and_output_go_through_hadoop_so_both_paths_can_be_uris(
    spark, broker, make_settings, tmp_path, monkeypatch
):
    """`file:` URIs work through Hadoop's FileSystem (as hdfs:// and s3a:// do) but not
    through Python path calls, which would create a relative `file:` directory here."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    root, out = tmp_path / "checkpoint-uri", tmp_path / "output-uri"
    settings = make_settings(checkpoint_dir=f"file://{root}", output_path=f"file://{out}")
    produce(broker, settings.kafka.clean_topic, [order(1), order(2, amount=-1)])

    report = run_until_idle(settings, spark=spark)
    assert (report.written, report.failed, report.releases_published) == (1, 1, 1)
    assert (root / "query" / "commits" / "0").is_file()  # Spark's own checkpoint
    assert (root / "releases" / "0.done").is_file()
    stored = parse_outcomes_marker((root / "outcomes" / "0" / OUTCOMES_MARKER).read_text())
    assert stored is not None and (stored.ok, stored.failed, len(stored.commands)) == (1, 1, 1)
    assert [r.dedup_id for r in spark.read.parquet(str(out / "batch_id=0")).collect()] == ["o-1"]
    assert list((out / "_pending").iterdir()) == []  # staged rows were moved, not copied
    assert list(cwd.iterdir()) == []


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


def test_a_handler_can_aggregate_the_batchs_processing_time(spark, broker, make_settings):
    """processed_at reaches the handler as a plain column (the dedup computed it through
    `reflect`, which Spark forbids inside aggregates of the plan that evaluates it)."""
    settings = make_settings()
    produce(broker, settings.kafka.clean_topic, [order(n, partitions=3) for n in range(4)])

    def stamped(records: DataFrame) -> DataFrame:
        """orders, on the records stamped with the batch's latest processing time."""
        latest = records.agg(F.max("processed_at").alias("latest"))
        same = records.crossJoin(latest).where(F.col("processed_at") == F.col("latest"))
        return orders(same.drop("latest"))

    report = run_until_idle(settings, spark=spark, handler=stamped)
    assert (report.written, report.failed) == (4, 0)
