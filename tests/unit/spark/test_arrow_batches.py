"""The Python Kafka source's Arrow batches from fetched messages: pure, no broker."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from tests.integration.spark.session import PYTHON_SOURCE, skip_module_without_python_source

skip_module_without_python_source()

from spark_sink.kafka_source import arrow_schema, to_batch  # noqa: E402 (needs PySpark 4.2)

pytestmark = list(PYTHON_SOURCE)


class Message:
    """Stands in for confluent_kafka's Message: the accessors `to_batch` calls."""

    def __init__(self, offset: int, headers: Any, timestamp: tuple[int, int]) -> None:
        self._offset, self._headers, self._timestamp = offset, headers, timestamp

    def key(self) -> bytes | None:
        return b"k%d" % self._offset if self._offset % 2 else None

    def value(self) -> bytes:
        return b"v%d" % self._offset

    def offset(self) -> int:
        return self._offset

    def timestamp(self) -> tuple[int, int]:
        return self._timestamp

    def headers(self) -> Any:
        return self._headers


def test_messages_become_one_arrow_batch_of_the_spark_kafka_schema_row_for_row():
    ms = 1_767_225_600_000  # 2026-01-01T00:00:00Z
    msgs = [
        Message(5, [("dedup-id", b"a"), ("dedup-token", None)], (1, ms)),  # CreateTime
        Message(6, None, (0, -1)),  # no timestamp, no headers (librdkafka gives None)
        Message(7, [("dedup-id", b"b")], (2, ms + 1)),  # LogAppendTime
    ]
    batch = to_batch(arrow_schema(), "clean", 3, msgs, [5, 6, 7])
    assert batch.schema == arrow_schema()
    rows = batch.to_pylist()
    assert [(r["key"], r["value"], r["topic"], r["partition"], r["offset"]) for r in rows] == [
        (b"k5", b"v5", "clean", 3, 5),
        (None, b"v6", "clean", 3, 6),
        (b"k7", b"v7", "clean", 3, 7),
    ]
    start = datetime(2026, 1, 1, tzinfo=UTC)
    assert [r["timestamp"] for r in rows] == [start, None, start.replace(microsecond=1000)]
    assert [r["timestampType"] for r in rows] == [0, -1, 1]  # Kafka's codes, as Spark's source
    assert [r["headers"] for r in rows] == [
        [{"key": "dedup-id", "value": b"a"}, {"key": "dedup-token", "value": None}],
        [],
        [{"key": "dedup-id", "value": b"b"}],
    ]
