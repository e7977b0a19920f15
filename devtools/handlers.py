"""Spark handlers for tests and the demo (not shipped with the product)."""

from __future__ import annotations

from collections.abc import Iterable

from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from spark_sink.handlers import Handler, resolve_handler
from spark_sink.transforms import REASON


def failing_ids(
    ids: Iterable[str],
    reason: str = "rejected for test",
    inner: str | Handler = "orders",
    up_to_attempt: int | None = None,
) -> Handler:
    """A handler factory: `inner`, except the records whose dedup_id is in `ids` fail
    (only while their attempt is at most `up_to_attempt`, when given).

    Config form: `handler = "spark_sink.handlers:failing_ids"` with
    `handler_options = {ids = ["o-1", "o-7"], up_to_attempt = 2}`.
    """
    chosen = sorted(set(ids))
    base = resolve_handler(inner) if isinstance(inner, str) else inner

    def handler(records: DataFrame) -> DataFrame:
        result = base(records)
        rejected = F.col("dedup_id").isin(chosen)
        if up_to_attempt is not None:
            rejected = rejected & (F.col("dedup_attempt") <= up_to_attempt)
        return result.withColumn(REASON, F.when(rejected, F.lit(reason)).otherwise(F.col(REASON)))

    return handler
