"""The foreachBatch sink: run the handler, store its outcomes, write successes, release failures.

A re-run gives what the first run gave. Spark journals each micro-batch's
offsets before running it and re-runs an unfinished batch with the same id and
the same input (and the same dedup state and processing time); the handler,
though, may answer differently the second time (an external service changed
its mind, a bug was fixed). So the handler is asked once per batch: its
evaluated result (the batch's outcomes) is stored as Parquet under
`<checkpoint_dir>/outcomes/<batch_id>/` and committed by a marker file written
after it; a re-run that finds committed outcomes for the same input reuses
them and does not call the handler. Output and release commands are both made
from the stored outcomes, so a record is written or released, never both or
neither, whatever the handler says on a re-run.

Cost per batch. The first run makes one pass over the input: the write of the
outcomes, which also fingerprints the input and counts the outcomes (Spark's
observed metrics, `DataFrame.observe`), so nothing is cached or counted apart.
The output is a second pass, over the stored Parquet; release commands are
collected only when some outcome failed. A re-run (a marker is there) makes one
pass more to fingerprint its input before it trusts the stored outcomes.

Exactly-once output. The ok rows of batch N are written with mode overwrite
to `<output_path>/batch_id=N/`, so a re-run replaces what a crashed attempt
left rather than adding to it. Readers see the whole output with
`spark.read.parquet(output_path)` (batch_id becomes a column). To write
somewhere else, set `spark.output_path` to any URI Spark can write (hdfs://,
s3a://...), or replace `BatchSink.write_output` in a subclass for a table format.

Release commands once per failure. The failure topic cannot take part in a
transaction (and the test broker has no transactions), so the sink keeps a
marker per batch: `<checkpoint_dir>/releases/<batch_id>.done` is written only
after the producer has flushed every command of the batch and each was
acknowledged; a re-run of a batch with a marker publishes nothing. The one
window left, a crash between the last ack and the marker, republishes that
batch's commands; the gateway treats a command as idempotent per token, so
the duplicate is harmless.

Markers hold a fingerprint of the batch's input (record count and an XOR of
hashes of their coordinates) and count only when whole and equal to the
current input's: a marker cut short by a crash (on HDFS a file is visible
while it is written), or left by another query that reused the directory
with other batch ids, is ignored. Every file under
`checkpoint_dir` goes through Hadoop's FileSystem API (`CheckpointFiles`), so
it can be any Hadoop URI (a local path, file:, hdfs:, s3a: with its
connector). Markers older than `MARKERS_KEPT` batches and outcomes older than
`OUTCOMES_KEPT` are pruned: Spark only ever re-runs the last batch.
"""

from __future__ import annotations

import logging
import re
import threading
from dataclasses import dataclass, field
from typing import Any

from py4j.protocol import Py4JJavaError
from pyspark.sql import Column, DataFrame, Observation, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import NullType, StringType

from spark_sink.handlers import Handler, check_result, warn_if_mostly_failed
from spark_sink.transforms import REASON, all_failed, release_commands, split_results

logger = logging.getLogger(__name__)

MARKERS_KEPT = 100
# Outcomes are a copy of a batch's records: keep the previous batch's for inspection only.
OUTCOMES_KEPT = 1
REASON_MAX_CHARS = 1000
FLUSH_TIMEOUT_S = 60.0
RELEASES_DIR = "releases"
OUTCOMES_DIR = "outcomes"
# Inside the outcomes directory; Spark's Parquet reader skips names starting with "_".
OUTCOMES_MARKER = "_OUTCOMES_COMPLETE"
CHECKSUM_EXCEPTION = "org.apache.hadoop.fs.ChecksumException"


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
    # Batches whose stored outcomes were reused instead of calling the handler.
    outcomes_reused: int = 0


class CheckpointFiles:
    """Small files and directories under a root URI, through Hadoop's FileSystem API
    (the same one Spark uses for its checkpoint), never Python file calls: the
    root may be a local path or any Hadoop URI (file:, hdfs:, s3a:...)."""

    def __init__(self, spark: SparkSession, root: str) -> None:
        jvm: Any = spark._jvm
        jsc: Any = spark._jsc
        self._jvm = jvm
        self.root = root.rstrip("/") or "/"
        self._fs: Any = jvm.org.apache.hadoop.fs.Path(self.root).getFileSystem(
            jsc.hadoopConfiguration()
        )

    def uri(self, relative: str) -> str:
        """The URI of `relative` (slash-separated) under the root."""
        return f"{self.root}/{relative}"

    def _path(self, relative: str) -> Any:
        return self._jvm.org.apache.hadoop.fs.Path(self.uri(relative))

    def exists(self, relative: str) -> bool:
        return bool(self._fs.exists(self._path(relative)))

    def read_text(self, relative: str) -> str | None:
        """The file's text (UTF-8); None when it does not exist, or fails its checksum
        (a local file cut short by a crash: its .crc sidecar no longer matches)."""
        path = self._path(relative)
        if not self._fs.exists(path):
            return None
        stream = self._fs.open(path)
        try:
            reader = self._jvm.java.io.BufferedReader(
                self._jvm.java.io.InputStreamReader(stream, "UTF-8")
            )
            lines: list[str] = []
            while (line := reader.readLine()) is not None:
                lines.append(line)
            return "\n".join(lines)
        except Py4JJavaError as exc:
            if exc.java_exception.getClass().getName() == CHECKSUM_EXCEPTION:
                logger.warning("%s fails its checksum; treating it as absent", self.uri(relative))
                return None
            raise
        finally:
            stream.close()

    def write_text(self, relative: str, text: str) -> None:
        """Create or replace the file (creating its directories) with `text`."""
        path = self._path(relative)
        self._fs.mkdirs(path.getParent())
        out = self._fs.create(path, True)
        try:
            out.write(bytearray(text.encode()))
        finally:
            out.close()

    def names(self, relative: str) -> list[str]:
        """Names of the entries of a directory; empty when it does not exist."""
        path = self._path(relative)
        if not self._fs.exists(path):
            return []
        return [str(status.getPath().getName()) for status in self._fs.listStatus(path)]

    def delete(self, relative: str) -> None:
        """Delete a file or a whole directory (nothing when absent)."""
        self._fs.delete(self._path(relative), True)


def _fingerprint_columns() -> tuple[Column, Column]:
    """(count, xor of xxhash64(topic, partition, offset)) over a batch's records."""
    return (
        F.count(F.lit(1)).alias("n"),
        F.coalesce(F.bit_xor(F.xxhash64("topic", "partition", "offset")), F.lit(0)).alias("x"),
    )


def input_fingerprint(records: DataFrame) -> tuple[int, str]:
    """(count, fingerprint) of a batch's records, in one pass. The fingerprint is
    `<count>:<xor of xxhash64(topic, partition, offset)>`: equal for a re-run of the
    batch (same offsets, same dedup state); a marker with another is not this batch's."""
    row = records.select(*_fingerprint_columns()).first()
    assert row is not None  # a global aggregate always has one row
    return int(row.n), f"{row.n}:{row.x}"


def _observed(observation: Observation) -> dict[str, Any] | None:
    """An observation's metrics after the action that ran its plan; None when the optimizer
    removed the observed node (an empty relation: Spark then has no metrics row)."""
    try:
        return observation.get
    except Py4JJavaError:
        return None


def marker_text(fingerprint: str) -> str:
    """What a committed release marker holds; a marker cut short never equals it."""
    return f"{fingerprint} complete"


def outcomes_marker_text(fingerprint: str, ok: int, failed: int) -> str:
    """What a committed outcomes marker holds: the input's fingerprint and the stored
    outcomes' counts, so a re-run needs no pass to count them. Ends with `complete`:
    a marker cut short never parses (`parse_outcomes_marker`)."""
    return f"{fingerprint} ok={ok} failed={failed} complete"


def parse_outcomes_marker(text: str | None) -> tuple[str, int, int] | None:
    """(fingerprint, ok, failed) of a whole outcomes marker; None for a cut or absent one."""
    found = re.fullmatch(r"(\S+) ok=(\d+) failed=(\d+) complete", text or "")
    return None if found is None else (found[1], int(found[2]), int(found[3]))


@dataclass(frozen=True)
class StoredOutcomes:
    """Where a batch's outcomes are stored, and what they hold."""

    uri: str
    fingerprint: str
    ok: int
    failed: int

    @property
    def records(self) -> int:
        """Input records of the batch (the handler may have left some out)."""
        return int(self.fingerprint.split(":", 1)[0])


def storable(results: DataFrame) -> DataFrame:
    """`results` with a string `reason` and no void (NullType) column, so Parquet takes it:
    `F.lit(None)` without a cast is a void column."""
    for f in results.schema.fields:
        if f.name == REASON or isinstance(f.dataType, NullType):
            results = results.withColumn(f.name, F.col(f.name).cast(StringType()))
    return results


@dataclass
class BatchSink:
    """The `foreachBatch` function. Call it with (records, batch_id).

    `checkpoint_dir`: a local path or a Hadoop URI, where release markers and
    stored outcomes live (next to Spark's own checkpoint).
    """

    handler: Handler
    output_path: str
    checkpoint_dir: str
    failure_topic: str
    producer_config: dict[str, Any]
    counts: SinkCounts = field(default_factory=SinkCounts)
    # More than this share of a batch failed: logged as an ERROR with the first reasons.
    failure_alarm_share: float = 1.0
    _producer: Any = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __call__(self, records: DataFrame, batch_id: int) -> None:
        with self._lock:  # py4j may call back on different threads; batches are sequential
            self._process(records, batch_id)

    def _process(self, records: DataFrame, batch_id: int) -> None:
        files = CheckpointFiles(records.sparkSession, str(self.checkpoint_dir))
        stored = self.outcomes(records, batch_id, files)
        if stored.records == 0:
            return
        outcomes = records.sparkSession.read.parquet(stored.uri)
        ok, failed = split_results(outcomes)
        warn_if_mostly_failed(
            failed, batch_id, stored.records, stored.failed, self.failure_alarm_share
        )
        self.write_output(ok, batch_id)
        published = self.publish_releases(failed, batch_id, files, stored)
        self._prune(files, batch_id)
        self.counts.batches += 1
        self.counts.records += stored.records
        self.counts.failed += stored.failed
        self.counts.written += stored.ok
        self.counts.releases_published += published
        logger.info(
            "batch %d: %d records, %d written, %d failed, %d release commands",
            batch_id, stored.records, stored.ok, stored.failed, published,
        )  # fmt: skip

    def outcomes(self, records: DataFrame, batch_id: int, files: CheckpointFiles) -> StoredOutcomes:
        """The batch's stored outcomes: the handler's result stored by the first run of
        this batch, or now (calling the handler) when there is none.

        Stored as Parquet in `outcomes/<batch_id>/`, committed by the marker file
        written after it (the input's fingerprint and the counts); a directory without
        a whole marker for the same input is overwritten. The first run evaluates the
        input, the handler and the counts in one pass: the write of the outcomes."""
        where = f"{OUTCOMES_DIR}/{batch_id}"
        marker = f"{where}/{OUTCOMES_MARKER}"
        text = files.read_text(marker)
        if text is not None:  # a re-run, or another query's leftovers: compare inputs
            found = parse_outcomes_marker(text)
            _, fingerprint = input_fingerprint(records)
            if found is not None and found[0] == fingerprint:
                logger.info(
                    "batch %d: re-run; reusing the outcomes stored by its first run", batch_id
                )
                self.counts.outcomes_reused += 1
                return StoredOutcomes(files.uri(where), *found)
            logger.warning(
                "batch %d: stored outcomes are incomplete or for other input (%r, input now %r);"
                " ignoring them", batch_id, text, fingerprint,
            )  # fmt: skip
        stored = self.store_handler_result(records, batch_id, files.uri(where))
        if stored.records:
            files.write_text(
                marker, outcomes_marker_text(stored.fingerprint, stored.ok, stored.failed)
            )
        return stored

    def store_handler_result(self, records: DataFrame, batch_id: int, uri: str) -> StoredOutcomes:
        """Write the handler's result to `uri` in one pass that also fingerprints the input
        and counts the outcomes (Spark's observed metrics); all records failed if the
        handler raises or its result cannot be computed."""
        try:
            return self._store(records, self._checked_handler, uri)
        except Exception as exc:  # any handler bug must fail the records, not the stream
            logger.exception("batch %d: handler failed, failing all its records", batch_id)
            self.counts.handler_crashes += 1
            reason = f"handler error: {type(exc).__name__}: {exc}"[:REASON_MAX_CHARS]
            return self._store(records, lambda df: storable(all_failed(df, reason)), uri)

    def _checked_handler(self, records: DataFrame) -> DataFrame:
        results = self.handler(records)
        check_result(results)
        return storable(results)

    @staticmethod
    def _store(records: DataFrame, handler: Handler, uri: str) -> StoredOutcomes:
        # Fresh observations each attempt: one a failed write never filled would block get.
        seen, outcome = Observation("dedup_sink_input"), Observation("dedup_sink_outcomes")
        failed = F.col(REASON).isNotNull()
        results = handler(records.observe(seen, *_fingerprint_columns())).observe(
            outcome, F.count_if(~failed).alias("ok"), F.count_if(failed).alias("failed")
        )
        results.write.mode("overwrite").parquet(uri)
        fingerprint, counts = _observed(seen), _observed(outcome)
        if fingerprint is None:  # the handler's plan cut its input out (e.g. `limit(0)`)
            fingerprint = dict(zip("nx", input_fingerprint(records)[1].split(":"), strict=True))
        if counts is None:
            stored = records.sparkSession.read.parquet(uri)
            counts = {"ok": stored.where(~failed).count(), "failed": stored.where(failed).count()}
        return StoredOutcomes(
            uri, f"{fingerprint['n']}:{fingerprint['x']}", int(counts["ok"]), int(counts["failed"])
        )

    def write_output(self, ok: DataFrame, batch_id: int) -> None:
        """Write the ok rows of `batch_id`, replacing any earlier attempt."""
        ok.write.mode("overwrite").parquet(f"{self.output_path.rstrip('/')}/batch_id={batch_id}")

    def publish_releases(
        self, failed: DataFrame, batch_id: int, files: CheckpointFiles, stored: StoredOutcomes
    ) -> int:
        """Publish the batch's release commands unless its marker says they were; returns
        how many were published now. No pass over the outcomes when none failed."""
        marker = f"{RELEASES_DIR}/{batch_id}.done"
        if files.read_text(marker) == marker_text(stored.fingerprint):
            logger.info("batch %d: release commands already published, skipping", batch_id)
            return 0
        commands = release_commands(failed).collect() if stored.failed else []
        if commands:
            self._publish(commands, batch_id)
        files.write_text(marker, marker_text(stored.fingerprint))
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
    def _prune(files: CheckpointFiles, batch_id: int) -> None:
        """Delete release markers and stored outcomes of batches Spark will not re-run."""
        for name in files.names(RELEASES_DIR):
            stem = name.removesuffix(".done")
            if name.endswith(".done") and stem.isdigit() and int(stem) < batch_id - MARKERS_KEPT:
                files.delete(f"{RELEASES_DIR}/{name}")
        for name in files.names(OUTCOMES_DIR):
            if name.isdigit() and int(name) < batch_id - OUTCOMES_KEPT:
                files.delete(f"{OUTCOMES_DIR}/{name}")

    def close(self) -> None:
        """Flush anything still queued; safe to call twice."""
        if self._producer is not None:
            self._producer.flush(FLUSH_TIMEOUT_S)
            self._producer = None
