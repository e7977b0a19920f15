"""Table output (`[spark] output_format = "delta" | "iceberg"`): the sink's ok rows
appended to a Delta Lake or Apache Iceberg table at `output_path`, once per micro-batch.

Both sinks are `BatchSink` with another `publish_output`: a batch's ok rows are staged
as Parquet under `<output_path>/_pending/batch_id=<n>/` and its outcomes stored in the
marker under `checkpoint_dir` as for Parquet output (a re-run reuses them and does not
call the handler again); publishing appends the staged rows to the table instead of
moving the folder, then deletes the staging.

- Delta: the table is the folder `output_path`; the append carries Delta's idempotent
  write options, `txnAppId` (the query: its checkpoint) and `txnVersion` (the batch
  id), so Delta skips the append of a batch it has committed for that query.
- Iceberg: the table `default.clean` of a Hadoop catalog whose
  warehouse is `output_path` (`<output_path>/default/clean/`); each append records the
  query and batch id in its snapshot summary (`snapshot-property.*`), and a batch whose
  id a snapshot of this query already carries is not appended again.

The jars: one artifact per format and Spark line (`TABLE_ARTIFACTS`), fetched by `make
setup` into `~/.cache/dedup-gateway/jars/<format>-<spark version>/` (devtools/jars.py,
scripts/jvm/spark-table.pom.xml) and put on the classpath of a session the job starts
itself (`table_conf`), only when that format is chosen; without them the job stops
before the session starts (`table_jars_missing`).
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import pyspark
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from gateway.config import ConfigError
from spark_sink.config import SinkSettings
from spark_sink.connector import jvm_started, spark_version
from spark_sink.files import CheckpointFiles
from spark_sink.sink import BatchSink

logger = logging.getLogger(__name__)

JAR_CACHE_ENV = "DEDUP_JAR_CACHE"
DEFAULT_JAR_CACHE = "~/.cache/dedup-gateway/jars"
JAR_CACHE_READY = ".complete"


@dataclass(frozen=True)
class TableArtifact:
    """A table format's Spark jar on Maven Central and the artifacts of its dependency
    tree that Spark itself lacks (Spark ships Scala, Hadoop, ANTLR and logging)."""

    group: str
    artifact: str
    version: str
    include: tuple[str, ...]

    @property
    def coordinates(self) -> str:
        return f"{self.group}:{self.artifact}:{self.version}"


_DELTA_4_0 = TableArtifact(
    "io.delta", "delta-spark_2.13", "4.0.0", ("delta-spark_2.13", "delta-storage")
)
_DELTA_4_1 = TableArtifact(
    "io.delta", "delta-spark_2.13", "4.1.0", ("delta-spark_2.13", "delta-storage")
)
_ICEBERG_4_0 = TableArtifact(
    "org.apache.iceberg", "iceberg-spark-runtime-4.0_2.13", "1.10.0",
    ("iceberg-spark-runtime-4.0_2.13",),
)  # fmt: skip
# (format, Spark line) -> the artifact that runs there, as tried (docs/spark.md): Delta
# 4.0.0 fails on Spark 4.2 (NoSuchMethodError in Spark's logging API), Delta 4.1.0 runs
# on 4.1 and 4.2; Iceberg 1.10.0's runtime for Spark 4.0 runs on 4.0 and 4.1, on 4.2 it
# fails to load (IncompatibleClassChangeError: Spark's View became a class).
TABLE_ARTIFACTS: dict[tuple[str, tuple[int, int]], TableArtifact] = {
    ("delta", (4, 0)): _DELTA_4_0,
    ("delta", (4, 1)): _DELTA_4_1,
    ("delta", (4, 2)): _DELTA_4_1,
    ("iceberg", (4, 0)): _ICEBERG_4_0,
    ("iceberg", (4, 1)): _ICEBERG_4_0,
}
ICEBERG_CATALOG = "dedup_sink"
# The Iceberg table in its catalog: `<output_path>/default/clean/`.
ICEBERG_TABLE = "default.clean"
# Snapshot summary keys of an Iceberg append: the query (`query_id`) and the batch.
ICEBERG_QUERY_KEY = "dedup-sink.query"
ICEBERG_BATCH_KEY = "dedup-sink.batch-id"


def table_artifact(output_format: str, version: str | None = None) -> TableArtifact:
    """The artifact of `output_format` for Spark `version` (the installed pyspark's);
    ConfigError naming the setting when none runs on that Spark."""
    version = version or pyspark.__version__
    found = TABLE_ARTIFACTS.get((output_format, spark_version(version)))
    if found is None:
        lines = sorted(f"{m}.{n}" for fmt, (m, n) in TABLE_ARTIFACTS if fmt == output_format)
        raise ConfigError(
            f'[spark] output_format = "{output_format}": no tested {output_format} build for '
            f"Spark {version} (tested on Spark {', '.join(lines)}; docs/spark.md)"
        )
    return found


def table_cache_folder(output_format: str, version: str | None = None) -> Path:
    """Where `make setup` keeps `output_format`'s jars for Spark `version`; the same
    folder as `devtools.jars.table_jars`."""
    root = Path(os.environ.get(JAR_CACHE_ENV, DEFAULT_JAR_CACHE)).expanduser()
    return root / f"{output_format}-{version or pyspark.__version__}"


def cached_table_jars(output_format: str, version: str | None = None) -> list[str]:
    folder = table_cache_folder(output_format, version)
    if not (folder / JAR_CACHE_READY).is_file():
        return []
    return sorted(str(jar) for jar in folder.glob("*.jar"))


def _named_in_conf(settings: SinkSettings, artifact: TableArtifact) -> bool:
    conf = settings.spark.conf
    return artifact.artifact in conf.get("spark.jars", "") + conf.get("spark.jars.packages", "")


def table_jars_missing(settings: SinkSettings) -> str | None:
    """Why the chosen table format cannot run, known before the Spark session starts; None
    for Parquet, when its jars are cached or named in `[spark.conf]`, or when a running
    JVM (spark-submit's `--packages`) decides."""
    output_format = settings.spark.output_format
    if output_format == "parquet" or jvm_started():
        return None
    artifact = table_artifact(output_format)
    if _named_in_conf(settings, artifact) or cached_table_jars(output_format):
        return None
    return (
        f'[spark] output_format = "{output_format}" needs {artifact.coordinates} on Spark '
        f'{pyspark.__version__}: run make setup, or set [spark.conf] "spark.jars.packages" = '
        f'"{artifact.coordinates}" (or spark-submit --packages {artifact.coordinates})'
    )


# Delta's SQL extension and catalog, which its writes require; static settings, so
# given when the session starts (spark-submit: --conf, docs/spark.md).
DELTA_CONF = {
    "spark.sql.extensions": "io.delta.sql.DeltaSparkSessionExtension",
    "spark.sql.catalog.spark_catalog": "org.apache.spark.sql.delta.catalog.DeltaCatalog",
}


def table_conf(settings: SinkSettings, conf: dict[str, str]) -> dict[str, str]:
    """What the chosen table format adds to the session's `conf` (the job's so far):
    Delta's extension and catalog unless `conf` sets them; for a JVM not started yet,
    `spark.jars` with the format's cached jars, unless `[spark.conf]` names them.
    Nothing for Parquet."""
    output_format = settings.spark.output_format
    if output_format == "parquet":
        return {}
    added: dict[str, str] = {}
    if output_format == "delta":
        extensions = [e for e in conf.get("spark.sql.extensions", "").split(",") if e]
        if DELTA_CONF["spark.sql.extensions"] not in extensions:
            extensions.append(DELTA_CONF["spark.sql.extensions"])
        added["spark.sql.extensions"] = ",".join(extensions)
        added["spark.sql.catalog.spark_catalog"] = conf.get(
            "spark.sql.catalog.spark_catalog", DELTA_CONF["spark.sql.catalog.spark_catalog"]
        )
    cached = cached_table_jars(output_format)
    if not jvm_started() and cached and not _named_in_conf(settings, table_artifact(output_format)):
        jars = [j for j in conf.get("spark.jars", "").split(",") if j]
        added["spark.jars"] = ",".join(jars + cached)
    return added


def query_id(checkpoint_dir: str) -> str:
    """A stable id of the query: its checkpoint's location (a new checkpoint is a new
    query, whose batch ids start again at 0)."""
    digest = hashlib.sha256(str(checkpoint_dir).rstrip("/").encode()).hexdigest()[:16]
    return f"dedup-sink-{digest}"


@dataclass
class TableSink(BatchSink):
    """`BatchSink` whose `publish_output` appends a batch's staged rows to a table."""

    def publish_output(self, out: CheckpointFiles, batch_id: int) -> None:
        staged = self.pending(batch_id)
        if not out.exists(staged):
            return  # a run before this one appended them and deleted the staging
        spark = SparkSession.active()
        self.append(spark, spark.read.parquet(out.uri(staged)), batch_id)
        out.delete(staged)

    def append(self, spark: SparkSession, rows: DataFrame, batch_id: int) -> None:
        """Append `rows` as batch `batch_id`, nothing when the table has that batch."""
        raise NotImplementedError


@dataclass
class DeltaSink(TableSink):
    """Appends each batch's ok rows to the Delta table at `output_path`."""

    def append(self, spark: SparkSession, rows: DataFrame, batch_id: int) -> None:
        # Delta skips the append when this txnAppId already committed this txnVersion.
        rows.write.format("delta").mode("append").options(
            txnAppId=query_id(self.checkpoint_dir), txnVersion=str(batch_id)
        ).save(self.output_path)


@dataclass
class IcebergSink(TableSink):
    """Appends each batch's ok rows to an Iceberg table in a Hadoop catalog whose
    warehouse is `output_path`."""

    def append(self, spark: SparkSession, rows: DataFrame, batch_id: int) -> None:
        table = use_hadoop_catalog(spark, self.output_path)
        query = query_id(self.checkpoint_dir)
        if not spark.catalog.tableExists(table):
            rows.limit(0).writeTo(table).using("iceberg").create()
        elif self._committed(spark, table, query, batch_id):
            logger.info("batch %d: already in %s, not appended again", batch_id, table)
            return
        rows.writeTo(table).options(
            **{f"snapshot-property.{ICEBERG_QUERY_KEY}": query,
               f"snapshot-property.{ICEBERG_BATCH_KEY}": str(batch_id)}
        ).append()  # fmt: skip

    @staticmethod
    def _committed(spark: SparkSession, table: str, query: str, batch_id: int) -> bool:
        """Whether a snapshot of `table` carries this query's `batch_id`."""
        found = spark.table(f"{table}.snapshots").where(
            (F.col("summary")[ICEBERG_QUERY_KEY] == query)
            & (F.col("summary")[ICEBERG_BATCH_KEY] == str(batch_id))
        )
        return not found.isEmpty()


def use_hadoop_catalog(spark: SparkSession, warehouse: str) -> str:
    """Register an Iceberg Hadoop catalog at `warehouse` in `spark` and return the
    table's name in it. The catalog is named after the warehouse
    (`dedup_sink_<hash>`): Spark builds a catalog once per session from its conf, so
    a catalog name reused for another warehouse would still point at the first."""
    digest = hashlib.sha256(warehouse.rstrip("/").encode()).hexdigest()[:12]
    catalog = f"{ICEBERG_CATALOG}_{digest}"
    prefix = f"spark.sql.catalog.{catalog}"
    spark.conf.set(prefix, "org.apache.iceberg.spark.SparkCatalog")
    spark.conf.set(f"{prefix}.type", "hadoop")
    spark.conf.set(f"{prefix}.warehouse", warehouse)
    return f"{catalog}.{ICEBERG_TABLE}"


def sink_class(settings: SinkSettings) -> type[BatchSink]:
    """The sink of `[spark] output_format`."""
    return {"delta": DeltaSink, "iceberg": IcebergSink}.get(settings.spark.output_format, BatchSink)


def count_table(spark: SparkSession, settings: SinkSettings) -> int:
    """Rows in the Delta or Iceberg output; 0 while the table does not exist yet."""
    if settings.spark.output_format == "delta":
        log = CheckpointFiles(spark, settings.spark.output_path)
        if not log.exists("_delta_log"):
            return 0
        return spark.read.format("delta").load(settings.spark.output_path).count()
    table = use_hadoop_catalog(spark, settings.spark.output_path)
    return spark.table(table).count() if spark.catalog.tableExists(table) else 0
