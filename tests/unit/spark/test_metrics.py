"""The job's metrics from Spark's progress reports and the sink's counts, each test
on a fresh registry."""

from __future__ import annotations

import json
import urllib.request
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from spark_sink.metrics import (
    JobListener,
    JobMetrics,
    SinkCountsCollector,
    serve_metrics,
    source_lag,
)
from spark_sink.sink import SinkCounts


def progress(rows: int, end: dict[str, Any], latest: dict[str, Any] | None) -> dict[str, Any]:
    """A StreamingQueryProgress as Spark reports it (offsets as JSON strings)."""
    return {
        "numInputRows": rows,
        "batchDuration": 1500,
        "processedRowsPerSecond": 200.0,
        "sources": [
            {
                "description": "dedup_kafka",
                "endOffset": json.dumps(end),
                "latestOffset": None if latest is None else json.dumps(latest),
            }
        ],
    }


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


def value(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, labels)


def test_lag_per_partition_is_the_latest_offset_minus_what_the_batch_read():
    source = {
        "endOffset": json.dumps({"clean": {"0": 100, "1": 40}}),
        "latestOffset": json.dumps({"clean": {"0": 130, "1": 40, "2": 7}}),
    }
    assert source_lag(source) == {("clean", "0"): 30, ("clean", "1"): 0}
    assert source_lag({"endOffset": "{}", "latestOffset": None}) == {}
    assert source_lag({"endOffset": "not json", "latestOffset": {"t": {"0": 5}}}) == {}


def test_a_batch_with_rows_counts_rows_duration_and_lag(registry):
    metrics = JobMetrics(registry)
    metrics.observe_progress(
        progress(250, {"clean": {"0": 100}}, {"clean": {"0": 400}}), now=1_000.0
    )
    assert value(registry, "dedup_spark_input_rows_total") == 250
    assert value(registry, "dedup_spark_batches_total") == 1
    assert value(registry, "dedup_spark_batch_duration_seconds_sum") == 1.5
    assert value(registry, "dedup_spark_processed_rows_per_second") == 200.0
    assert value(registry, "dedup_spark_source_lag_records", topic="clean", partition="0") == 300
    assert value(registry, "dedup_spark_last_progress_timestamp_seconds") == 1_000.0


def test_an_empty_trigger_updates_lag_and_time_but_counts_no_batch(registry):
    metrics = JobMetrics(registry)
    metrics.observe_progress(progress(0, {"clean": {"0": 400}}, {"clean": {"0": 400}}), now=5.0)
    metrics.observe_idle(now=9.0)
    assert value(registry, "dedup_spark_batches_total") == 0
    assert value(registry, "dedup_spark_source_lag_records", topic="clean", partition="0") == 0
    assert value(registry, "dedup_spark_last_progress_timestamp_seconds") == 9.0


def test_listener_feeds_the_metrics_from_query_events(registry):
    listener = JobListener(JobMetrics(registry))
    listener.onQueryStarted(SimpleNamespace())  # type: ignore[arg-type]
    assert value(registry, "dedup_spark_query_active") == 1
    report = progress(10, {"c": {"0": 10}}, {"c": {"0": 12}})
    listener.onQueryProgress(SimpleNamespace(progress=SimpleNamespace(json=json.dumps(report))))  # type: ignore[arg-type]
    assert value(registry, "dedup_spark_input_rows_total") == 10
    listener.onQueryTerminated(SimpleNamespace(id="q", exception="boom"))  # type: ignore[arg-type]
    assert value(registry, "dedup_spark_query_active") == 0


def test_sink_counts_are_read_when_scraped_and_served_over_http(registry):
    counts = SinkCounts()
    registry.register(SinkCountsCollector(lambda: [counts]))
    counts.written, counts.failed, counts.releases_published = 7, 2, 2
    assert value(registry, "dedup_spark_rows_written_total") == 7
    assert value(registry, "dedup_spark_release_commands_total") == 2
    server = serve_metrics(registry, 0, "127.0.0.1")
    try:
        url = f"http://127.0.0.1:{server.server_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as reply:
            body = reply.read().decode()
    finally:
        server.shutdown()
        server.server_close()
    assert "dedup_spark_rows_failed_total 2.0" in body
