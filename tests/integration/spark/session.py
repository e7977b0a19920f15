"""The one SparkSession a pytest run shares (starting one costs ~10 s), with Spark's
Kafka connector on its classpath as the job has it, plus helpers to produce records
shaped as the gateway writes them, and the marks of tests that need the Python source."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import pyspark
import pytest
from confluent_kafka import Producer
from pyspark.sql import SparkSession

from devtools.jars import spark_kafka_jars, table_formats, table_jars
from gateway.contract.tokens import owner_token
from spark_sink.connector import python_source_missing
from spark_sink.session import DEFAULT_CONF
from spark_sink.tables import DELTA_CONF

# Why this pyspark cannot run spark_sink.kafka_source (None: it can, 4.2+).
PYTHON_SOURCE_MISSING = python_source_missing()
# The marks of a test of the Python source: its own subset (`-m spark_python_source`),
# skipped on a pyspark without its API (the compat venvs: `make spark-compat`).
PYTHON_SOURCE = (
    pytest.mark.spark_python_source,
    pytest.mark.skipif(PYTHON_SOURCE_MISSING is not None, reason=str(PYTHON_SOURCE_MISSING)),
)


def python_source_test(test: Any) -> Any:
    """Marks a test of the Python source (`PYTHON_SOURCE`)."""
    for mark in PYTHON_SOURCE:
        test = mark(test)
    return test


def skip_module_without_python_source() -> None:
    """Skip the calling test module where the Python source cannot even be imported."""
    if PYTHON_SOURCE_MISSING is not None:
        pytest.skip(PYTHON_SOURCE_MISSING, allow_module_level=True)


# pyspark warns about versions it was not built against; nothing to fix on our side.
SPARK_WARNING_FILTERS = ("ignore:PySpark does not yet fully support pandas:FutureWarning",)


# PySpark before 4.2 (3.5.7 and 4.1.1 here) leaves the sockets it reads results from to
# the garbage collector: under `-W error` each one is an unraisable exception.
BEFORE_4_2_WARNING_FILTERS = ("ignore:unclosed <socket.socket:ResourceWarning",)


def add_spark_warning_filters(config: pytest.Config) -> None:
    specs = SPARK_WARNING_FILTERS
    if tuple(int(n) for n in pyspark.__version__.split(".")[:2]) < (4, 2):
        specs += BEFORE_4_2_WARNING_FILTERS
    for spec in specs:
        config.addinivalue_line("filterwarnings", spec)


@pytest.fixture(scope="session")
def spark() -> Iterator[SparkSession]:
    """local[2], the job's own defaults (spark_sink.session.DEFAULT_CONF) but two shuffle
    partitions (= two state stores per stateful batch), no UI; Spark's Kafka connector
    and the table formats' jars for this pyspark (devtools/jars.py, fetched once) on the
    classpath, as the job puts them there when it starts Spark itself."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    connector = sorted(str(jar) for jar in spark_kafka_jars(pyspark.__version__).glob("*.jar"))
    # The table formats with a build for this Spark (tests/integration/spark/test_tables.py),
    # and Delta's static settings, as the job sets them for `output_format = "delta"`.
    tables = table_formats(pyspark.__version__)
    for output_format in tables:
        connector += sorted(
            str(jar) for jar in table_jars(output_format, pyspark.__version__).glob("*.jar")
        )
    builder = SparkSession.builder.master("local[2]").appName("spark-sink-tests")
    for key, value in {
        **DEFAULT_CONF,
        "spark.jars": ",".join(connector),
        "spark.sql.shuffle.partitions": "2",
        "spark.ui.enabled": "false",
        "spark.ui.showConsoleProgress": "false",
        "spark.sql.streaming.minBatchesToRetain": "5",
        **(DELTA_CONF if "delta" in tables else {}),
    }.items():
        builder = builder.config(key, value)
    session = builder.getOrCreate()
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()


@dataclass(frozen=True)
class Clean:
    """One clean-topic record as the gateway forwards it (`id`: the dedup-id header,
    text or exact bytes)."""

    id: str | bytes | None
    value: bytes | None
    partition: int = 0
    token: str | None = None
    source: str | None = None
    attempt: int | None = None
    key: bytes | None = None
    extra_headers: tuple[tuple[str, bytes], ...] = ()

    def headers(self) -> list[tuple[str, bytes]]:
        headers = list(self.extra_headers)
        if self.id is not None:
            id_bytes = self.id.encode() if isinstance(self.id, str) else self.id
            headers.append(("dedup-id", id_bytes))
        if self.source is not None:
            headers.append(("dedup-source", self.source.encode()))
        if self.token is not None:
            headers.append(("dedup-token", self.token.encode()))
        if self.attempt is not None:
            headers.append(("dedup-attempt", str(self.attempt).encode()))
        return headers


def order(
    n: int,
    *,
    partitions: int = 1,
    amount: Any = None,
    customer: str | None = None,
    attempt: int | None = None,
    raw_offset: int | None = None,
) -> Clean:
    """Clean record for order `o-<n>` with a valid amount unless one is given, forwarded
    from raw record `raw/<n % partitions>/<raw_offset, default n>`, with the token the
    gateway gives that raw record and attempt (`source_token`)."""
    body = {"order_id": f"o-{n}", "customer": customer or f"c-{n % 3}", "amount": n + 0.5}
    if amount is not None:
        body["amount"] = amount
    partition = n % partitions
    offset = raw_offset if raw_offset is not None else n
    return Clean(
        id=f"o-{n}",
        value=json.dumps(body).encode(),
        partition=partition,
        token=source_token(partition, offset, attempt),
        source=f"raw/{partition}/{offset}",
        attempt=attempt,
        key=f"o-{n}".encode(),
    )


def source_token(partition: int, offset: int, attempt: int | None = None) -> str:
    """The dedup-token of raw record `raw/<partition>/<offset>` at `attempt` (as the gateway)."""
    return owner_token("raw", partition, offset, attempt or 1)


def produce(bootstrap: str, topic: str, records: Iterable[Clean]) -> int:
    """Produce `records` in multi-record batches (the broker's tricky case); returns the count."""
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 20, "log_level": 3})
    errors: list[Any] = []
    count = 0
    for rec in records:
        producer.produce(
            topic,
            key=rec.key,
            value=rec.value,
            partition=rec.partition,
            headers=rec.headers(),
            on_delivery=lambda err, _msg: errors.append(err) if err else None,
        )
        count += 1
    assert producer.flush(30) == 0
    assert not errors, errors
    return count
