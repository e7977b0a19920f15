"""The pluggable per-batch business logic, and the shipped example.

Contract. A handler is a callable `(records: DataFrame) -> DataFrame`, named in
config as `spark.handler = "module:function"` (or, with `spark.handler_options`,
a factory called with those keyword arguments that returns the handler). It
gets one micro-batch of deduplicated records: the Kafka columns (key, value,
topic, partition, offset, timestamp, timestampType, headers) plus dedup_id,
dedup_source, dedup_token, dedup_attempt, dedup_reasons, dedup_id_bytes and
processed_at. It returns one row per record it has an outcome for, keeping the
`dedup_*` columns and adding `reason` (string): null means success, anything
else is why the record failed. (A result without dedup_id_bytes still works:
its release commands then name the id by dedup_id, which is exact only for
ids that are valid UTF-8.)

- rows with a null reason are written to Parquet (minus reason, dedup_token,
  dedup_reasons and dedup_id_bytes);
- rows with a reason become release commands on the failure topic;
- records the handler leaves out are neither (deliberately filtered);
- if the handler raises, or its result cannot be computed, every record of
  the batch fails with the exception text as reason; the stream goes on.

Handlers run on the driver and should stay lazy (return a DataFrame plan);
the sink evaluates the result once per micro-batch and stores it: a re-run of
the batch reuses the stored outcomes instead of calling the handler again.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from typing import Any

from pyspark.sql import DataFrame
from pyspark.sql import functions as F
from pyspark.sql.types import StringType, StructField, StructType

from spark_sink.transforms import DEDUP_COLUMNS, ID_BYTES, REASON, try_cast

logger = logging.getLogger(__name__)

Handler = Callable[[DataFrame], DataFrame]
REQUIRED_COLUMNS = (*DEDUP_COLUMNS, REASON)
# How many distinct failure reasons a mostly-failed batch's log line names.
REASONS_SHOWN = 3

ORDER_SCHEMA = StructType(
    [
        StructField("order_id", StringType()),
        StructField("customer", StringType()),
        StructField("amount", StringType()),
    ]
)
# Where `orders` finds a value that is not a JSON object (from_json's corrupt record).
_CORRUPT = "_not_an_object"
ORDER_COLUMNS = (
    "dedup_id",
    "order_id",
    "customer",
    "amount",
    "topic",
    "partition",
    "offset",
    "timestamp",
    "dedup_source",
    "dedup_attempt",
    "dedup_token",
    "dedup_reasons",
    ID_BYTES,
    REASON,
)


class HandlerError(ValueError):
    """The handler is misconfigured or broke the contract (e.g. dropped a dedup column)."""


def orders(records: DataFrame) -> DataFrame:
    """Example: validate JSON orders `{"order_id", "customer", "amount"}`.

    A record fails when its value is not a JSON object, misses order_id or
    customer, or has a missing, non-numeric or negative amount. Aggregate the
    written output with `customer_totals`.
    """
    # Every field is read as text first: one non-numeric amount must fail that
    # record with a clear reason, not null the whole parsed object. One parse per
    # record: a value that is not a JSON object (malformed, an array, a scalar) lands
    # whole in the corrupt-record field, or parses to null when empty.
    parsed = StructType([*ORDER_SCHEMA.fields, StructField(_CORRUPT, StringType())])
    options = {"mode": "PERMISSIVE", "columnNameOfCorruptRecord": _CORRUPT}
    order = F.from_json(F.col("value").cast("string"), parsed, options)
    raw_amount = F.col("_order.amount")
    amount = try_cast("_order.amount", "DOUBLE")
    not_an_object = F.col("_order").isNull() | F.col(f"_order.{_CORRUPT}").isNotNull()
    reason = (
        F.when(not_an_object, F.lit("value is not a JSON object"))
        .when(F.col("_order.order_id").isNull(), F.lit("missing order_id"))
        .when(F.col("_order.customer").isNull(), F.lit("missing customer"))
        .when(raw_amount.isNull(), F.lit("missing amount"))
        .when(amount.isNull(), F.concat(F.lit("amount is not a number: "), raw_amount))
        .when(amount < 0, F.concat(F.lit("negative amount: "), raw_amount))
    )
    # Two DataFrame steps (each is an analysis of the batch's plan over py4j).
    computed = {
        "order_id": F.col("_order.order_id"),
        "customer": F.col("_order.customer"),
        "amount": amount,
        REASON: reason,
    }
    return records.withColumn("_order", order).select(
        *(computed[c].alias(c) if c in computed else F.col(c) for c in ORDER_COLUMNS)
    )


def passthrough(records: DataFrame) -> DataFrame:
    """Every record succeeds: the records as they come, with a null `reason`.

    The deploy default when there is no business step yet: the clean topic,
    deduplicated once more, lands in the Parquet output.
    """
    return records.withColumn(REASON, F.lit(None).cast(StringType()))


def customer_totals(written_orders: DataFrame) -> DataFrame:
    """Orders and amount per customer over written order rows (e.g. the Parquet output)."""
    return written_orders.groupBy("customer").agg(
        F.count("*").alias("orders"), F.sum("amount").alias("amount")
    )


def resolve_handler(spec: str, options: dict[str, Any] | None = None) -> Handler:
    """The handler named by `module:function` (a bare name means this module).

    With `options`, the named object is a factory and is called with them.
    """
    module_name, _, attr = spec.rpartition(":")
    try:
        module = importlib.import_module(module_name or __name__)
        target = getattr(module, attr)
    except (ImportError, AttributeError) as exc:
        raise HandlerError(f"cannot load handler {spec!r}: {exc}") from exc
    handler = target(**options) if options else target
    if not callable(handler):
        raise HandlerError(f"handler {spec!r} is not callable")
    return handler  # type: ignore[no-any-return]


def check_result(result: DataFrame) -> None:
    """Raise HandlerError when a handler's result lacks a column the sink needs."""
    missing = [c for c in REQUIRED_COLUMNS if c not in result.columns]
    if missing:
        raise HandlerError(f"handler result lacks column(s) {missing}")


def warn_if_mostly_failed(
    reasons: list[str], batch_id: int, records: int, failures: int, share: float
) -> bool:
    """Log an ERROR naming `reasons` (the first of the batch's failure reasons) when more
    than `share` of a batch's `records` failed; returns whether it did.

    Many failures at once mean a handler that does not fit the data (e.g. the
    `orders` example on records that are not JSON orders), not bad records: every
    one of them is released and retried by the gateway until it is dead-lettered.
    """
    if records == 0 or failures <= share * records:
        return False
    logger.error(
        "batch %d: the handler failed %d of %d records (more than %.0f%%; each is released"
        " and retried); first reasons: %s",
        batch_id, failures, records, share * 100, "; ".join(reasons[:REASONS_SHOWN]),
    )  # fmt: skip
    return True
