"""Wiring: the clean topic as a stream -> transforms -> `BatchSink`, and its lifecycle.

Run it with `python -m spark_sink --config gateway.toml` (or `spark-submit
spark_sink/__main__.py --config gateway.toml`). The source is Spark's Kafka
connector when `org.apache.spark.sql.kafka010.KafkaSourceProvider` loads in
the JVM (`spark.source = "auto"`), else `spark_sink.kafka_source`; both give
the same columns, so the rest of the job does not know which one ran.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType
from typing import Any
from urllib.parse import urlsplit

from prometheus_client import CollectorRegistry
from pyspark import SparkFiles
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.streaming.query import StreamingQuery

import gateway
import spark_sink
from gateway.config import ConfigError
from gateway.kafka.clients import java_client_options, librdkafka_options
from spark_sink import kafka_source
from spark_sink.config import SinkSettings
from spark_sink.handlers import Handler, resolve_handler
from spark_sink.metrics import JobListener, JobMetrics, SinkCountsCollector, serve_metrics
from spark_sink.sink import BatchSink
from spark_sink.transforms import drop_duplicate_deliveries, parse_dedup_headers

logger = logging.getLogger(__name__)

KAFKA_CONNECTOR_CLASS = "org.apache.spark.sql.kafka010.KafkaSourceProvider"
# A stateful query plans one state store per shuffle partition: Spark's 200 is
# far too many for one small topic. After each batch with data Spark would run one
# without, only to expire the delivery dedup's state (0.5-0.8 s measured here): the
# next batch with data expires it as well. PySpark's DataFrame debugging records the
# Python call site of every DataFrame and column function, several py4j round trips
# each (0.1 s of a one-record batch here); without it an analysis error names the
# failing expression but not the Python line. Set spark.conf to override any of them.
DEFAULT_CONF = {
    "spark.sql.shuffle.partitions": "4",
    "spark.sql.streaming.noDataMicroBatches.enabled": "false",
    "spark.python.sql.dataFrameDebugging.enabled": "false",
}
# Spark's default checkpoint file manager renames through Hadoop's FileContext, which on
# a local file system without Hadoop's native library forks `readlink` for every rename
# (32 of the 58 processes a one-record batch forked here). FileSystem.rename is atomic
# on a local disk, so a local checkpoint_dir uses the FileSystem-based manager.
LOCAL_CHECKPOINT_CONF = {
    "spark.sql.streaming.checkpointFileManagerClass": (
        "org.apache.spark.sql.execution.streaming.checkpointing."
        "FileSystemBasedCheckpointFileManager"
    ),
}


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


def build_session(settings: SinkSettings) -> SparkSession:
    """The SparkSession for the job (reused if one is already active).

    On a cluster (any master but local) the driver's `spark_sink` and `gateway`
    packages are shipped to the executors (`ship_code`), so they run the driver's
    code whatever their Python environment holds."""
    builder = SparkSession.builder.appName(settings.spark.app_name)
    if settings.spark.master:
        builder = builder.master(settings.spark.master)
    choose_worker_python(settings)
    defaults = {**DEFAULT_CONF, **(LOCAL_CHECKPOINT_CONF if local_checkpoint(settings) else {})}
    for key, value in {**defaults, **settings.spark.conf}.items():
        builder = builder.config(key, value)
    session = builder.getOrCreate()
    if not (session.sparkContext.master or "local").startswith("local"):
        ship_code(session)
    return session


def local_checkpoint(settings: SinkSettings) -> bool:
    """Whether `spark.checkpoint_dir` is on the local file system (a path or file:)."""
    scheme = urlsplit(str(settings.spark.checkpoint_dir)).scheme
    return scheme in ("", "file")


def choose_worker_python(settings: SinkSettings) -> None:
    """The Python that Spark's Python workers run (executors, and on the driver the
    Python source's planner): `spark.conf."spark.pyspark.python"` when set, else an
    inherited PYSPARK_PYTHON (spark-submit sets it from that conf), else this
    interpreter, which has this package and pyarrow (not the first `python3` on
    PATH). PySpark reads only the environment variable, once, when the
    SparkContext starts."""
    configured = settings.spark.conf.get("spark.pyspark.python")
    if configured:
        os.environ["PYSPARK_PYTHON"] = configured
    else:
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)


def ship_code(spark: SparkSession) -> str:
    """Zip this process's `spark_sink` and `gateway` packages and put the zip on every
    executor's PYTHONPATH (SparkContext.addPyFile); returns its path.

    Executors unpickle the Python source's reader and the sink's functions by
    module name: without this they fail with "No module named 'spark_sink'"
    unless their environment has the package (and then maybe another version).
    The zip lives in the driver's SparkFiles folder, which Spark deletes at stop."""
    folder = os.path.join(SparkFiles.getRootDirectory(), "spark-sink-code")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "spark_sink_code.zip")
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        for package in (spark_sink, gateway):
            root = os.path.dirname(os.path.abspath(package.__file__ or ""))
            for here, dirs, files in os.walk(root):
                dirs[:] = [d for d in dirs if d != "__pycache__"]
                for name in files:
                    full = os.path.join(here, name)
                    archive.write(full, os.path.relpath(full, os.path.dirname(root)))
    spark.sparkContext.addPyFile(path)
    return path


def check_planner_python(spark: SparkSession, settings: SinkSettings) -> None:
    """Raise ConfigError when the Python source cannot be planned here.

    The Python Kafka source is planned on the driver by a Python worker that
    runs the executors' Python (`spark.pyspark.python`: Spark has one setting for
    both). A relative path such as `./environment/bin/python` (an archive that
    `--archives` unpacks in each executor's folder) does not exist beside a
    client-mode driver unless the archive is unpacked there too."""
    python = spark.sparkContext.pythonExec
    if not python or "/" not in python or os.path.isabs(python) or os.path.exists(python):
        return  # a name looked up on PATH, an absolute path, or one that is here
    conf = settings.spark
    if conf.source == "native" or (conf.source == "auto" and connector_available(spark)):
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


def connector_available(spark: SparkSession) -> bool:
    """Whether Spark's own Kafka connector is on the JVM classpath."""
    try:
        jvm: Any = spark._jvm
        loader = jvm.java.lang.Thread.currentThread().getContextClassLoader()
        jvm.java.lang.Class.forName(KAFKA_CONNECTOR_CLASS, False, loader)
    except Exception:  # noqa: BLE001 (Py4JJavaError, or no JVM under Spark Connect)
        return False
    return True


def read_clean_topic(spark: SparkSession, settings: SinkSettings) -> DataFrame:
    """The clean topic as a stream of Kafka-shaped rows (`kafka_source.SCHEMA`)."""
    kafka, conf = settings.kafka, settings.spark
    use_native = conf.source == "native" or (conf.source == "auto" and connector_available(spark))
    client = librdkafka_options(kafka)
    if use_native:
        logger.info("reading %s with Spark's Kafka connector", kafka.clean_topic)
        reader = spark.readStream.format("kafka").option("includeHeaders", "true")
        for key, value in java_client_options(kafka).items():
            reader = reader.option(f"kafka.{key}", value)
    else:
        logger.info("reading %s with the Python Kafka source", kafka.clean_topic)
        reader = spark.readStream.format(kafka_source.register(spark))
        for key, value in client.items():
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
        "acks": "all",
        "enable.idempotence": settings.kafka.producer_idempotence,
        "linger.ms": 5,
    }
    return BatchSink(
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
) -> StreamingQuery:
    """Start the stream: every record currently there (`available_now`), or continuously.

    `sink` is the foreachBatch function, normally a `BatchSink`."""
    records = drop_duplicate_deliveries(
        parse_dedup_headers(read_clean_topic(spark, settings)), settings.spark.dedup_watermark
    )
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


def spark_checkpoint(settings: SinkSettings) -> str:
    """Spark's own checkpoint (offsets, commits, state) inside `spark.checkpoint_dir`
    (a local path or a Hadoop URI)."""
    return f"{str(settings.spark.checkpoint_dir).rstrip('/')}/query"


def run_until_idle(
    settings: SinkSettings,
    *,
    spark: SparkSession | None = None,
    handler: Handler | None = None,
    registry: CollectorRegistry | None = None,
) -> RunReport:
    """Process everything in the clean topic now, then stop; returns the counts.

    Resumes from `spark.checkpoint_dir`, so a second call processes only what
    arrived since. `spark`: an existing session (else one is built from the
    settings and stopped at the end); `handler`: overrides `spark.handler`.
    Raises the query's exception if it failed (e.g. the broker is unreachable).
    `registry`: where the job's metrics go (`start_metrics`).
    """
    own_session = spark is None
    session = spark or build_session(settings)
    sink = make_sink(settings, handler)
    stop_metrics = start_metrics(session, settings, sink, registry)
    try:
        check_planner_python(session, settings)
        query = start_query(session, settings, sink, available_now=True)
        try:
            query.awaitTermination()
        finally:
            query.stop()
        input_rows = sum(int(p.get("numInputRows", 0)) for p in query.recentProgress)
        return RunReport(
            batches=sink.counts.batches,
            input_rows=input_rows,
            processed=sink.counts.records,
            failed=sink.counts.failed,
            releases_published=sink.counts.releases_published,
            written=sink.counts.written,
            output_rows=count_output(session, settings.spark.output_path),
        )
    finally:
        stop_metrics()
        sink.close()
        if own_session:
            session.stop()


def count_output(spark: SparkSession, output_path: str) -> int:
    """Rows in the Parquet output (0 when nothing has been written yet)."""
    jvm: Any = spark._jvm
    path = jvm.org.apache.hadoop.fs.Path(output_path)
    fs = path.getFileSystem(spark._jsc.hadoopConfiguration())
    if not fs.exists(path):
        return 0
    return spark.read.parquet(output_path).count()


def run_forever(
    settings: SinkSettings,
    *,
    spark: SparkSession | None = None,
    registry: CollectorRegistry | None = None,
) -> None:
    """Run the stream until SIGINT/SIGTERM. Stopping may interrupt a batch; the next
    start re-runs it (output and release commands are idempotent per batch).
    `registry`: where the job's metrics go (`start_metrics`)."""
    own_session = spark is None
    session = spark or build_session(settings)
    sink = make_sink(settings)
    check_planner_python(session, settings)
    stop_metrics = start_metrics(session, settings, sink, registry)
    query = start_query(session, settings, sink)
    stopping = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        if stopping.is_set():
            raise KeyboardInterrupt  # second signal: stop waiting
        logger.info("signal %d: stopping the query", signum)
        stopping.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while query.isActive and not stopping.is_set():
            query.awaitTermination(1)
        if query.exception() is not None:
            raise RuntimeError(f"stream failed: {query.exception()}")
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        query.stop()
        stop_metrics()
        sink.close()
        if own_session:
            session.stop()
