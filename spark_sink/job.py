"""Wiring: the clean topic as a stream -> transforms -> `BatchSink`, and its lifecycle.

Run it with `python -m spark_sink --config gateway.toml` (or `spark-submit
spark_sink/__main__.py --config gateway.toml`). The source is Spark's Kafka
connector when `org.apache.spark.sql.kafka010.KafkaSourceProvider` loads in
the JVM (`spark.source = "auto"`), else `spark_sink.kafka_source`; both give
the same columns, so the rest of the job does not know which one ran.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry
from pyspark.errors import StreamingQueryException
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.streaming.query import StreamingQuery

from gateway.config import ConfigError
from gateway.kafka.clients import java_client_options, librdkafka_options
from spark_sink.checkpoint import check_checkpoint, spark_checkpoint
from spark_sink.config import SinkSettings
from spark_sink.connector import (
    choose_source,
    connector_progress_bug,
    native_connector_missing,
)
from spark_sink.handlers import Handler, resolve_handler
from spark_sink.metrics import JobListener, JobMetrics, SinkCountsCollector, serve_metrics
from spark_sink.preflight import Decision, preflight
from spark_sink.redis_dedup import drop_duplicate_deliveries_redis
from spark_sink.session import build_session
from spark_sink.sink import BatchSink
from spark_sink.tables import count_table, sink_class, table_jars_missing
from spark_sink.transforms import (
    PROCESSED_AT,
    batch_time,
    drop_duplicate_deliveries,
    parse_dedup_headers,
)

logger = logging.getLogger(__name__)

# Records of transactions that aborted or are still open are never read (the gateway
# writes the clean topic in transactions). [kafka.client] "java.isolation.level"
# overrides it.
ISOLATION_LEVEL = "read_committed"
# The connector's consumers read known offset ranges: a fetch that finds the range's end
# should come back at once, not after the broker's wait for more data (500 ms by default:
# it cost every micro-batch about 0.5 s here, a one-record batch 1.11 s against 0.45 s
# at 10 ms; docs/spark-performance.md). [kafka.client] "java.fetch.max.wait.ms" overrides.
FETCH_MAX_WAIT_MS = "10"
# No client of the job asks the broker to create a topic it lacks (a mistyped name
# would appear with 1 partition; kafka_source.py's consumer sets it too).
NO_AUTO_CREATE = {"allow.auto.create.topics": "false"}


@dataclass(frozen=True)
class RunReport:
    """What one `run_until_idle` call did.

    input_rows: records read from the clean topic (before the dedup step);
    processed: records handed to the handler (after it); failed: records the
    handler failed (each gets one release command if it has an id and token);
    written: rows written to Parquet by this run; output_rows: rows in the whole
    output now (earlier runs included); batches: micro-batches with records.
    """

    batches: int
    input_rows: int
    processed: int
    failed: int
    releases_published: int
    written: int
    output_rows: int
    # "kafka": Spark's own connector; "python": spark_sink.kafka_source.
    source: str = "kafka"
    # Whether repeated deliveries were dropped (`[spark] delivery_dedup`, resolved).
    delivery_dedup: bool = True


def check_planner_python(
    spark: SparkSession, settings: SinkSettings, source: str | None = None
) -> None:
    """Raise ConfigError when the Python source cannot be planned here.

    The Python Kafka source is planned on the driver by a Python worker that
    runs the executors' Python (`spark.pyspark.python`: Spark has one setting for
    both). A relative path such as `./environment/bin/python` (an archive that
    `--archives` unpacks in each executor's folder) does not exist beside a
    client-mode driver unless the archive is unpacked there too."""
    python = spark.sparkContext.pythonExec
    if not python or "/" not in python or os.path.isabs(python) or os.path.exists(python):
        return  # a name looked up on PATH, an absolute path, or one that is here
    if (source or choose_source(spark, settings)) == "kafka":
        return
    raise ConfigError(
        f"spark.pyspark.python = {python!r} does not exist in {os.getcwd()}, where the "
        "driver plans the Python Kafka source: unpack the archive here too (client mode, "
        "docs/spark-cluster.md) or give a Python that exists on every host"
    )


def start_metrics(
    spark: SparkSession,
    settings: SinkSettings,
    sink: BatchSink,
    registry: CollectorRegistry | None = None,
) -> Callable[[], None]:
    """Export the job's metrics (spark_sink.metrics) on `registry` (a fresh one when
    None) and serve them on `spark.metrics_port` when set; returns what stops both."""
    registry = registry if registry is not None else CollectorRegistry()
    listener = JobListener(JobMetrics(registry))
    registry.register(SinkCountsCollector(lambda: [sink.counts]))
    sink.failure_alarm_share = settings.spark.failure_alarm_share
    spark.streams.addListener(listener)
    port = settings.spark.metrics_port
    server = serve_metrics(registry, port, settings.spark.metrics_host) if port else None

    def stop() -> None:
        spark.streams.removeListener(listener)
        if server is not None:
            server.shutdown()
            server.server_close()

    return stop


def read_clean_topic(
    spark: SparkSession, settings: SinkSettings, source: str | None = None
) -> DataFrame:
    """The clean topic as a stream of Kafka-shaped rows (`transforms.KAFKA_SCHEMA`), from
    `source` ("kafka" or "python"; `choose_source` when None)."""
    kafka, conf = settings.kafka, settings.spark
    source = source or choose_source(spark, settings)
    if source == "kafka":
        logger.info("reading %s with Spark %s's Kafka connector", kafka.clean_topic, spark.version)
        reader = spark.readStream.format("kafka").option("includeHeaders", "true")
        options = {
            "isolation.level": ISOLATION_LEVEL,
            "fetch.max.wait.ms": FETCH_MAX_WAIT_MS,
            **NO_AUTO_CREATE,
            **java_client_options(kafka),
        }
    else:
        from spark_sink import kafka_source

        logger.info("reading %s with the Python Kafka source", kafka.clean_topic)
        reader = spark.readStream.format(kafka_source.register(spark))
        options = librdkafka_options(kafka)
    for key, value in options.items():
        reader = reader.option(f"kafka.{key}", value)
    return (
        reader.option("subscribe", kafka.clean_topic)
        .option("startingOffsets", conf.starting_offsets)
        .option("maxOffsetsPerTrigger", str(conf.max_records_per_batch))
        .load()
    )


def make_sink(settings: SinkSettings, handler: Handler | None = None) -> BatchSink:
    """The foreachBatch sink; `handler` overrides the configured one (tests, embedding)."""
    if handler is None:
        handler = resolve_handler(settings.spark.handler, settings.spark.handler_options or None)
    producer_config: dict[str, Any] = {
        **librdkafka_options(settings.kafka),
        **NO_AUTO_CREATE,
        "acks": "all",
        "enable.idempotence": settings.kafka.producer_idempotence,
        "linger.ms": 5,
    }
    return sink_class(settings)(
        handler=handler,
        output_path=settings.spark.output_path,
        checkpoint_dir=str(settings.spark.checkpoint_dir),
        failure_topic=settings.kafka.failure_topic,
        producer_config=producer_config,
    )


def start_query(
    spark: SparkSession,
    settings: SinkSettings,
    sink: Callable[[DataFrame, int], None],
    *,
    available_now: bool = False,
    source: str | None = None,
    delivery_dedup: bool = True,
) -> StreamingQuery:
    """Start the stream: every record currently there (`available_now`), or continuously.

    `sink` is the foreachBatch function, normally a `BatchSink`; `source` as
    `read_clean_topic` takes it; `delivery_dedup`: drop repeated deliveries
    (`[spark] delivery_dedup` as `preflight` resolved it), in Spark's state store or,
    with `[spark] dedup_redis`, in Redis (`spark_sink.redis_dedup`). A checkpoint keeps
    the plan it started with: switching the dedup on or off, or between the state store
    and Redis, needs a new `checkpoint_dir`."""
    records = parse_dedup_headers(read_clean_topic(spark, settings, source))
    if delivery_dedup and settings.spark.dedup_redis:
        records = drop_duplicate_deliveries_redis(
            records, settings.spark.dedup_watermark, settings.spark.dedup_redis
        )
    elif delivery_dedup:
        records = drop_duplicate_deliveries(records, settings.spark.dedup_watermark)
    else:
        records = records.withColumn(PROCESSED_AT, batch_time())
    writer = (
        records.writeStream.foreachBatch(sink)
        .option("checkpointLocation", spark_checkpoint(settings))
        .queryName(settings.spark.app_name.replace("-", "_"))
    )
    if available_now:
        writer = writer.trigger(availableNow=True)
    else:
        seconds = settings.spark.trigger_interval.total_seconds()
        writer = writer.trigger(processingTime=f"{seconds} seconds")
    return writer.start()


def before_session(settings: SinkSettings) -> Decision:
    """What is checked before a Spark session starts, each failure one line naming the
    setting: `spark.source = "native"` without a connector, a checkpoint_dir the job
    cannot use (`check_checkpoint`), a missing topic (ConfigError), a broker
    that does not answer within a second (BrokerUnreachable), the dedup's Redis
    (`[spark] dedup_redis`) likewise (DedupRedisUnreachable); returns whether to run
    the delivery dedup (`spark_sink.preflight`)."""
    missing = native_connector_missing(settings) or table_jars_missing(settings)
    if missing is not None:
        raise ConfigError(missing)
    check_checkpoint(settings)
    return preflight(settings)


class Stopped(Exception):
    """`stop` was set before the run's work was done (the CLI sets it on a signal)."""


def wait_for(query: StreamingQuery, stop: threading.Event | None) -> bool:
    """Wait until `query` ends (True; its exception raised if it failed) or, first,
    `stop` is set (False)."""
    if stop is None:
        query.awaitTermination()
        return True
    while not stop.is_set():
        if query.awaitTermination(1):
            return True
    return False


def run_until_idle(
    settings: SinkSettings,
    *,
    spark: SparkSession | None = None,
    handler: Handler | None = None,
    registry: CollectorRegistry | None = None,
    stop: threading.Event | None = None,
) -> RunReport:
    """Process everything in the clean topic now, then stop; returns the counts.

    Resumes from `spark.checkpoint_dir`, so a second call processes only what
    arrived since. `spark`: an existing session (else one is built from the
    settings and stopped at the end); `handler`: overrides `spark.handler`.
    Raises the query's exception if it failed (e.g. the broker is unreachable),
    `Stopped` when `stop` is set first (the batch in flight runs again at the next
    start). `registry`: where the job's metrics go (`start_metrics`).
    """
    dedup = before_session(settings).delivery_dedup
    own_session = spark is None
    session = spark or build_session(settings)
    sink = make_sink(settings, handler)
    stop_metrics = start_metrics(session, settings, sink, registry)
    try:
        source = choose_source(session, settings)
        check_planner_python(session, settings, source)
        run = functools.partial(
            start_query, session, settings, sink, available_now=True, source=source,
            delivery_dedup=dedup,
        )  # fmt: skip
        queries = [run()]
        try:
            try:
                ended = wait_for(queries[0], stop)
            except StreamingQueryException:
                if not connector_progress_bug(queries[0]):
                    raise
                queries[0].stop()
                queries.append(run())
                ended = wait_for(queries[1], stop)
        finally:
            for query in queries:
                query.stop()
        if not ended:
            raise Stopped("stopped before the clean topic was read to its end")
        progress = [p for query in queries for p in query.recentProgress]
        input_rows = sum(int(p.get("numInputRows", 0)) for p in progress)
        return RunReport(
            batches=sink.counts.batches,
            input_rows=input_rows,
            processed=sink.counts.records,
            failed=sink.counts.failed,
            releases_published=sink.counts.releases_published,
            written=sink.counts.written,
            output_rows=(
                count_output(session, settings.spark.output_path)
                if settings.spark.output_format == "parquet"
                else count_table(session, settings)
            ),
            source=source,
            delivery_dedup=dedup,
        )
    finally:
        stop_metrics()
        sink.close()
        if own_session:
            session.stop()


def count_output(spark: SparkSession, output_path: str) -> int:
    """Rows in the Parquet output: its `batch_id=<n>` folders; 0 while there is none
    (no output yet, or only a batch staged under `_pending`, which Spark's reader
    skips: it would fail to infer a schema from no files)."""
    jvm: Any = spark._jvm
    path = jvm.org.apache.hadoop.fs.Path(output_path)
    fs = path.getFileSystem(spark._jsc.hadoopConfiguration())
    if not fs.exists(path):
        return 0
    names = [str(status.getPath().getName()) for status in fs.listStatus(path)]
    if not any(name.startswith("batch_id=") for name in names):
        return 0
    return spark.read.parquet(output_path).count()


def run_forever(
    settings: SinkSettings,
    *,
    spark: SparkSession | None = None,
    registry: CollectorRegistry | None = None,
    stop: threading.Event | None = None,
) -> None:
    """Run the stream until `stop` is set (the CLI sets it on SIGINT/SIGTERM) or it
    fails. Stopping may interrupt a batch; the next start re-runs it (output and
    release commands are idempotent per batch). `registry`: where the job's metrics
    go (`start_metrics`)."""
    stop = stop or threading.Event()
    dedup = before_session(settings).delivery_dedup
    own_session = spark is None
    session = spark or build_session(settings)
    try:
        source = choose_source(session, settings)
        check_planner_python(session, settings, source)
    except ConfigError:
        if own_session:
            session.stop()
        raise
    sink = make_sink(settings)
    stop_metrics = start_metrics(session, settings, sink, registry)
    query = start_query(session, settings, sink, source=source, delivery_dedup=dedup)
    restarted = False
    try:
        while query.isActive and not stop.is_set():
            try:
                query.awaitTermination(1)
            except StreamingQueryException:
                if restarted or not connector_progress_bug(query):
                    raise
                restarted = True
                query.stop()
                query = start_query(session, settings, sink, source=source, delivery_dedup=dedup)
        if query.exception() is not None:
            raise RuntimeError(f"stream failed: {query.exception()}")
    finally:
        query.stop()
        stop_metrics()
        sink.close()
        if own_session:
            session.stop()
