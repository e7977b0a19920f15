"""`[spark]`: the Spark job's table (spark_sink/), in the one settings file. The gateway
validates it with the rest (a bad value stops `check-config` and start-up naming it),
and the job reads it with `[kafka]` (`gateway.config.SinkSettings`)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator
from redis import ConnectionPool

from gateway.member_urls import masked
from gateway.settings.values import Duration

# The delivery dedup in Redis (spark_sink.redis_dedup): its setting, and the prefix of
# every key it writes, `dedup-spark:<clean topic>:<delivery_key()>:<attempt>`. Here, not
# there, so that the preflight names them without importing pandas and pyspark.
DEDUP_REDIS_SETTING = "[spark] dedup_redis"
DEDUP_REDIS_KEY_PREFIX = "dedup-spark:"
# Every record passes: a first run on plain records writes them all and releases none.
DEFAULT_HANDLER = "spark_sink.handlers:passthrough"


class SparkSettings(BaseModel):
    """The `[spark]` table."""

    model_config = ConfigDict(extra="forbid")

    # Offsets, state (the dedup window), stored batch outcomes and release-command
    # markers live here; a local path or any Hadoop URI (hdfs://, s3a://): every
    # file goes through Hadoop's FileSystem API.
    checkpoint_dir: str = "var/spark/checkpoint"
    # Successful records land in `<output_path>/batch_id=<n>/` (Parquet). Any Hadoop
    # URI Spark can write works (file:, hdfs:, s3a: with its connector on the classpath).
    output_path: str = "var/spark/output"
    # "parquet": the folders above; "delta": a Delta Lake table at output_path; "iceberg":
    # an Iceberg table in a Hadoop catalog under it (spark_sink/tables.py, docs/spark.md).
    output_format: Literal["parquet", "delta", "iceberg"] = "parquet"
    # "module:function" called once per micro-batch; see spark_sink.handlers.
    handler: str = DEFAULT_HANDLER
    # When set, `handler` names a factory called with these keyword arguments.
    handler_options: dict[str, Any] = Field(default_factory=dict)
    # Upper bound on records read per micro-batch, spread over partitions
    # (Spark's maxOffsetsPerTrigger). Every batch pays a fixed cost (seconds here)
    # besides its rows: 50,000 ran the job 3.8x faster than 10,000 when catching up,
    # and 100,000 1.5x faster than 50,000 on the connector without the delivery dedup
    # (docs/spark-performance.md: how it was measured and how to size it).
    max_records_per_batch: int = Field(default=100_000, ge=1, le=10_000_000)
    # Time between micro-batch starts when they finish early: no shorter than a small
    # batch's fixed cost, or a light load keeps the job busy with near-empty batches.
    trigger_interval: Duration = timedelta(seconds=5)
    # How long a delivery (dedup-token) is remembered to drop the gateway's crash-window
    # duplicates; measured in processing time (micro-batch start), not record time.
    dedup_watermark: Duration = timedelta(minutes=10)
    # The delivery dedup (a state store keyed by dedup-token, the job's largest fixed
    # cost): "on"; "off" (no state: a repeat under one token reaches the handler
    # again); "auto": off only when every path into the clean topic is transactional
    # (`spark_sink.preflight.delivery_dedup_needed`), else on. docs/guarantees.md.
    delivery_dedup: Literal["auto", "on", "off"] = "auto"
    # Where the delivery dedup keeps its tokens: empty, Spark's state store in the
    # checkpoint; a redis://, rediss:// or unix:// URL, a Redis 7.0+ server (keys
    # `dedup-spark:*`, expiring after dedup_watermark), with no state in the query
    # (spark_sink.redis_dedup). Switching needs a new checkpoint_dir.
    dedup_redis: str = ""
    # "auto": Spark's own Kafka connector when its classes are on the classpath,
    # else the Python source in spark_sink.kafka_source.
    source: Literal["auto", "native", "python"] = "auto"
    starting_offsets: Literal["earliest", "latest"] = "earliest"
    # None leaves the master to spark-submit (or Spark's default, local[*]).
    master: str | None = None
    app_name: str = "dedup-spark-sink"
    # Extra Spark configuration, e.g. {"spark.sql.shuffle.partitions" = "4"}.
    conf: dict[str, str] = Field(default_factory=dict)
    # The job's Prometheus metrics (spark_sink.metrics) at http://metrics_host:port/metrics,
    # served by the driver; 0 serves none.
    metrics_port: int = Field(default=0, ge=0, le=65535)
    metrics_host: str = "0.0.0.0"  # every interface: Prometheus scrapes from elsewhere
    # A batch whose handler fails more than this share of its records is logged as an
    # ERROR with the first reasons (a broken handler or unexpected input, not bad records).
    failure_alarm_share: float = Field(default=0.5, ge=0.0, le=1.0)

    @field_validator("handler")
    @classmethod
    def _module_colon_name(cls, spec: str) -> str:
        module, _, name = spec.partition(":")
        if not module.strip() or not name.strip():
            raise ValueError(f"expected 'module:function', got {spec!r}")
        return spec

    @field_validator("dedup_redis")
    @classmethod
    def _redis_url(cls, url: str) -> str:
        if not url:
            return url
        parts = urlsplit(url)
        if parts.scheme not in ("redis", "rediss", "unix"):
            raise ValueError(f"expected a redis://, rediss:// or unix:// URL, got {masked(url)!r}")
        if parts.scheme == "unix" and not parts.path:
            raise ValueError(f"a unix:// URL needs the socket's path, got {masked(url)!r}")
        database = parts.path.strip("/")
        if parts.scheme != "unix" and (not parts.hostname or (not database.isdigit() and database)):
            raise ValueError(f"expected redis[s]://host[:port][/db], got {masked(url)!r}")
        try:
            ConnectionPool.from_url(url)  # what the job's client will parse (no connection)
        except ValueError as exc:
            raise ValueError(f"{masked(url)!r}: {masked(str(exc))}") from None
        return url

    @field_validator("trigger_interval", "dedup_watermark")
    @classmethod
    def _positive(cls, value: timedelta) -> timedelta:
        if value <= timedelta(0):
            raise ValueError(f"must be positive, got {value}")
        return value
