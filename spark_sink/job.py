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
from pathlib import Path
from types import FrameType
from typing import Any
from urllib.parse import urlsplit

import pyspark
from prometheus_client import CollectorRegistry
from pyspark import SparkContext, SparkFiles
from pyspark.errors import StreamingQueryException
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.streaming.query import StreamingQuery

import gateway
import spark_sink
from gateway.config import ConfigError
from gateway.kafka.clients import java_client_options, librdkafka_options
from spark_sink.config import SinkSettings
from spark_sink.handlers import Handler, resolve_handler
from spark_sink.metrics import JobListener, JobMetrics, SinkCountsCollector, serve_metrics
from spark_sink.sink import BatchSink
from spark_sink.transforms import drop_duplicate_deliveries, parse_dedup_headers

logger = logging.getLogger(__name__)

KAFKA_CONNECTOR_CLASS = "org.apache.spark.sql.kafka010.KafkaSourceProvider"
KAFKA_CONNECTOR_ARTIFACT = "spark-sql-kafka-0-10"
# Where `make setup` (devtools/jars.py) keeps the connector's jars, one folder per Spark
# version: `$DEDUP_JAR_CACHE/spark-kafka-<version>/`, complete once READY is there.
JAR_CACHE_ENV = "DEDUP_JAR_CACHE"
DEFAULT_JAR_CACHE = "~/.cache/dedup-gateway/jars"
JAR_CACHE_READY = ".complete"
# Records of transactions that aborted or are still open are never read (the gateway
# writes the clean topic in transactions). [kafka.client] "java.isolation.level"
# overrides it.
ISOLATION_LEVEL = "read_committed"
# The connector's consumers read known offset ranges: a fetch that finds the range's end
# should come back at once, not after the broker's wait for more data (500 ms by default:
# it cost every micro-batch about 0.5 s here, a one-record batch 1.11 s against 0.45 s
# at 10 ms; docs/spark-performance.md). [kafka.client] "java.fetch.max.wait.ms" overrides.
FETCH_MAX_WAIT_MS = "10"
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
# on a local disk, so a local checkpoint_dir uses the FileSystem-based manager, whose
# package Spark 4.1 moved (`local_checkpoint_conf`).
CHECKPOINT_MANAGER = "FileSystemBasedCheckpointFileManager"
CHECKPOINT_MANAGER_PACKAGE = "org.apache.spark.sql.execution.streaming.checkpointing"
CHECKPOINT_MANAGER_PACKAGE_BEFORE_4_1 = "org.apache.spark.sql.execution.streaming"


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


def spark_version(version: str | None = None) -> tuple[int, int]:
    """(major, minor) of `version`, by default the installed pyspark's."""
    major, minor, *_ = (version or pyspark.__version__).split(".")
    return int(major), int(minor)


def scala_binary(version: str | None = None) -> str:
    """The Scala line of a Spark build: 2.13 for Spark 4 (its only one), 2.12 for
    Spark 3.5 as PyPI's pyspark ships it."""
    return "2.12" if spark_version(version) < (4, 0) else "2.13"


def connector_coordinates(version: str | None = None) -> str:
    """What `--packages` (or `spark.jars.packages`) takes for Spark `version`'s connector."""
    version = version or pyspark.__version__
    return f"org.apache.spark:{KAFKA_CONNECTOR_ARTIFACT}_{scala_binary(version)}:{version}"


def connector_cache_folder(version: str | None = None) -> Path:
    """Where `make setup` keeps the connector's jars for Spark `version` (the installed
    pyspark's by default); the same folder as `devtools.jars.connector_folder`."""
    root = Path(os.environ.get(JAR_CACHE_ENV, DEFAULT_JAR_CACHE)).expanduser()
    return root / f"spark-kafka-{version or pyspark.__version__}"


def cached_connector_jars(version: str | None = None) -> list[str]:
    """The connector's jars in `connector_cache_folder`, when a whole fetch left them."""
    folder = connector_cache_folder(version)
    if not (folder / JAR_CACHE_READY).is_file():
        return []
    return sorted(str(jar) for jar in folder.glob("*.jar"))


def connector_jars_conf(settings: SinkSettings) -> dict[str, str]:
    """`spark.jars` with the cached connector added, for a session the job starts
    itself; nothing when `[spark.conf]` already names a connector, the Python source is
    forced, or no whole fetch is cached."""
    conf = settings.spark.conf
    named = conf.get("spark.jars", "") + conf.get("spark.jars.packages", "")
    if settings.spark.source == "python" or KAFKA_CONNECTOR_ARTIFACT in named:
        return {}
    jars = cached_connector_jars()
    if not jars:
        return {}
    return {"spark.jars": ",".join([j for j in conf.get("spark.jars", "").split(",") if j] + jars)}


def jvm_started() -> bool:
    """Whether this process's Spark JVM runs already: a SparkContext, or spark-submit,
    which started it and handed its address to this Python (PYSPARK_GATEWAY_PORT).
    Jars given to a running JVM do not reach the driver's class path."""
    return SparkContext._active_spark_context is not None or "PYSPARK_GATEWAY_PORT" in os.environ


def local_checkpoint_conf(version: str | None = None) -> dict[str, str]:
    """The FileSystem-based checkpoint manager, named as Spark `version` has it."""
    package = (
        CHECKPOINT_MANAGER_PACKAGE
        if spark_version(version) >= (4, 1)
        else CHECKPOINT_MANAGER_PACKAGE_BEFORE_4_1
    )
    return {"spark.sql.streaming.checkpointFileManagerClass": f"{package}.{CHECKPOINT_MANAGER}"}


def build_session(settings: SinkSettings) -> SparkSession:
    """The SparkSession for the job (reused if one is already active).

    On a cluster (any master but local) the driver's `spark_sink` and `gateway`
    packages are shipped to the executors (`ship_code`), so they run the driver's
    code whatever their Python environment holds."""
    builder = SparkSession.builder.appName(settings.spark.app_name)
    if settings.spark.master:
        builder = builder.master(settings.spark.master)
    choose_worker_python(settings)
    defaults = {**DEFAULT_CONF, **(local_checkpoint_conf() if local_checkpoint(settings) else {})}
    jars = {} if jvm_started() else connector_jars_conf(settings)
    for key, value in {**defaults, **settings.spark.conf, **jars}.items():
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


def connector_version(spark: SparkSession) -> str | None:
    """The version of the Kafka connector Spark loads for `format("kafka")` (its jar's
    Implementation-Version, "" when the jar has none); None when there is none.

    Asks Spark's own lookup (DataSource.lookupDataSource: the data source registry,
    through the class loader `format()` uses), not a class name on some loader."""
    try:
        jvm: Any = spark._jvm
        sql_conf = spark._jsparkSession.sessionState().conf()
        lookup = jvm.org.apache.spark.sql.execution.datasources.DataSource.lookupDataSource
        provider = lookup("kafka", sql_conf)
        if provider.getName() != KAFKA_CONNECTOR_CLASS:
            return None
        return str(provider.getPackage().getImplementationVersion() or "")
    except Exception:  # noqa: BLE001 (Py4JJavaError: not found; no JVM under Spark Connect)
        return None


def connector_available(spark: SparkSession) -> bool:
    """Whether Spark finds its own Kafka connector for `format("kafka")`."""
    return connector_version(spark) is not None


def python_source_missing() -> str | None:
    """Why this PySpark cannot run the Python Kafka source (its Data Source API with
    admission control is PySpark 4.2's); None when it can."""
    try:
        import spark_sink.kafka_source  # noqa: F401
    except ImportError as exc:
        return f"pyspark {pyspark.__version__} cannot run the Python Kafka source ({exc})"
    return None


def _connector_fix(spark: SparkSession) -> str:
    coordinates = connector_coordinates(spark.version)
    return (
        f'spark-submit --packages {coordinates}, or [spark.conf] "spark.jars.packages" = '
        f'"{coordinates}" (docs/spark-cluster.md)'
    )


def choose_source(spark: SparkSession, settings: SinkSettings) -> str:
    """ "kafka" (Spark's connector) or "python" (spark_sink.kafka_source), as
    `spark.source` asks; ConfigError, in one line naming the fix, when that one cannot
    run here, or when the connector is of another Spark line than Spark's."""
    wanted = settings.spark.source
    found = connector_version(spark) if wanted != "python" else None
    if found:
        found_line, running_line = spark_version(found), spark_version(spark.version)
        if found_line != running_line:
            raise ConfigError(
                f"Spark's Kafka connector on the classpath is {found}, Spark is "
                f"{spark.version}: use {connector_coordinates(spark.version)} instead"
            )
    if found is not None:
        return "kafka"
    if wanted == "native":
        raise ConfigError(
            f'spark.source = "native" but Spark {spark.version} has no Kafka connector on '
            f"its classpath: {_connector_fix(spark)}"
        )
    missing = python_source_missing()
    if missing is None:
        return "python"
    if wanted == "python":
        raise ConfigError(f'spark.source = "python": {missing}; use Spark\'s connector instead')
    raise ConfigError(
        f"Spark {spark.version} has no Kafka connector on its classpath and {missing}: "
        f"{_connector_fix(spark)}"
    )


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
    source: str | None = None,
) -> StreamingQuery:
    """Start the stream: every record currently there (`available_now`), or continuously.

    `sink` is the foreachBatch function, normally a `BatchSink`; `source` as
    `read_clean_topic` takes it."""
    records = drop_duplicate_deliveries(
        parse_dedup_headers(read_clean_topic(spark, settings, source)),
        settings.spark.dedup_watermark,
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


def connector_progress_bug(query: StreamingQuery) -> bool:
    """Whether `query` died of Spark 4.1's Kafka connector bug SPARK-55271 (logged as a
    WARNING when it did).

    A query restarted on a checkpoint whose last batch did not commit re-runs that batch
    without asking the source for its latest offsets, and Spark 4.1.x's connector then
    fails the batch's progress report with a NullPointerException
    (`KafkaMicroBatchStream.metrics`), after the batch committed: a restart goes on
    (measured on 4.1.1; 3.5, 4.0 and 4.2 report such a batch)."""
    try:
        failure = query._jsq.exception()
        if failure.isEmpty():
            return False
        cause = failure.get().cause()
        frames = cause.getStackTrace()
        found = (
            cause.getClass().getName() == "java.lang.NullPointerException"
            and len(frames) > 0
            and "kafka010.KafkaMicroBatchStream" in str(frames[0].toString())
        )
    except Exception:  # noqa: BLE001 (no JVM to ask: not this failure)
        return False
    if found:
        logger.warning(
            "Spark's Kafka connector failed the progress report of the batch this query "
            "re-ran after a restart (SPARK-55271, Spark 4.1); the batch is committed: "
            "starting the query again"
        )
    return found


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
        source = choose_source(session, settings)
        check_planner_python(session, settings, source)
        queries = [start_query(session, settings, sink, available_now=True, source=source)]
        try:
            try:
                queries[0].awaitTermination()
            except StreamingQueryException:
                if not connector_progress_bug(queries[0]):
                    raise
                queries[0].stop()
                queries.append(start_query(session, settings, sink, available_now=True))
                queries[1].awaitTermination()
        finally:
            for query in queries:
                query.stop()
        progress = [p for query in queries for p in query.recentProgress]
        input_rows = sum(int(p.get("numInputRows", 0)) for p in progress)
        return RunReport(
            batches=sink.counts.batches,
            input_rows=input_rows,
            processed=sink.counts.records,
            failed=sink.counts.failed,
            releases_published=sink.counts.releases_published,
            written=sink.counts.written,
            output_rows=count_output(session, settings.spark.output_path),
            source=source,
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
) -> None:
    """Run the stream until SIGINT/SIGTERM. Stopping may interrupt a batch; the next
    start re-runs it (output and release commands are idempotent per batch).
    `registry`: where the job's metrics go (`start_metrics`)."""
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
    query = start_query(session, settings, sink, source=source)
    stopping = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        if stopping.is_set():
            raise KeyboardInterrupt  # second signal: stop waiting
        logger.info("signal %d: stopping the query", signum)
        stopping.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    restarted = False
    try:
        while query.isActive and not stopping.is_set():
            try:
                query.awaitTermination(1)
            except StreamingQueryException:
                if restarted or not connector_progress_bug(query):
                    raise
                restarted = True
                query.stop()
                query = start_query(session, settings, sink, source=source)
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
