"""A Kafka source for Structured Streaming on PySpark's Python Data Source API.

Spark's own connector (`format("kafka")`) is used when Spark finds it; this source
stands in where it is absent (`[spark] source = "python"`, or `"auto"` without the
connector), with the same output schema (`SCHEMA`), so everything downstream is
unaware which one ran. It needs PySpark 4.2 or later (the streaming reader's
admission control: `ReadLimit`, `latestOffset(start, limit)`); importing this module
on an older PySpark raises ImportError (`spark_sink.job.python_source_missing`).
Records of aborted or open transactions are skipped: librdkafka's default
`isolation.level` is `read_committed`.

Offsets are Spark-style JSON, one next-offset-to-read per partition
(`{"clean": {"0": 1042, "1": 977}}`). Spark journals each micro-batch's (start, end)
before reading it, and `partitions()` turns a pair into the same ranges every time, so
a restarted query replays an unfinished batch exactly.

Partition ends come from the high watermark in fetch responses, not ListOffsets
("latest" was wrong on a Kafka-protocol broker the tests once used): the driver's one
consumer `assign()`s every partition at its end and waits for the end-of-partition
event, which carries it (under read_committed, the last stable offset). No consumer
group is ever joined.

Options (case-insensitive, all strings):
- `subscribe`: comma-separated topics (required);
- `kafka.<librdkafka key>`: client settings, e.g. `kafka.bootstrap.servers`;
- `startingOffsets`: `earliest` (default), `latest`, or offsets JSON;
- `maxOffsetsPerTrigger`: most offsets per micro-batch, spread fairly over the
  partitions that have data (Spark honours it with `availableNow` too);
- `endingOffsets` (batch reads only): `latest` (default) or offsets JSON.

Partitions that appear while the query runs are read from their beginning.
"""

from __future__ import annotations

import bisect
import itertools
import json
import logging
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
    DataSourceStreamReader,
    InputPartition,
)
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxRows,
    SupportsTriggerAvailableNow,
)
from pyspark.sql.types import StructType

from spark_sink.transforms import KAFKA_SCHEMA

logger = logging.getLogger(__name__)

SOURCE_NAME = "dedup_kafka"

SCHEMA = KAFKA_SCHEMA  # Spark's Kafka source schema, with includeHeaders=true

# {topic: {partition: next offset}}; the JSON form has string partition keys.
Offsets = dict[str, dict[int, int]]
TopicPartitionKey = tuple[str, int]

PROBE_TIMEOUT_S = 30.0
# A reader that sees no record and no end-of-partition for this long gives up.
READ_STALL_TIMEOUT_S = 60.0
# Most messages per consume call, and so per Arrow batch handed to Spark.
ARROW_BATCH_ROWS = 10_000
# A reader knows where its range ends: each fetch should be answered at once.
READ_FETCH_WAIT_MS = 10


class KafkaSourceError(RuntimeError):
    """The broker did not answer as the source needs (timeout, lost data, bad option)."""


# ---------------------------------------------------------------------------
# Pure offset arithmetic (unit-tested without a broker)


def offsets_to_json(offsets: Offsets) -> dict[str, dict[str, int]]:
    return {t: {str(p): o for p, o in sorted(parts.items())} for t, parts in offsets.items()}


def offsets_from_json(data: Mapping[str, Mapping[str, int]]) -> Offsets:
    return {t: {int(p): int(o) for p, o in parts.items()} for t, parts in data.items()}


def fair_shares(
    available: Mapping[TopicPartitionKey, int], budget: int
) -> dict[TopicPartitionKey, int]:
    """Split `budget` offsets over partitions by water-filling: every partition
    with data gets an equal share, what a short partition leaves goes to the
    others. Deterministic (sorted order), and takes min(budget, total)."""
    given = dict.fromkeys(available, 0)
    left = {k: n for k, n in available.items() if n > 0}
    while budget > 0 and left:
        share = max(1, budget // len(left))
        for k in sorted(left):
            take = min(share, left[k], budget)
            given[k] += take
            left[k] -= take
            budget -= take
            if budget == 0:
                break
        left = {k: n for k, n in left.items() if n > 0}
    return given


def plan_end(
    start: Offsets,
    latest: Offsets,
    max_records: int | None,
    target: Offsets | None = None,
) -> Offsets:
    """The end offsets of the next micro-batch.

    `latest` is what the broker has (every partition it knows, new ones
    included); partitions missing from `start` are new and start at 0.
    `target` (availableNow) caps the ends and hides partitions found later.
    Ends never move backwards, and every partition of `start` is carried over.
    """
    end: Offsets = {t: dict(parts) for t, parts in start.items()}
    available: dict[TopicPartitionKey, int] = {}
    for topic, parts in latest.items():
        for partition, high in parts.items():
            if target is not None:
                if partition not in target.get(topic, {}):
                    continue
                high = min(high, target[topic][partition])
            begin = start.get(topic, {}).get(partition, 0)
            end.setdefault(topic, {})[partition] = begin
            available[(topic, partition)] = max(0, high - begin)
    if max_records is not None:
        available = fair_shares(available, max_records)
    for (topic, partition), n in available.items():
        end[topic][partition] += n
    return end


def plan_ranges(start: Offsets, end: Offsets) -> list[tuple[str, int, int, int]]:
    """(topic, partition, from, until) for every partition with offsets to read."""
    ranges = []
    for topic, parts in sorted(end.items()):
        for partition, until in sorted(parts.items()):
            begin = start.get(topic, {}).get(partition, 0)
            if until > begin:
                ranges.append((topic, partition, begin, until))
    return ranges


# ---------------------------------------------------------------------------
# Broker access (confluent-kafka, assign() only)


def _consumer(client_config: Mapping[str, str], **extra: Any) -> Any:
    from confluent_kafka import Consumer

    config: dict[str, Any] = {
        # Never used to join: assign() only. librdkafka wants one anyway.
        "group.id": "dedup-spark-sink-reader",
        "enable.auto.commit": False,
        "enable.auto.offset.store": False,
        "enable.partition.eof": True,
        "allow.auto.create.topics": False,
        "auto.offset.reset": "earliest",
        "fetch.wait.max.ms": 100,
        "queued.max.messages.kbytes": 16384,
        "log_level": 3,
    }
    config.update(client_config)
    config.update(extra)
    return Consumer(config)


def partitions_of(consumer: Any, topics: Sequence[str]) -> list[TopicPartitionKey]:
    """Every (topic, partition) the cluster metadata lists now (none for unknown topics)."""
    found: list[TopicPartitionKey] = []
    for topic in topics:
        meta = consumer.list_topics(topic, timeout=10).topics.get(topic)
        if meta is None or meta.error is not None:
            continue
        found.extend((topic, p) for p in meta.partitions)
    return sorted(found)


def probe_high_watermarks(consumer: Any, topics: Sequence[str]) -> Offsets:
    """High watermark of every partition of `topics`, from fetch responses.

    Assigns each partition at its end and waits for the end-of-partition event,
    which librdkafka raises on a fetch response and which carries that
    response's high watermark. Re-assigning resets the event, so every call is
    a fresh look.
    """
    from confluent_kafka import OFFSET_END, KafkaError, TopicPartition

    keys = partitions_of(consumer, topics)
    result: Offsets = {t: {} for t in topics}
    if not keys:
        return result
    consumer.assign([TopicPartition(t, p, OFFSET_END) for t, p in keys])
    pending = set(keys)
    deadline = time.monotonic() + PROBE_TIMEOUT_S
    try:
        while pending:
            if time.monotonic() > deadline:
                raise KafkaSourceError(f"no fetch response within {PROBE_TIMEOUT_S}s for {pending}")
            # No more than the events still awaited: `consume` returns once it has them.
            for msg in consumer.consume(len(pending), 0.05):
                err = msg.error()
                if err is None:
                    continue
                if err.code() != KafkaError._PARTITION_EOF:
                    raise KafkaSourceError(f"probing {msg.topic()}/{msg.partition()}: {err}")
                key = (msg.topic(), msg.partition())
                cached = consumer.get_watermark_offsets(TopicPartition(*key), cached=True)[1]
                result[key[0]][key[1]] = max(msg.offset(), cached)
                pending.discard(key)
    finally:
        consumer.unassign()
    return result


def low_watermarks(consumer: Any, topics: Sequence[str]) -> Offsets:
    """Earliest retained offset per partition (ListOffsets "earliest" is reliable)."""
    from confluent_kafka import TopicPartition

    result: Offsets = {t: {} for t in topics}
    for topic, partition in partitions_of(consumer, topics):
        low, _ = consumer.get_watermark_offsets(TopicPartition(topic, partition), timeout=10)
        result[topic][partition] = max(low, 0)
    return result


def arrow_schema() -> pa.Schema:
    """The Arrow form of `SCHEMA`, exactly as Spark checks returned batches against it."""
    from pyspark.sql.pandas.types import to_arrow_schema

    return to_arrow_schema(SCHEMA, timezone="UTC")


def read_range(
    client_config: Mapping[str, str], topic: str, partition: int, start: int, end: int
) -> Iterator[pa.RecordBatch]:
    """Records of one partition with start <= offset < end, as Arrow batches: one per
    `consume` call, built column by column (`to_batch`).

    Offsets may have gaps (compaction, transaction markers); the range is done
    when a record at or past `end-1` arrives or the end-of-partition event
    reports an offset >= end.
    """
    from confluent_kafka import KafkaError, TopicPartition

    schema = arrow_schema()
    consumer = _consumer(client_config, **{"fetch.wait.max.ms": READ_FETCH_WAIT_MS})
    try:
        consumer.assign([TopicPartition(topic, partition, start)])
        last_progress = time.monotonic()
        done = start >= end
        position = start  # the next offset the range still needs
        while not done:
            # Ask for no more than the range still holds: `consume` returns as soon as it
            # has that many messages, instead of waiting out its timeout for a full batch
            # (0.5 s at the end of every range, whatever its size).
            msgs = consumer.consume(min(ARROW_BATCH_ROWS, end - position), 0.5)
            if not msgs:
                if time.monotonic() - last_progress > READ_STALL_TIMEOUT_S:
                    raise KafkaSourceError(
                        f"{topic}/{partition}: nothing read for {READ_STALL_TIMEOUT_S}s "
                        f"while reading [{start}, {end})"
                    )
                continue
            last_progress = time.monotonic()
            errors = [m.error() for m in msgs]
            if any(errors):  # rare: the end-of-partition event, or a failure
                for msg, err in zip(msgs, errors, strict=True):
                    if err is None:
                        continue
                    if err.code() != KafkaError._PARTITION_EOF:
                        raise KafkaSourceError(f"reading {topic}/{partition}: {err}")
                    done = done or msg.offset() >= end
                msgs = [m for m, err in zip(msgs, errors, strict=True) if err is None]
            offsets = [m.offset() for m in msgs]
            # Offsets rise within a partition: keep start <= offset < end by bisection.
            first, past = bisect.bisect_left(offsets, start), bisect.bisect_left(offsets, end)
            done = done or past < len(offsets) or (past > 0 and offsets[past - 1] >= end - 1)
            if offsets:
                position = max(position, offsets[-1] + 1)
            if past > first:
                yield to_batch(schema, topic, partition, msgs[first:past], offsets[first:past])
    finally:
        consumer.close()


def to_batch(
    schema: pa.Schema, topic: str, partition: int, msgs: Sequence[Any], offsets: Sequence[int]
) -> pa.RecordBatch:
    """An Arrow batch of `SCHEMA` from fetched messages: one C-level call per message
    and column, the rest (timestamps, the constant topic and partition) on whole arrays."""
    n = len(msgs)
    ts_types, stamps = zip(*[m.timestamp() for m in msgs], strict=True)
    # librdkafka's 0/1/2 (none/create/append) -> Kafka's -1/0/1; ms -> µs, null for none.
    kinds = pa.array(ts_types, pa.int32())
    micros = pc.multiply(pa.array(stamps, pa.int64()), 1000)
    none = pa.scalar(None, pa.int64())
    when = pc.if_else(pc.equal(kinds, 0), none, micros).cast(schema.field("timestamp").type)
    headers = [m.headers() or () for m in msgs]
    pairs = list(itertools.chain.from_iterable(headers))
    header_type = schema.field("headers").type
    entries = pa.StructArray.from_arrays(
        [
            pa.array([k for k, _ in pairs], pa.string()),
            pa.array([v for _, v in pairs], pa.binary()),
        ],
        fields=list(header_type.value_type),
    )
    ends = pa.array(itertools.accumulate(map(len, headers), initial=0), pa.int32())
    columns = [
        pa.array([m.key() for m in msgs], pa.binary()),
        pa.array([m.value() for m in msgs], pa.binary()),
        pa.array([topic] * n, pa.string()),
        pa.array([partition] * n, pa.int32()),
        pa.array(offsets, pa.int64()),
        when,
        pc.subtract(kinds, 1),
        pa.ListArray.from_arrays(ends, entries, type=header_type),
    ]
    return pa.RecordBatch.from_arrays(columns, schema=schema)


# ---------------------------------------------------------------------------
# The Data Source API glue


class KafkaRange(InputPartition):
    """One Spark task: a contiguous offset range of one Kafka partition."""

    def __init__(self, topic: str, partition: int, start: int, end: int) -> None:
        super().__init__((topic, partition, start, end))
        self.topic = topic
        self.partition = partition
        self.start = start
        self.end = end


class _Options:
    """The parsed string options shared by the stream and batch readers."""

    def __init__(self, options: Mapping[str, str]) -> None:
        topics = [t.strip() for t in str(options.get("subscribe", "")).split(",") if t.strip()]
        if not topics:
            raise KafkaSourceError("option 'subscribe' (comma-separated topics) is required")
        self.topics = topics
        self.client_config = {
            k[len("kafka.") :]: str(v) for k, v in options.items() if k.lower().startswith("kafka.")
        }
        if "bootstrap.servers" not in self.client_config:
            raise KafkaSourceError("option 'kafka.bootstrap.servers' is required")
        self.starting = str(options.get("startingOffsets", "earliest")).strip()
        self.ending = str(options.get("endingOffsets", "latest")).strip()
        max_offsets = options.get("maxOffsetsPerTrigger")
        self.max_offsets = int(max_offsets) if max_offsets not in (None, "") else None
        if self.max_offsets is not None and self.max_offsets < 1:
            raise KafkaSourceError(f"maxOffsetsPerTrigger must be >= 1, got {self.max_offsets}")

    def resolve(self, spec: str, consumer: Any) -> Offsets:
        """`earliest`, `latest` or offsets JSON -> offsets for every current partition."""
        if spec == "earliest":
            return low_watermarks(consumer, self.topics)
        if spec == "latest":
            return probe_high_watermarks(consumer, self.topics)
        try:
            return offsets_from_json(json.loads(spec))
        except (ValueError, AttributeError) as exc:
            raise KafkaSourceError(
                f"bad offsets {spec!r}: expected earliest, latest or JSON"
            ) from exc


class _RangeReader:
    """What the stream and batch readers share: executors read one `KafkaRange` each."""

    _options: _Options

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        if not isinstance(partition, KafkaRange):
            # Spark reads one placeholder partition when partitions() returned none.
            return iter(())
        return read_range(
            self._options.client_config,
            partition.topic,
            partition.partition,
            partition.start,
            partition.end,
        )


class KafkaStreamReader(_RangeReader, DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Driver side of the stream: plans offset ranges; executors read them."""

    def __init__(self, options: Mapping[str, str]) -> None:
        self._options = _Options(options)
        self._consumer: Any = None
        self._target: Offsets | None = None
        # The partitions' ends seen by the last latestOffset call (reportLatestOffset).
        self._latest: Offsets | None = None

    @property
    def consumer(self) -> Any:
        if self._consumer is None:
            # Probes want each fetch answered at once too (a held fetch delays the
            # end-of-partition events: 155 ms per probe at 50 ms here, 36 ms at 10).
            wait = {"fetch.wait.max.ms": READ_FETCH_WAIT_MS}
            self._consumer = _consumer(self._options.client_config, **wait)
        return self._consumer

    def initialOffset(self) -> dict[str, Any]:
        return offsets_to_json(self._options.resolve(self._options.starting, self.consumer))

    def getDefaultReadLimit(self) -> ReadLimit:
        if self._options.max_offsets is None:
            return ReadAllAvailable()
        return ReadMaxRows(self._options.max_offsets)

    def prepareForTriggerAvailableNow(self) -> None:
        # Everything present now, and nothing that arrives later, is this run's work.
        self._target = probe_high_watermarks(self.consumer, self._options.topics)
        logger.info("availableNow target offsets %s", self._target)

    def latestOffset(self, start: dict[str, Any], limit: ReadLimit) -> dict[str, Any]:
        latest = self._latest = probe_high_watermarks(self.consumer, self._options.topics)
        max_records = limit.max_rows if isinstance(limit, ReadMaxRows) else None
        end = plan_end(offsets_from_json(start), latest, max_records, self._target)
        return offsets_to_json(end)

    def reportLatestOffset(self) -> dict[str, Any] | None:
        """The partitions' ends (progress reports' `latestOffset`: the job's lag metric)."""
        return None if self._latest is None else offsets_to_json(self._latest)

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> Sequence[InputPartition]:
        return [
            KafkaRange(*r) for r in plan_ranges(offsets_from_json(start), offsets_from_json(end))
        ]

    def commit(self, end: dict[str, Any]) -> None:
        # Spark's checkpoint is the only record of progress; nothing to tell Kafka.
        pass

    def stop(self) -> None:
        if self._consumer is not None:
            self._consumer.close()
            self._consumer = None


class KafkaBatchReader(_RangeReader, DataSourceReader):
    """`spark.read.format(...)`: one bounded read between startingOffsets and endingOffsets."""

    def __init__(self, options: Mapping[str, str]) -> None:
        self._options = _Options(options)

    def partitions(self) -> Sequence[InputPartition]:
        consumer = _consumer(self._options.client_config)
        try:
            start = self._options.resolve(self._options.starting, consumer)
            end = self._options.resolve(self._options.ending, consumer)
        finally:
            consumer.close()
        return [KafkaRange(*r) for r in plan_ranges(start, end)]


class KafkaDataSource(DataSource):
    """`spark.readStream.format("dedup_kafka")` once registered with `register()`."""

    @classmethod
    def name(cls) -> str:
        return SOURCE_NAME

    def schema(self) -> StructType:
        return SCHEMA

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        return KafkaStreamReader(self.options)

    def reader(self, schema: StructType) -> DataSourceReader:
        return KafkaBatchReader(self.options)


def register(spark: Any) -> str:
    """Register the source with `spark`; returns the format name to use."""
    spark.dataSource.register(KafkaDataSource)
    return SOURCE_NAME
