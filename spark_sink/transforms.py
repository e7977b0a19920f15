"""Pure DataFrame transforms of the sink: no I/O, same result on a stream or a small batch.

The record path: Kafka-shaped rows (`KAFKA_SCHEMA`) -> `parse_dedup_headers`
-> `drop_duplicate_deliveries` (streams only) -> the handler -> `split_results`
-> Parquet for the ok rows, `release_command` for the failed ones.
"""

from __future__ import annotations

from datetime import timedelta

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    IntegerType,
    LongType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

from gateway.contract.commands import Fields as Command
from gateway.contract.records import H_ATTEMPT as HEADER_ATTEMPT
from gateway.contract.records import H_ID as HEADER_ID
from gateway.contract.records import H_REASONS as HEADER_REASONS
from gateway.contract.records import H_SOURCE as HEADER_SOURCE
from gateway.contract.records import H_TOKEN as HEADER_TOKEN

# The headers the gateway adds to every clean record are gateway.contract.records' (values
# are ASCII, except dedup-id, which holds the id's exact bytes: a binary Kafka key,
# or any bytes of a header).

DEDUP_COLUMNS = ("dedup_id", "dedup_source", "dedup_token", "dedup_attempt", "dedup_reasons")
# The exact dedup-id bytes (dedup_id is their UTF-8 reading, with U+FFFD for invalid bytes).
# Release commands carry them as `id_b64`; a handler result without it falls back to dedup_id.
ID_BYTES = "dedup_id_bytes"
REASON = "reason"
# Processing time of the micro-batch (Spark journals it, so a replayed batch sees the same).
PROCESSED_AT = "processed_at"
_DEDUP_KEY = "_dedup_key"

_SOURCE_PATTERN = r"^(.+)/(\d+)/(\d+)$"

# The rows of Spark's Kafka source with includeHeaders=true; the Python source
# (spark_sink.kafka_source) gives the same.
KAFKA_SCHEMA = StructType(
    [
        StructField("key", BinaryType()),
        StructField("value", BinaryType()),
        StructField("topic", StringType()),
        StructField("partition", IntegerType()),
        StructField("offset", LongType()),
        StructField("timestamp", TimestampType()),
        StructField("timestampType", IntegerType()),
        StructField(
            "headers",
            ArrayType(
                StructType([StructField("key", StringType()), StructField("value", BinaryType())])
            ),
        ),
    ]
)


def try_cast(sql: str, type_name: str) -> Column:
    """The SQL expression `sql` cast to `type_name`, null where it does not convert
    (SQL's `try_cast`, in Spark 3.5 too: `Column.try_cast` is PySpark 4's)."""
    return F.expr(f"try_cast({sql} AS {type_name})")


def header_bytes_sql(name: str) -> str:
    """The first value of header `name` as bytes, null when absent, in SQL.

    Found by position in the array of keys, not with a lambda (`filter`): Spark
    interprets higher-order functions row by row, outside its generated code."""
    if "'" in name or "\\" in name:
        raise ValueError(f"header name {name!r} is not a plain SQL string")
    return f"get(headers.value, CAST(array_position(headers.key, '{name}') AS INT) - 1)"


def header_bytes(name: str) -> Column:
    """The first value of header `name` as bytes, null when absent."""
    return F.expr(header_bytes_sql(name))


def header(name: str) -> Column:
    """The first value of header `name` as a UTF-8 string, null when absent."""
    return header_bytes(name).cast("string")


def parse_dedup_headers(records: DataFrame) -> DataFrame:
    """Add dedup_id, dedup_source, dedup_token (strings), dedup_attempt (int,
    1 when the header is absent or not a number), dedup_reasons (earlier
    failure reasons, array of strings, empty when absent) and dedup_id_bytes
    (the dedup-id header's exact bytes) from the headers."""
    attempt = try_cast(f"CAST({header_bytes_sql(HEADER_ATTEMPT)} AS STRING)", "INT")
    return records.select(
        "*",
        header(HEADER_ID).alias("dedup_id"),
        header(HEADER_SOURCE).alias("dedup_source"),
        header(HEADER_TOKEN).alias("dedup_token"),
        F.coalesce(attempt, F.lit(1)).alias("dedup_attempt"),
        F.coalesce(
            F.from_json(header(HEADER_REASONS), "array<string>"), F.array().cast("array<string>")
        ).alias("dedup_reasons"),
        header_bytes(HEADER_ID).alias(ID_BYTES),
    )


def interval(duration: timedelta) -> str:
    """A Spark interval string (`withWatermark` delay) for `duration`."""
    return f"{round(duration.total_seconds() * 1000)} milliseconds"


def delivery_key() -> Column:
    """What identifies one delivery of one source record and attempt (a string).

    The gateway's dedup-token is exactly that: a hash of the source record's
    topic/partition/offset and attempt. A crash replay of the same source record
    carries the same token; a retry, a producer resend after a release, or an
    operator redrive is a new source record or attempt, with a new token.
    Without a token (records not from the gateway) the key is (dedup_id,
    dedup_source, dedup_attempt); without a dedup-id either, the record's own
    clean-topic coordinates, so such records are never merged.
    """
    by_source = F.to_json(F.struct("dedup_id", "dedup_source", "dedup_attempt"))
    by_coordinates = F.to_json(F.struct("topic", "partition", "offset"))
    return (
        F.when(F.col("dedup_token").isNotNull(), F.concat(F.lit("token:"), "dedup_token"))
        .when(F.col("dedup_id").isNotNull(), F.concat(F.lit("source:"), by_source))
        .otherwise(F.concat(F.lit("clean:"), by_coordinates))
    )


def batch_time() -> Column:
    """The micro-batch's processing time (`current_timestamp()`), written so that every
    batch runs the same generated code.

    Spark puts a stream's `current_timestamp()` into each batch's plan as a literal
    after optimizing it, and generated code spells timestamp literals out: each batch
    compiled its own copy of the projection that holds it (Janino on the driver, then
    the JIT's C2 compiling it hot again), about half the job's JVM CPU per row
    (docs/spark-performance.md). `reflect` is evaluated outside generated code, so the
    literal under it no longer changes that code; the microseconds round-trip exactly.
    Spark counts `reflect` as non-deterministic: this expression may not go inside an
    aggregate, but the column it fills can (handlers see `processed_at` as a column)."""
    now = F.unix_micros(F.current_timestamp())
    micros = F.reflect(F.lit("java.lang.String"), F.lit("valueOf"), now)
    return F.timestamp_micros(micros.cast("long"))


def drop_duplicate_deliveries(records: DataFrame, window: timedelta) -> DataFrame:
    """Keep the first delivery of each source record and attempt (`delivery_key`)
    seen within `window`.

    The second line of defence behind the gateway: a gateway crash between
    forwarding and recording can forward one raw record twice, with the same
    token. A retry, a resend after a release and a redrive carry new tokens
    and pass, even under the same id and attempt.

    Time is the micro-batch's processing time, not the record timestamp: the
    gateway keeps the raw timestamp, so a retry forwarded hours later would be
    "late" against an event-time watermark and silently dropped. The state
    (one key per delivery, expired by the watermark) lives in the query's
    checkpoint; its key columns (a string and dedup_attempt) are what they were
    when the key was (dedup_id, dedup_attempt), so an existing checkpoint restarts.
    Needs a streaming DataFrame.
    """
    return (
        records.withColumn(PROCESSED_AT, batch_time())
        .withColumn(_DEDUP_KEY, delivery_key())
        .withWatermark(PROCESSED_AT, interval(window))
        .dropDuplicatesWithinWatermark([_DEDUP_KEY, "dedup_attempt"])
        .drop(_DEDUP_KEY)
    )


def split_results(results: DataFrame) -> tuple[DataFrame, DataFrame]:
    """(ok, failed) rows of a handler's result: failed rows have a non-null reason.

    The ok rows lose `reason`, `dedup_token` (a release credential, not data),
    `dedup_reasons` (failure history, carried by release commands) and
    `dedup_id_bytes` (carried by release commands; the output keeps its schema).
    """
    return ok_rows(results), results.where(F.col(REASON).isNotNull())


def ok_rows(results: DataFrame) -> DataFrame:
    """The ok rows of a handler's result, as `split_results` gives them."""
    ok = results.where(F.col(REASON).isNull())
    return ok.drop(REASON, "dedup_token", "dedup_reasons", ID_BYTES)


def all_failed(records: DataFrame, reason: str) -> DataFrame:
    """Every record as failed with `reason`: what a handler that crashed produced."""
    return records.withColumn(REASON, F.lit(reason))


def with_id_bytes(results: DataFrame) -> DataFrame:
    """`results` with dedup_id_bytes; a handler result that dropped it gets dedup_id's
    UTF-8 bytes (exact for every id that is valid UTF-8)."""
    if ID_BYTES in results.columns:
        return results
    return results.withColumn(ID_BYTES, F.col("dedup_id").cast("binary"))


def release_command() -> Column:
    """The release command of a failed row (of a result with `dedup_id_bytes`, see
    `with_id_bytes`) as a struct (key, value as bytes); null when the row cannot be
    released.

    key: the id's exact bytes (dedup_id_bytes). value: `{"id", "id_b64", "token",
    "reason", "source": {"topic", "partition", "offset"}, "attempt", "reasons"}`:
    `id` is the id read as UTF-8 (invalid bytes become U+FFFD: for people),
    `id_b64` the standard base64 of its exact bytes (what the gateway acts on),
    `reasons` the earlier failures' reasons, which the gateway carries onto the
    dead letter. Rows without a dedup-id, a token or a parseable dedup-source
    (`topic/partition/offset`, the topic may hold slashes) cannot be released:
    the gateway rejects such a command, so none is made.
    """
    parts = [F.regexp_extract(F.col("dedup_source"), _SOURCE_PATTERN, i) for i in (1, 2, 3)]
    # Spark's base64 breaks lines every 76 characters (MIME); the command wants one string.
    id_b64 = F.regexp_replace(F.base64(F.col(ID_BYTES)), r"[\r\n]", "")
    body = F.struct(  # the field names gateway.contract.commands reads
        F.col("dedup_id").alias(Command.ID),
        id_b64.alias(Command.ID_B64),
        F.col("dedup_token").alias(Command.TOKEN),
        F.col(REASON).cast("string").alias(Command.REASON),
        F.struct(
            parts[0].alias(Command.TOPIC),
            parts[1].cast("int").alias(Command.PARTITION),
            parts[2].cast("long").alias(Command.OFFSET),
        ).alias(Command.SOURCE),
        F.col("dedup_attempt").cast("int").alias(Command.ATTEMPT),
        F.col("dedup_reasons").alias(Command.REASONS),
    )
    releasable = (
        F.col(REASON).isNotNull()
        & F.col("dedup_id").isNotNull()
        & F.col(ID_BYTES).isNotNull()
        & F.col("dedup_token").isNotNull()
        & F.col("dedup_source").rlike(_SOURCE_PATTERN)
    )
    command = F.struct(
        F.col(ID_BYTES).alias("key"),
        F.to_json(body, {"ignoreNullFields": "false"}).cast("binary").alias("value"),
    )
    return F.when(releasable, command)


def release_commands(failed: DataFrame) -> DataFrame:
    """Failure-topic records (key, value as bytes) for the failed rows that can be
    released (`release_command`)."""
    command = with_id_bytes(failed).select(release_command().alias("c"))
    return command.where(F.col("c").isNotNull()).select("c.key", "c.value")
