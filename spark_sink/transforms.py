"""Pure DataFrame transforms of the sink: no I/O, same result on a stream or a small batch.

The record path: Kafka-shaped rows (`kafka_source.SCHEMA`) -> `parse_dedup_headers`
-> `drop_duplicate_deliveries` (streams only) -> the handler -> `split_results`
-> Parquet for the ok rows, `release_commands` for the failed ones.
"""

from __future__ import annotations

from datetime import timedelta

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

# Headers the gateway adds to every clean record (values are UTF-8).
HEADER_ID = "dedup-id"
HEADER_SOURCE = "dedup-source"
HEADER_TOKEN = "dedup-token"
HEADER_ATTEMPT = "dedup-attempt"
HEADER_REASONS = "dedup-reasons"  # JSON list of earlier failure reasons, on retried records

DEDUP_COLUMNS = ("dedup_id", "dedup_source", "dedup_token", "dedup_attempt", "dedup_reasons")
REASON = "reason"
# Processing time of the micro-batch (Spark journals it, so a replayed batch sees the same).
PROCESSED_AT = "processed_at"
_DEDUP_KEY = "_dedup_key"

_SOURCE_PATTERN = r"^(.+)/(\d+)/(\d+)$"


def header(name: str) -> Column:
    """The first value of header `name` as a UTF-8 string, null when absent."""
    matches = F.filter(F.col("headers"), lambda h: h["key"] == F.lit(name))
    return F.get(matches, 0)["value"].cast("string")


def parse_dedup_headers(records: DataFrame) -> DataFrame:
    """Add dedup_id, dedup_source, dedup_token (strings), dedup_attempt (int,
    1 when the header is absent or not a number) and dedup_reasons (earlier
    failure reasons, array of strings, empty when absent) from the headers."""
    attempt = header(HEADER_ATTEMPT).try_cast("int")
    return records.select(
        "*",
        header(HEADER_ID).alias("dedup_id"),
        header(HEADER_SOURCE).alias("dedup_source"),
        header(HEADER_TOKEN).alias("dedup_token"),
        F.coalesce(attempt, F.lit(1)).alias("dedup_attempt"),
        F.coalesce(
            F.from_json(header(HEADER_REASONS), "array<string>"), F.array().cast("array<string>")
        ).alias("dedup_reasons"),
    )


def interval(duration: timedelta) -> str:
    """A Spark interval string (`withWatermark` delay) for `duration`."""
    return f"{round(duration.total_seconds() * 1000)} milliseconds"


def drop_duplicate_deliveries(records: DataFrame, window: timedelta) -> DataFrame:
    """Keep the first delivery of each (dedup_id, dedup_attempt) seen within `window`.

    The second line of defence behind the gateway: a gateway crash between
    forwarding and recording can forward one raw record twice, with the same
    id and attempt. A deliberate retry carries a higher attempt and passes.

    Time is the micro-batch's processing time, not the record timestamp: the
    gateway keeps the raw timestamp, so a retry forwarded hours later would be
    "late" against an event-time watermark and silently dropped. Records
    without a dedup-id are never merged (their key is their own coordinates).
    Needs a streaming DataFrame; the state lives in the query's checkpoint.
    """
    key = F.coalesce(
        F.col("dedup_id"),
        F.concat_ws("/", F.lit("\u0000no-id"), "topic", "partition", "offset"),
    )
    return (
        records.withColumn(PROCESSED_AT, F.current_timestamp())
        .withColumn(_DEDUP_KEY, key)
        .withWatermark(PROCESSED_AT, interval(window))
        .dropDuplicatesWithinWatermark([_DEDUP_KEY, "dedup_attempt"])
        .drop(_DEDUP_KEY)
    )


def split_results(results: DataFrame) -> tuple[DataFrame, DataFrame]:
    """(ok, failed) rows of a handler's result: failed rows have a non-null reason.

    The ok rows lose `reason`, `dedup_token` (a release credential, not data)
    and `dedup_reasons` (failure history, carried by release commands).
    """
    failed = results.where(F.col(REASON).isNotNull())
    ok = results.where(F.col(REASON).isNull()).drop(REASON, "dedup_token", "dedup_reasons")
    return ok, failed


def all_failed(records: DataFrame, reason: str) -> DataFrame:
    """Every record as failed with `reason`: what a handler that crashed produced."""
    return records.withColumn(REASON, F.lit(reason))


def release_commands(failed: DataFrame) -> DataFrame:
    """Failure-topic records (key, value as bytes) for failed rows that can be released.

    value: `{"id", "token", "reason", "source": {"topic", "partition", "offset"},
    "attempt", "reasons"}` (`reasons`: the earlier failures' reasons, which the
    gateway carries onto the dead letter). Rows without a dedup-id, a token or a
    parseable dedup-source (`topic/partition/offset`, the topic may hold slashes)
    cannot be released:
    the gateway rejects such a command, so none is made.
    """
    parts = [F.regexp_extract(F.col("dedup_source"), _SOURCE_PATTERN, i) for i in (1, 2, 3)]
    body = F.struct(
        F.col("dedup_id").alias("id"),
        F.col("dedup_token").alias("token"),
        F.col(REASON).cast("string").alias("reason"),
        F.struct(
            parts[0].alias("topic"),
            parts[1].cast("int").alias("partition"),
            parts[2].cast("long").alias("offset"),
        ).alias("source"),
        F.col("dedup_attempt").cast("int").alias("attempt"),
        F.col("dedup_reasons").alias("reasons"),
    )
    releasable = (
        F.col("dedup_id").isNotNull()
        & F.col("dedup_token").isNotNull()
        & F.col("dedup_source").rlike(_SOURCE_PATTERN)
    )
    return failed.where(releasable).select(
        F.col("dedup_id").cast("binary").alias("key"),
        F.to_json(body, {"ignoreNullFields": "false"}).cast("binary").alias("value"),
    )
