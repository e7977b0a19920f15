"""The foreachBatch sink: run the handler, write successes, release failures.

Exactly-once output. Spark journals each micro-batch's offsets before running
it and re-runs an unfinished batch with the same id and the same input (and
the same dedup state and processing time). The ok rows of batch N are written
with mode overwrite to `<output_path>/batch_id=N/`, so a re-run replaces what
a crashed attempt left rather than adding to it. Readers see the whole output
with `spark.read.parquet(output_path)` (batch_id becomes a column). To write
somewhere else, set `spark.output_path` to any URI Spark can write (hdfs://,
s3a://...), or replace `BatchSink.write_output` in a subclass for a table format.

Release commands once per failure. The failure topic cannot take part in a
transaction (and the test broker has no transactions), so the sink keeps a
marker per batch: `<checkpoint_dir>/releases/<batch_id>.done` is written
(atomically, by rename) only after the producer has flushed every command of
the batch and each was acknowledged; a re-run of a batch with a marker
publishes nothing. The one window left, a crash between the last ack and the
rename, republishes that batch's commands; the gateway treats a release as
idempotent per token, so the duplicate is harmless. Markers older than
`MARKERS_KEPT` batches are pruned: Spark only ever re-runs the last batch.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pyspark.sql import DataFrame

from spark_sink.handlers import Handler, check_result
from spark_sink.transforms import all_failed, release_commands, split_results

logger = logging.getLogger(__name__)

MARKERS_KEPT = 100
REASON_MAX_CHARS = 1000
FLUSH_TIMEOUT_S = 60.0


class ReleaseError(RuntimeError):
    """Release commands were not all acknowledged; the batch fails and Spark retries it."""


@dataclass
class SinkCounts:
    """What this sink did since it was built (re-run batches count again)."""

    batches: int = 0
    records: int = 0
    failed: int = 0
    written: int = 0
    releases_published: int = 0
    handler_crashes: int = 0


@dataclass
class BatchSink:
    """The `foreachBatch` function. Call it with (records, batch_id)."""

    handler: Handler
    output_path: str
    checkpoint_dir: Path
    failure_topic: str
    producer_config: dict[str, Any]
    counts: SinkCounts = field(default_factory=SinkCounts)
    _producer: Any = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __call__(self, records: DataFrame, batch_id: int) -> None:
        with self._lock:  # py4j may call back on different threads; batches are sequential
            self._process(records, batch_id)

    def _process(self, records: DataFrame, batch_id: int) -> None:
        records = records.persist()
        try:
            count = records.count()
            if count == 0:
                return
            results = self.apply_handler(records, batch_id)
            try:
                ok, failed = split_results(results)
                written = self.write_output(ok, batch_id)
                failures = failed.count()
                published = self.publish_releases(failed, batch_id)
            finally:
                results.unpersist()
            self.counts.batches += 1
            self.counts.records += count
            self.counts.failed += failures
            self.counts.written += written
            self.counts.releases_published += published
            logger.info(
                "batch %d: %d records, %d written, %d failed, %d release commands",
                batch_id, count, written, failures, published,
            )  # fmt: skip
        finally:
            records.unpersist()

    def apply_handler(self, records: DataFrame, batch_id: int) -> DataFrame:
        """The handler's evaluated (cached) result; all records failed if it crashes."""
        try:
            results = self.handler(records)
            check_result(results)
            results = results.persist()
            try:
                results.count()  # evaluate now, so a failing plan is caught here
            except BaseException:
                results.unpersist()
                raise
            return results
        except Exception as exc:  # any handler bug must fail the records, not the stream
            logger.exception("batch %d: handler failed, failing all its records", batch_id)
            self.counts.handler_crashes += 1
            reason = f"handler error: {type(exc).__name__}: {exc}"[:REASON_MAX_CHARS]
            return all_failed(records, reason).persist()

    def write_output(self, ok: DataFrame, batch_id: int) -> int:
        """Write the ok rows of `batch_id`, replacing any earlier attempt; returns the count."""
        ok = ok.persist()
        try:
            ok.write.mode("overwrite").parquet(
                f"{self.output_path.rstrip('/')}/batch_id={batch_id}"
            )
            return ok.count()
        finally:
            ok.unpersist()

    def publish_releases(self, failed: DataFrame, batch_id: int) -> int:
        """Publish the batch's release commands unless a marker says they were; returns
        how many were published now."""
        marker_dir = self.checkpoint_dir / "releases"
        marker = marker_dir / f"{batch_id}.done"
        if marker.exists():
            logger.info("batch %d: release commands already published, skipping", batch_id)
            return 0
        commands = release_commands(failed).collect()
        if commands:
            self._publish(commands, batch_id)
        marker_dir.mkdir(parents=True, exist_ok=True)
        tmp = marker.with_suffix(".tmp")
        tmp.write_text(f"{len(commands)}\n")
        os.replace(tmp, marker)
        self._prune_markers(marker_dir, batch_id)
        return len(commands)

    def _publish(self, commands: list[Any], batch_id: int) -> None:
        from confluent_kafka import Producer

        if self._producer is None:
            self._producer = Producer(self.producer_config)
        errors: list[str] = []

        def delivered(err: Any, msg: Any) -> None:
            if err is not None:
                errors.append(str(err))

        for row in commands:
            self._producer.produce(
                self.failure_topic,
                key=bytes(row.key),
                value=bytes(row.value),
                on_delivery=delivered,
            )
            self._producer.poll(0)
        left = self._producer.flush(FLUSH_TIMEOUT_S)
        if left or errors:
            raise ReleaseError(
                f"batch {batch_id}: {left} release commands unsent, {len(errors)} failed "
                f"(first: {errors[:1]}) on {self.failure_topic}"
            )

    @staticmethod
    def _prune_markers(marker_dir: Path, batch_id: int) -> None:
        for path in marker_dir.glob("*.done"):
            if path.stem.isdigit() and int(path.stem) < batch_id - MARKERS_KEPT:
                path.unlink(missing_ok=True)

    def close(self) -> None:
        """Flush anything still queued; safe to call twice."""
        if self._producer is not None:
            self._producer.flush(FLUSH_TIMEOUT_S)
            self._producer = None
