"""The foreachBatch sink: run the handler, store its outcomes, write successes, release failures.

A re-run gives what the first run gave. Spark journals each micro-batch's
offsets before running it and re-runs an unfinished batch with the same id and
the same input (and the same dedup state and processing time); the handler,
though, may answer differently the second time (an external service changed
its mind, a bug was fixed). So the handler is asked once per batch and its
answer is stored before anyone sees it: the ok rows, written as Parquet to a
staging directory `<output_path>/_pending/batch_id=<n>/` (hidden from readers
of the output: Spark skips names starting with "_"), and the failed rows'
release commands with the counts, in the marker file
`<checkpoint_dir>/outcomes/<batch_id>/_OUTCOMES_COMPLETE` written after the
Parquet. The marker decides the batch: only then is the staged directory moved
to `<output_path>/batch_id=<n>/` and are the commands published. A re-run that
finds a whole marker for the same input reuses it and does not call the
handler: it finishes the move if the crash came before it, and publishes the
stored commands unless they were. A record is written or released, never both
or neither, whatever the handler says on a re-run.

Cost per batch. The first run makes one pass over the input: the Parquet write
of the ok rows, which also fingerprints the input, counts the outcomes and
collects the failed rows' release commands (Spark's observed metrics,
`DataFrame.observe`), so nothing is cached, counted apart or written twice. A
re-run (a marker is there) makes one pass more to fingerprint its input before
it trusts the marker.

Exactly-once output. The ok rows of batch N end in `<output_path>/batch_id=N/`,
moved there whole by a rename (a copy on object stores without renames), which
replaces what an earlier attempt left. Readers see the whole output with
`spark.read.parquet(output_path)` (batch_id becomes a column). `output_path`
can be any URI Spark can write (hdfs://, s3a://...); for a table format,
replace `BatchSink.stage_output` and `BatchSink.publish_output` in a subclass.

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
with other batch ids, is ignored. Every file under `checkpoint_dir` and
`output_path` goes through Hadoop's FileSystem API (`CheckpointFiles`), so
either can be any Hadoop URI (a local path, file:, hdfs:, s3a: with its
connector). Markers older than `MARKERS_KEPT` batches and outcomes older than
`OUTCOMES_KEPT` are pruned: Spark only ever re-runs the last batch.
"""

from __future__ import annotations

import base64
import json
import logging
import threading
from dataclasses import dataclass, field
from typing import Any

import pyspark
from py4j.protocol import Py4JJavaError
from pyspark.sql import Column, DataFrame, Observation, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import NullType, StringType

from spark_sink.files import CheckpointFiles
from spark_sink.handlers import REASONS_SHOWN, Handler, check_result, warn_if_mostly_failed
from spark_sink.transforms import (
    REASON,
    all_failed,
    ok_rows,
    release_command,
    with_id_bytes,
)

logger = logging.getLogger(__name__)

# Before Spark 4.1 (measured: 3.5.7, 4.0.1), Observation.get waits forever for the metrics
# of a node the optimizer removed; 4.1 and later raise.
OBSERVATION_GET_WAITS = tuple(int(part) for part in pyspark.__version__.split(".")[:2]) < (4, 1)

MARKERS_KEPT = 100
# Outcomes are a copy of a batch's records: keep the previous batch's for inspection only.
OUTCOMES_KEPT = 1
REASON_MAX_CHARS = 1000
# Dictionary encoding off: Spark's default Parquet write cost 13.5-17.9 µs of JVM CPU per
# row here, 8.1-10.0 without dictionaries, for 11% more bytes (docs/spark-performance.md).
PARQUET_OPTIONS = {"parquet.enable.dictionary": "false"}
FLUSH_TIMEOUT_S = 60.0
RELEASES_DIR = "releases"
OUTCOMES_DIR = "outcomes"
# Under output_path: the ok rows of a batch before its marker commits them.
PENDING_DIR = "_pending"
# Inside the outcomes directory; Spark's Parquet reader skips names starting with "_".
OUTCOMES_MARKER = "_OUTCOMES_COMPLETE"


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


def _fingerprint_columns() -> tuple[Column, Column]:
    """(count, xor of xxhash64(topic, partition, offset)) over a batch's records."""
    return (
        F.count(F.lit(1)).alias("n"),
        F.coalesce(F.bit_xor(F.xxhash64("topic", "partition", "offset")), F.lit(0)).alias("x"),
    )


def _summary_columns() -> tuple[Column, ...]:
    """The outcomes of a handler's result (with dedup_id_bytes, `with_id_bytes`): counts,
    the failed rows' release commands and the first and last failure reasons."""
    failed = F.col(REASON).isNotNull()
    return (
        F.count_if(~failed).alias("ok"),
        F.count_if(failed).alias("failed"),
        # collect_list skips nulls: the commands of the failed rows that can be released.
        # As one JSON string (binary fields in base64): a plain value whatever Spark hands
        # back, where Spark 3.5's observations give JVM objects for nested values.
        F.to_json(F.collect_list(release_command())).alias("commands"),
        F.min(F.when(failed, F.col(REASON))).alias("first_reason"),
        F.max(F.when(failed, F.col(REASON))).alias("last_reason"),
    )


# The columns every batch's plan uses, built once per SparkContext (the one they belong
# to, the fingerprint's, the summary's): each pyspark function call and each step of a
# JVM class name is a round trip over py4j (about 1,400 of them a batch, 0.2 s of a
# one-record batch, before these were built once; docs/spark-performance.md).
_batch_columns: tuple[Any, tuple[Column, ...], tuple[Column, ...]] | None = None


def batch_columns(spark: SparkSession) -> tuple[tuple[Column, ...], tuple[Column, ...]]:
    """(the input fingerprint's columns, the outcomes' summary columns) for `spark`."""
    global _batch_columns
    if _batch_columns is None or _batch_columns[0] is not spark.sparkContext:
        _batch_columns = (spark.sparkContext, _fingerprint_columns(), _summary_columns())
    return _batch_columns[1], _batch_columns[2]


def input_fingerprint(records: DataFrame) -> tuple[int, str]:
    """(count, fingerprint) of a batch's records, in one pass. The fingerprint is
    `<count>:<xor of xxhash64(topic, partition, offset)>`: equal for a re-run of the
    batch (same offsets, same dedup state); a marker with another is not this batch's."""
    row = records.select(*batch_columns(records.sparkSession)[0]).first()
    assert row is not None  # a global aggregate always has one row
    return int(row.n), f"{row.n}:{row.x}"


def _observed(observation: Observation, written: DataFrame) -> dict[str, Any] | None:
    """An observation's metrics after the action that wrote `written` ran its plan; None
    when the optimizer removed the observed node (an empty relation: Spark then has no
    metrics row).

    Spark 4.1 and later raise for a removed node; before, `get` would wait for its metrics
    forever, so there the written plan is looked at first (one optimization of it more
    per batch)."""
    if OBSERVATION_GET_WAITS:
        plan = written._jdf.queryExecution().optimizedPlan().toString()
        if f"CollectMetrics {observation._name}," not in plan:
            return None
    try:
        return observation.get
    except Py4JJavaError:
        return None


def _release_commands(commands: str | None) -> tuple[tuple[bytes, bytes], ...]:
    """The (key, value) pairs of the summary's `commands` (`_summary_columns`)."""
    decode = base64.b64decode
    return tuple((decode(c["key"]), decode(c["value"])) for c in json.loads(commands or "[]"))


def marker_text(fingerprint: str) -> str:
    """What a committed release marker holds; a marker cut short never equals it."""
    return f"{fingerprint} complete"


@dataclass(frozen=True)
class StoredOutcomes:
    """A batch's outcomes as its first run decided them: the input's fingerprint, the
    counts, the release commands (key, value) and the first failure reasons."""

    fingerprint: str
    ok: int
    failed: int
    commands: tuple[tuple[bytes, bytes], ...] = ()
    reasons: tuple[str, ...] = ()

    @property
    def records(self) -> int:
        """Input records of the batch (the handler may have left some out)."""
        return int(self.fingerprint.split(":", 1)[0])


def outcomes_marker_text(stored: StoredOutcomes) -> str:
    """What a committed outcomes marker holds: one JSON object ending with
    `"complete": true`, so a marker cut short never parses (`parse_outcomes_marker`)."""
    b64 = base64.b64encode
    return json.dumps(
        {
            "fingerprint": stored.fingerprint,
            "ok": stored.ok,
            "failed": stored.failed,
            "reasons": list(stored.reasons),
            "commands": [[b64(k).decode(), b64(v).decode()] for k, v in stored.commands],
            "complete": True,
        }
    )


def parse_outcomes_marker(text: str | None) -> StoredOutcomes | None:
    """The outcomes a whole marker holds; None for a cut, absent or foreign one."""
    try:
        data = json.loads(text or "")
        if data["complete"] is not True:
            return None
        return StoredOutcomes(
            str(data["fingerprint"]),
            int(data["ok"]),
            int(data["failed"]),
            tuple((base64.b64decode(k), base64.b64decode(v)) for k, v in data["commands"]),
            tuple(str(r) for r in data["reasons"]),
        )
    except (ValueError, TypeError, KeyError):
        return None


def storable(results: DataFrame) -> DataFrame:
    """`results` with a string `reason` and no void (NullType) column, so Parquet takes it:
    `F.lit(None)` without a cast is a void column."""
    for f in results.schema.fields:
        if (f.name == REASON and f.dataType != StringType()) or isinstance(f.dataType, NullType):
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
    # (SparkContext, checkpoint files, output files): reused by the batches of one context.
    _files: tuple[Any, CheckpointFiles, CheckpointFiles] | None = None

    def __call__(self, records: DataFrame, batch_id: int) -> None:
        with self._lock:  # py4j may call back on different threads; batches are sequential
            self._process(records, batch_id)

    def _process(self, records: DataFrame, batch_id: int) -> None:
        files, out = self._reuse(records.sparkSession)
        stored = self.outcomes(records, batch_id, files, out)
        if stored.records == 0:  # Spark's first batch on a topic without records yet
            out.delete(self.pending(batch_id))  # its empty staging: nothing to publish
            return
        warn_if_mostly_failed(
            list(stored.reasons), batch_id, stored.records, stored.failed,
            self.failure_alarm_share,
        )  # fmt: skip
        self.publish_output(out, batch_id)
        published = self.publish_releases(batch_id, files, stored)
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

    def _reuse(self, spark: SparkSession) -> tuple[CheckpointFiles, CheckpointFiles]:
        """(checkpoint files, output files), built once per SparkContext."""
        if self._files is None or self._files[0] is not spark.sparkContext:
            self._files = (
                spark.sparkContext,
                CheckpointFiles(spark, str(self.checkpoint_dir)),
                CheckpointFiles(spark, str(self.output_path)),
            )
        return self._files[1], self._files[2]

    @staticmethod
    def pending(batch_id: int) -> str:
        """Where the ok rows of `batch_id` wait for their marker, under output_path."""
        return f"{PENDING_DIR}/batch_id={batch_id}"

    def outcomes(
        self, records: DataFrame, batch_id: int, files: CheckpointFiles, out: CheckpointFiles
    ) -> StoredOutcomes:
        """The batch's outcomes: those stored by the first run of this batch, or now
        (calling the handler) when there are none.

        The ok rows are staged under `output_path` (`pending`), then the marker
        `outcomes/<batch_id>/_OUTCOMES_COMPLETE` commits them with the input's
        fingerprint, the counts and the release commands; staged rows without a whole
        marker for the same input are overwritten. The first run evaluates the input,
        the handler, the counts and the commands in one pass: the staging write."""
        marker = f"{OUTCOMES_DIR}/{batch_id}/{OUTCOMES_MARKER}"
        text = files.read_text(marker)
        if text is not None:  # a re-run, or another query's leftovers: compare inputs
            found = parse_outcomes_marker(text)
            _, fingerprint = input_fingerprint(records)
            if found is not None and found.fingerprint == fingerprint:
                logger.info(
                    "batch %d: re-run; reusing the outcomes stored by its first run", batch_id
                )
                self.counts.outcomes_reused += 1
                return found
            logger.warning(
                "batch %d: stored outcomes are incomplete or for other input (%.200r, input"
                " now %r); ignoring them", batch_id, text, fingerprint,
            )  # fmt: skip
        stored = self.store_handler_result(records, batch_id, out.uri(self.pending(batch_id)))
        if stored.records:
            files.write_text(marker, outcomes_marker_text(stored))
        return stored

    def store_handler_result(self, records: DataFrame, batch_id: int, uri: str) -> StoredOutcomes:
        """Stage the ok rows of the handler's result at `uri` in one pass that also
        fingerprints the input, counts the outcomes and collects the release commands
        (Spark's observed metrics); all records failed if the handler raises or its
        result cannot be computed."""
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

    def _store(self, records: DataFrame, handler: Handler, uri: str) -> StoredOutcomes:
        # Fresh observations each attempt: one a failed write never filled would block get.
        seen, outcome = Observation("dedup_sink_input"), Observation("dedup_sink_outcomes")
        fingerprint_columns, summary = batch_columns(records.sparkSession)
        results = with_id_bytes(handler(records.observe(seen, *fingerprint_columns)))
        written = ok_rows(results.observe(outcome, *summary))
        self.stage_output(written, uri)
        fingerprint, counts = _observed(seen, written), _observed(outcome, written)
        if fingerprint is None:  # the handler's plan cut its input out (e.g. `limit(0)`)
            fingerprint = dict(zip("nx", input_fingerprint(records)[1].split(":"), strict=True))
        if counts is None:
            # The optimizer proved that no row is ok (e.g. a constant reason) and cut the
            # observed node out with the write's input: nothing was staged; summarize apart.
            row = results.agg(*summary).first()
            assert row is not None  # a global aggregate always has one row
            counts = row.asDict()
        commands = _release_commands(counts["commands"])
        reasons = [counts["first_reason"], counts["last_reason"]]
        reasons += [json.loads(value)["reason"] for _, value in commands[:REASONS_SHOWN]]
        return StoredOutcomes(
            f"{fingerprint['n']}:{fingerprint['x']}", int(counts["ok"]), int(counts["failed"]),
            commands, tuple(dict.fromkeys(r for r in reasons if r is not None))[:REASONS_SHOWN],
        )  # fmt: skip

    def stage_output(self, ok: DataFrame, uri: str) -> None:
        """Write the ok rows of a batch where they wait for its marker (`pending`)."""
        ok.write.mode("overwrite").options(**PARQUET_OPTIONS).parquet(uri)

    def publish_output(self, out: CheckpointFiles, batch_id: int) -> None:
        """Move the batch's staged ok rows to `<output_path>/batch_id=<n>/`, replacing any
        earlier attempt's; nothing when a run before this one moved them."""
        if out.exists(self.pending(batch_id)):
            out.replace(self.pending(batch_id), f"batch_id={batch_id}")

    def publish_releases(
        self, batch_id: int, files: CheckpointFiles, stored: StoredOutcomes
    ) -> int:
        """Publish the batch's release commands unless its marker says they were; returns
        how many were published now."""
        marker = f"{RELEASES_DIR}/{batch_id}.done"
        if files.read_text(marker) == marker_text(stored.fingerprint):
            logger.info("batch %d: release commands already published, skipping", batch_id)
            return 0
        if stored.commands:
            self._publish(stored.commands, batch_id)
        files.write_text(marker, marker_text(stored.fingerprint))
        return len(stored.commands)

    def _publish(self, commands: tuple[tuple[bytes, bytes], ...], batch_id: int) -> None:
        from confluent_kafka import Producer

        if self._producer is None:
            self._producer = Producer(self.producer_config)
        errors: list[str] = []

        def delivered(err: Any, msg: Any) -> None:
            if err is not None:
                errors.append(str(err))

        for key, value in commands:
            self._producer.produce(self.failure_topic, key=key, value=value, on_delivery=delivered)
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
