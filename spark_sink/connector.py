"""Which Kafka source the job reads with: Spark's own connector (`format("kafka")`)
when Spark finds it, else the Python source (`spark_sink.kafka_source`), as
`[spark] source` asks; and where the connector's jars come from (`make setup`'s cache,
`spark.jars`, `spark.jars.packages` or `--packages` with `connector_coordinates`).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import pyspark
from pyspark import SparkContext
from pyspark.sql import SparkSession
from pyspark.sql.streaming.query import StreamingQuery

from gateway.config import ConfigError
from spark_sink.config import SinkSettings

logger = logging.getLogger(__name__)

KAFKA_CONNECTOR_CLASS = "org.apache.spark.sql.kafka010.KafkaSourceProvider"
KAFKA_CONNECTOR_ARTIFACT = "spark-sql-kafka-0-10"
# Where `make setup` (devtools/jars.py) keeps the connector's jars, one folder per Spark
# version: `$DEDUP_JAR_CACHE/spark-kafka-<version>/`, complete once READY is there.
JAR_CACHE_ENV = "DEDUP_JAR_CACHE"
DEFAULT_JAR_CACHE = "~/.cache/dedup-gateway/jars"
JAR_CACHE_READY = ".complete"


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


def jvm_started() -> bool:
    """Whether this process's Spark JVM runs already: a SparkContext, or spark-submit,
    which started it and handed its address to this Python (PYSPARK_GATEWAY_PORT).
    Jars given to a running JVM do not reach the driver's class path."""
    return SparkContext._active_spark_context is not None or "PYSPARK_GATEWAY_PORT" in os.environ


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


def native_connector_missing(settings: SinkSettings) -> str | None:
    """Why `spark.source = "native"` cannot run, known before the Spark session starts
    (a JVM, seconds): no connector in `[spark.conf]`'s `spark.jars` or
    `spark.jars.packages`, in `make setup`'s cache, nor in Spark's own jars; None when
    one may be there, or when a running JVM (spark-submit's `--packages`) decides."""
    if settings.spark.source != "native" or jvm_started():
        return None
    conf = settings.spark.conf
    if KAFKA_CONNECTOR_ARTIFACT in conf.get("spark.jars", "") + conf.get("spark.jars.packages", ""):
        return None
    if cached_connector_jars():
        return None
    homes = [os.environ.get("SPARK_HOME", ""), os.path.dirname(pyspark.__file__ or "")]
    pattern = f"{KAFKA_CONNECTOR_ARTIFACT}_*.jar"
    if any(next(Path(home, "jars").glob(pattern), None) for home in homes if home):
        return None
    coordinates = connector_coordinates()
    return (
        f'spark.source = "native" but Spark {pyspark.__version__} has no Kafka connector: '
        f'set [spark.conf] "spark.jars.packages" = "{coordinates}" (or spark-submit '
        f"--packages {coordinates}), or run make setup (docs/spark-cluster.md)"
    )


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
