"""The Spark half on the clean topic gateway-3 wrote in the same round.

- `spark-job`: the project's job (`spark_sink.job.make_sink` + `start_query`,
  the shipped defaults for batch size and trigger) with the shipped example
  handler `spark_sink.handlers:orders`; the benchmark's values are valid
  orders, so nothing fails and every row is written;
- `spark-job-passthrough` (opt-in): the same job with `passthrough` below, a
  handler that adds a null reason: what the example handler's parsing costs;
- `spark-job-eos`: the same job without the delivery dedup, on gateway-3-eos's
  transactional clean topic (what `[spark] delivery_dedup = "auto"` runs there);
- `spark-job-redis`: spark-job with the delivery dedup's tokens in Redis
  (`[spark] dedup_redis`: a redis-server the benchmark starts for it, emptied before
  each run) instead of Spark's state store; the CPU columns leave that server out;
- `spark-floor`: a bare Structured Streaming query over the same source and
  options (`spark_sink.job.read_clean_topic`) into the `noop` sink: what
  Spark and the source cost before the job does anything.

Every run reads the whole topic with `availableNow` from a fresh checkpoint; the
first `WARMUP_RUNS` runs of each variant in the benchmark's SparkSession are a
warm-up, not measured (on a cold JVM spark-job spent ~2.5x the JVM CPU per row of
its later runs, and after one warm-up run still ~1.5x in the first measured round).
The clock runs from the first micro-batch with rows to the end of the last
(Spark's query progress: `timestamp` + `durationMs.triggerExecution`), which
leaves out the query's start, as the gateway's clock leaves out the group join.
CPU over the same run: the Python driver (this process: planning, the
foreachBatch sink), the JVM (Spark's driver and executors in local mode) and
the Python workers (every live descendant of the JVM, and the ones it reaped:
the executors' Arrow/UDF workers and the Python source's planner).

Fixed cost per micro-batch: after the run, one more record (valid, with fresh
dedup headers) goes to the topic and the query restarts on its checkpoint;
that one-record batch's `triggerExecution` is the cost every batch pays
whatever its size.
"""

from __future__ import annotations

import datetime as dt
import os
import shutil
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.streaming.query import StreamingQuery

from bench.measure import ThroughputRun
from bench.processes import process_cpu
from devtools.localstack import ManagedProcess, redis_server
from gateway.contract.records import H_ATTEMPT, H_ID, H_SOURCE, H_TOKEN
from spark_sink.checkpoint import spark_checkpoint
from spark_sink.config import SinkSettings, load_sink_settings
from spark_sink.job import make_sink, read_clean_topic, start_query
from spark_sink.session import build_session
from spark_sink.sink import BatchSink
from spark_sink.transforms import REASON

JOB, JOB_PASSTHROUGH, FLOOR = "spark-job", "spark-job-passthrough", "spark-floor"
JOB_EOS = "spark-job-eos"  # the job without its delivery dedup
JOB_REDIS = "spark-job-redis"  # the job with its delivery dedup in Redis
# Unmeasured runs of each variant before its first measured one (the JIT's warm-up).
WARMUP_RUNS = 2
EXAMPLE_HANDLER = "spark_sink.handlers:orders"
# The demo's session: local[2] on this 2-core machine, no UI. Progress is read from
# recentProgress, so it must keep every batch of a run.
SESSION_CONF = {
    "spark.sql.shuffle.partitions": "2",
    "spark.ui.enabled": "false",
    "spark.ui.showConsoleProgress": "false",
    "spark.sql.streaming.numRecentProgressUpdates": "100000",
}


def passthrough(records: DataFrame) -> DataFrame:
    """Every record succeeds, as it comes: the cheapest handler the contract allows."""
    return records.withColumn(REASON, F.lit(None).cast("string"))


@dataclass
class SparkRun:
    """One spark variant's run: rows, time, CPU by process and the fixed cost."""

    rows: int  # rows the query read
    written: int  # rows the job wrote (the floor: rows it read)
    failed: int
    dropped: int  # rows the job's delivery dedup dropped (0 on a clean topic)
    seconds: float
    driver_cpu_s: float
    jvm_cpu_s: float
    workers_cpu_s: float
    batches: int
    batch_fixed_s: float  # triggerExecution of a one-record batch
    phases_ms: dict[str, float]  # durationMs per phase, summed over the run's batches

    @property
    def cpu_s(self) -> float:
        return self.driver_cpu_s + self.jvm_cpu_s + self.workers_cpu_s


class SparkBench:
    """One SparkSession for the whole benchmark (starting one costs ~10 s)."""

    def __init__(self, bootstrap: str, state_dir: Path) -> None:
        self.bootstrap = bootstrap
        self.state_dir = state_dir / "spark"
        self._session: SparkSession | None = None
        self._own_session = False
        self._warmed: set[str] = set()
        self._dedup_redis: ManagedProcess | None = None

    def settings(self, variant: str, topic: str) -> SinkSettings:
        work = self.state_dir / f"{topic}-{variant}"
        shutil.rmtree(work, ignore_errors=True)
        return load_sink_settings(
            kafka={"bootstrap_servers": self.bootstrap, "clean_topic": topic,
                   "failure_topic": "bench-failures"},
            spark={"checkpoint_dir": str(work / "checkpoint"), "output_path": str(work / "output"),
                   "master": "local[2]", "handler": EXAMPLE_HANDLER, "conf": SESSION_CONF,
                   "dedup_redis": self.dedup_redis() if variant == JOB_REDIS else ""},
        )  # fmt: skip

    def dedup_redis(self) -> str:
        """The URL of spark-job-redis's redis-server (started on first use), emptied:
        each run claims its tokens afresh, as the state store starts empty."""
        if self._dedup_redis is None:
            self._dedup_redis = redis_server(self.state_dir, "dedup-redis")
            self._dedup_redis.start()
        url = f"redis://127.0.0.1:{self._dedup_redis.port}/0"
        with redis.Redis.from_url(url) as client:
            client.flushall()
        return url

    def session(self, settings: SinkSettings) -> SparkSession:
        if self._session is None:
            os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
            self._own_session = SparkSession.getActiveSession() is None
            self._session = build_session(settings)
            self._session.sparkContext.setLogLevel("ERROR")
        return self._session

    def run(self, variant: str, topic: str) -> SparkRun:
        """Read the whole of `topic` with `variant`, then time a one-record batch."""
        settings = self.settings(variant, topic)
        spark = self.session(settings)
        if variant not in self._warmed:
            # A fresh JVM ran spark-job's first run at ~2.5x its later JVM CPU per row
            # (JIT, class loading): a long-running job's pace is the warm one.
            for _ in range(WARMUP_RUNS):
                self._until_done(variant, spark, settings)
                settings = self.settings(variant, topic)  # a fresh checkpoint again
            self._warmed.add(variant)
        jvm_pid = int(spark._jvm.ProcessHandle.current().pid())  # type: ignore[union-attr]
        cpu0 = _cpu(jvm_pid)
        progress, sink = self._until_done(variant, spark, settings)
        rows = sum(int(p["numInputRows"]) for p in progress)
        written, failed, dropped = rows, 0, 0  # the floor writes what it reads
        if sink is not None:
            written, failed = sink.counts.written, sink.counts.failed
            dropped = rows - sink.counts.records
        cpu1 = _cpu(jvm_pid)
        fixed = self.one_record_batch(variant, settings, spark)
        shutil.rmtree(self.state_dir / f"{topic}-{variant}", ignore_errors=True)
        phases: dict[str, float] = {}
        for p in progress:
            for phase, ms in p["durationMs"].items():
                phases[phase] = phases.get(phase, 0.0) + float(ms)
        return SparkRun(
            rows=rows, written=written, failed=failed, dropped=dropped,
            seconds=_span(progress), driver_cpu_s=cpu1[0] - cpu0[0],
            jvm_cpu_s=cpu1[1] - cpu0[1], workers_cpu_s=cpu1[2] - cpu0[2],
            batches=len(progress), batch_fixed_s=fixed, phases_ms=phases,
        )  # fmt: skip

    def one_record_batch(self, variant: str, settings: SinkSettings, spark: SparkSession) -> float:
        """triggerExecution (s) of a batch holding one new record, on the run's checkpoint."""
        produce_one(self.bootstrap, settings.kafka.clean_topic)
        progress, _ = self._until_done(variant, spark, settings)
        (batch,) = progress
        return float(batch["durationMs"]["triggerExecution"]) / 1000

    @staticmethod
    def _until_done(
        variant: str, spark: SparkSession, settings: SinkSettings
    ) -> tuple[list[dict[str, Any]], BatchSink | None]:
        """Run `variant` with availableNow to the end: its batches with rows, and the
        job's sink (None for the floor)."""
        if variant == FLOOR:
            query = _floor_query(spark, settings)
            query.awaitTermination()
            return _data_batches(query), None
        sink = make_sink(settings, passthrough if variant == JOB_PASSTHROUGH else None)
        try:
            query = start_query(
                spark, settings, sink, available_now=True, delivery_dedup=variant != JOB_EOS
            )
            query.awaitTermination()
        finally:
            sink.close()
        return _data_batches(query), sink

    def close(self) -> None:
        if self._session is not None and self._own_session:
            self._session.stop()
        self._session = None
        if self._dedup_redis is not None:
            self._dedup_redis.stop()
            self._dedup_redis = None


def _floor_query(spark: SparkSession, settings: SinkSettings) -> StreamingQuery:
    return (
        read_clean_topic(spark, settings)
        .writeStream.format("noop")
        .option("checkpointLocation", spark_checkpoint(settings))
        .trigger(availableNow=True)
        .start()
    )


def _data_batches(query: StreamingQuery) -> list[dict[str, Any]]:
    if query.exception() is not None:
        raise RuntimeError(f"{query.name}: {query.exception()}")
    return [p for p in query.recentProgress if int(p["numInputRows"]) > 0]


def _span(progress: list[dict[str, Any]]) -> float:
    """Seconds from the first batch's start to the last one's end."""

    def start(p: dict[str, Any]) -> float:
        return dt.datetime.fromisoformat(p["timestamp"].replace("Z", "+00:00")).timestamp()

    first = min(start(p) for p in progress)
    last = max(start(p) + float(p["durationMs"]["triggerExecution"]) / 1000 for p in progress)
    return last - first


def _descendants(pid: int) -> Iterator[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rpartition(")")[2].split()[1])
            except OSError:
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    todo = list(children.get(pid, []))
    while todo:
        child = todo.pop()
        yield child
        todo.extend(children.get(child, []))


def _times(pid: int) -> tuple[float, float]:
    """(own, reaped children's) user + system CPU seconds of `pid`; zeros once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return 0.0, 0.0
    tick = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / tick, (int(fields[13]) + int(fields[14])) / tick


def _cpu(jvm_pid: int) -> tuple[float, float, float]:
    """(Python driver, JVM, Python workers) CPU seconds so far. The workers: every live
    descendant of the JVM with what it reaped, and what the JVM reaped."""
    own, reaped = _times(jvm_pid)
    workers = reaped + sum(sum(_times(pid)) for pid in _descendants(jvm_pid))
    return time.process_time(), own, workers


def produce_one(bootstrap: str, topic: str) -> None:
    """One valid clean record with fresh dedup headers (the job drops a repeated token)."""
    from confluent_kafka import Producer

    mark = uuid.uuid4().hex
    producer = Producer({"bootstrap.servers": bootstrap})
    headers: list[tuple[str, str | bytes | None]] = [
        (H_ID, f"one-{mark}".encode()), (H_SOURCE, b"bench-one/0/0"),
        (H_TOKEN, mark.encode()), (H_ATTEMPT, b"1"),
    ]  # fmt: skip
    value = b'{"order_id": "one-%s", "customer": "c-1", "amount": 1.0}' % mark.encode()
    producer.produce(topic, value=value, headers=headers, partition=0)
    if producer.flush(30):
        raise RuntimeError(f"the one-record batch's record was not sent to {topic}")


def measure(
    bench: SparkBench, variant: str, topic: str, share: float, round_no: int, expected: int,
    broker_pid: int,
) -> ThroughputRun:  # fmt: skip
    """`variant`'s run on `topic` (holding `expected` rows) as a benchmark row. `forwarded`
    is the rows written (the floor: read), `duplicates` the rows the job's delivery dedup
    dropped; a correct run writes every row and drops none."""
    broker0 = process_cpu(broker_pid)
    run = bench.run(variant, topic)
    broker_cpu = process_cpu(broker_pid) - broker0
    return ThroughputRun(
        variant=variant, share=share, round=round_no, records=run.rows, seconds=run.seconds,
        gateway_cpu_s=run.cpu_s, redis_cpu_s=0.0, broker_cpu_s=broker_cpu, vote_wait_s=0.0,
        forwarded=run.written, duplicates=run.dropped, expected_forwarded=expected,
        expected_duplicates=0,
        spark={"driver_cpu_s": run.driver_cpu_s, "jvm_cpu_s": run.jvm_cpu_s,
               "workers_cpu_s": run.workers_cpu_s, "failed": run.failed,
               "batches": run.batches, "batch_fixed_s": run.batch_fixed_s,
               "phases_ms": run.phases_ms},
    )  # fmt: skip
