"""Every Prometheus metric of the Spark job, declared in one place.

Named like the gateway's (`gateway/metrics.py`): `dedup_spark_<thing>_<unit>`,
built against a registry passed in (each test gets its own). Two feeds:

- `JobListener`, a `StreamingQueryListener` on the driver: Spark's progress
  report of each micro-batch (rows read, batch duration, the source's offsets)
  and its idle events;
- the sink's own counts (`SinkCounts`: rows written, failed, release commands
  published, handler crashes), read when Prometheus scrapes.

Source lag per partition is the source's latest offset minus the offset the
last batch read up to, both from the progress report; Spark's Kafka connector
and the Python source (`spark_sink.kafka_source`) report both in the same
`{"topic": {"partition": offset}}` shape.

`[spark] metrics_port` (0 = off) serves them over HTTP at `/metrics`
(`serve_metrics`), like the gateway's `[health]` port.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector
from pyspark.sql.streaming.listener import (
    QueryIdleEvent,
    QueryProgressEvent,
    QueryStartedEvent,
    QueryTerminatedEvent,
    StreamingQueryListener,
)

from spark_sink.sink import SinkCounts

logger = logging.getLogger(__name__)

PREFIX = "dedup_spark"
# Micro-batches take from ~100 ms (a few rows) to minutes (a backlog at the row cap).
_BATCH_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class JobMetrics:
    """The job's metrics on `registry`; `observe_progress` takes one progress report."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.input_rows = Counter(
            f"{PREFIX}_input_rows",
            "Records read from the clean topic (before the dedup step), per Spark's progress",
            registry=registry,
        )
        self.batches = Counter(
            f"{PREFIX}_batches", "Micro-batches that read at least one record", registry=registry
        )
        self.batch_duration = Histogram(
            f"{PREFIX}_batch_duration_seconds",
            "Wall time of a micro-batch with records, from Spark's progress (batchDuration)",
            buckets=_BATCH_BUCKETS,
            registry=registry,
        )
        self.input_rate = Gauge(
            f"{PREFIX}_processed_rows_per_second",
            "Rows per second the last micro-batch with records processed",
            registry=registry,
        )
        self.source_lag = Gauge(
            f"{PREFIX}_source_lag_records",
            "Records in the clean topic past what the last micro-batch read, per partition",
            ["topic", "partition"],
            registry=registry,
        )
        self.last_progress = Gauge(
            f"{PREFIX}_last_progress_timestamp_seconds",
            "Unix time of the query's last progress or idle report (it stops when the job hangs)",
            registry=registry,
        )
        self.query_active = Gauge(
            f"{PREFIX}_query_active",
            "1 while the streaming query runs, 0 once it stopped or failed",
            registry=registry,
        )

    def observe_progress(self, progress: Mapping[str, Any], now: float | None = None) -> None:
        """Take one `StreamingQueryProgress` (its JSON as a dict)."""
        self.last_progress.set(time.time() if now is None else now)
        rows = int(progress.get("numInputRows") or 0)
        for source in progress.get("sources") or ():
            for (topic, partition), lag in source_lag(source).items():
                self.source_lag.labels(topic, partition).set(lag)
        if rows == 0:
            return  # an empty trigger: no batch ran
        self.input_rows.inc(rows)
        self.batches.inc()
        self.batch_duration.observe(int(progress.get("batchDuration") or 0) / 1000)
        self.input_rate.set(float(progress.get("processedRowsPerSecond") or 0.0))

    def observe_idle(self, now: float | None = None) -> None:
        """An idle report: the query is alive and has read everything there is."""
        self.last_progress.set(time.time() if now is None else now)


def _offsets(value: Any) -> dict[tuple[str, str], int]:
    """`{"topic": {"partition": offset}}` (a JSON string or dict) as {(topic, partition): offset};
    empty for anything else (a source that reports no offsets)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return {}
    if not isinstance(value, Mapping):
        return {}
    found: dict[tuple[str, str], int] = {}
    for topic, partitions in value.items():
        if isinstance(partitions, Mapping):
            for partition, offset in partitions.items():
                if isinstance(offset, int) and offset >= 0:
                    found[(str(topic), str(partition))] = offset
    return found


def source_lag(source: Mapping[str, Any]) -> dict[tuple[str, str], int]:
    """Per partition: the source's latest offset minus the end offset of the last batch
    (0 when caught up); partitions missing from either report are left out."""
    end, latest = _offsets(source.get("endOffset")), _offsets(source.get("latestOffset"))
    return {key: max(0, latest[key] - end[key]) for key in latest.keys() & end.keys()}


class SinkCountsCollector(Collector):
    """The sinks' counts as counters, read at scrape time (the sink owns the numbers)."""

    FIELDS = (
        ("rows_written", "written", "Rows written to the Parquet output"),
        ("rows_failed", "failed", "Records the handler failed (each gets a release command)"),
        ("release_commands", "releases_published", "Release commands published and acknowledged"),
        ("handler_crashes", "handler_crashes", "Batches whose handler raised (all records failed)"),
    )

    def __init__(self, counts: Callable[[], Iterable[SinkCounts]]) -> None:
        self._counts = counts

    def collect(self) -> Iterable[CounterMetricFamily]:
        counts = list(self._counts())
        for name, attr, doc in self.FIELDS:
            family = CounterMetricFamily(f"{PREFIX}_{name}", doc)
            family.add_metric([], float(sum(getattr(c, attr) for c in counts)))
            yield family


class JobListener(StreamingQueryListener):
    """Feeds `JobMetrics` from the query's events (on a Spark listener thread)."""

    def __init__(self, metrics: JobMetrics) -> None:
        self.metrics = metrics

    def onQueryStarted(self, event: QueryStartedEvent) -> None:
        self.metrics.query_active.set(1)

    def onQueryProgress(self, event: QueryProgressEvent) -> None:
        self.metrics.observe_progress(json.loads(event.progress.json))

    def onQueryIdle(self, event: QueryIdleEvent) -> None:
        self.metrics.observe_idle()

    def onQueryTerminated(self, event: QueryTerminatedEvent) -> None:
        self.metrics.query_active.set(0)
        if event.exception:
            logger.error("streaming query %s failed: %s", event.id, event.exception)


def serve_metrics(registry: CollectorRegistry, port: int, addr: str = "0.0.0.0") -> Any:
    """Serve `registry` at http://addr:port/metrics; returns the server (call shutdown())."""
    server, _thread = start_http_server(port, addr, registry=registry)
    logger.info("metrics on http://%s:%d/metrics", addr, server.server_port)
    return server
