"""One measured run of one variant: throughput on a pre-filled topic, or latency
under a fixed offered load.

Throughput: the variant reads a raw topic that was filled before it started
(so no load generator competes with it), and the clock runs from the first
fetched batch to the last handled record, which excludes the group join.
CPU: for in-process variants the benchmark process's own CPU time over the
same window (it runs the variant; the progress display polls too, the same
for every in-process variant), for process variants their process tree's;
the Redis instances' `used_cpu_user + used_cpu_sys` and the broker's from
/proc. Memory per mark: each instance's `used_memory` growth over the run
divided by the distinct ids (each instance holds one mark per id), after a
FLUSHALL at the start.

Exactly-once output (gateway-3-eos, `[kafka] exactly_once = "on"`; every other
variant runs "off"): its throughput clock also waits for the last raw transaction to
end, its clean topic is read back `read_committed` after the run (every id once,
nothing of an aborted transaction), and its latency runs to the commit of the
transaction that holds the copy: when a `read_committed` reader can see it
(`TransactionWatch`). Without transactions that is the broker's acknowledgement.

A cluster member (gateway-3-cluster) is several servers: each of its masters
is flushed before the run, its CPU counts in the Redis CPU as any instance's,
and its memory per mark is the growth summed over its masters per distinct id.
That growth includes what its client connections hold (`mem_clients_normal`:
the cluster client held ~65 connections per master in a 100,000-record run
here, a standalone instance 3): a fixed cost, not a mark's, recorded apart too.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import statistics
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient

from bench.processes import GatewayProcesses, process_cpu, write_config
from bench.steady import fill_older
from bench.variants import Subject, Variant, build_subject
from devtools.harness import ids_of
from devtools.localstack import LocalStack, free_port
from devtools.topics import create_topics, read_topic
from devtools.traffic import Traffic
from gateway.config import RedisSettings, Settings, load_settings, parse_duration
from gateway.kafka.completion import PlainCompletion, TransactionalCompletion
from gateway.metrics import Metrics
from gateway.quorum.scripts import SLICES_BACK
from gateway.raw.pipeline import Ready
from gateway.service.app import Gateway

REPO = Path(__file__).resolve().parents[1]
Progress = Callable[[int], None]


@dataclass
class PreparedTopic:
    """A raw topic filled before any variant reads it, and what a correct run yields."""

    name: str
    share: float
    traffic: Traffic

    def expected(self, variant: Variant) -> tuple[int, int]:
        """(forwarded, duplicates) a correct run of `variant` reports."""
        if not variant.dedup:
            return self.traffic.produced, 0
        return len(self.traffic.unique_ids), self.traffic.duplicates


@dataclass
class ThroughputRun:
    variant: str
    share: float
    round: int
    records: int
    seconds: float
    gateway_cpu_s: float
    redis_cpu_s: float
    broker_cpu_s: float
    vote_wait_s: float  # the raw loops' wait for votes (summed over workers)
    forwarded: int
    duplicates: int
    expected_forwarded: int
    expected_duplicates: int
    bytes_per_mark: list[float] = field(default_factory=list)  # one per standalone instance
    cluster_bytes_per_mark: list[float] = field(default_factory=list)  # one per cluster member
    # The part of cluster_bytes_per_mark that is the masters' client buffers' growth.
    cluster_client_bytes_per_mark: list[float] = field(default_factory=list)
    # A spark variant's CPU by process, fixed cost per batch and phases (bench/spark.py).
    spark: dict[str, Any] | None = None
    # Where the members stood (dedup variants): the slices a new id was searched in, and
    # the marks per bucket of each (the current slice's when the run ended).
    live_slices: int = 0
    marks_per_bucket: float = 0.0
    # redis_cpu_s by server (the variant's members' servers, cluster masters first).
    redis_cpu_each_s: list[float] = field(default_factory=list)
    # Exactly-once variants: raw transactions committed and aborted in the run, and
    # whether a `read_committed` read of the clean topic held every id once (None:
    # not read, the variant writes no transactions).
    transactions: int = 0
    transactions_aborted: int = 0
    committed_ids_once: bool | None = None
    transaction_open_s: float = 0.0  # summed over them: begun to committed
    transaction_closing_s: float = 0.0  # of it: last copy acknowledged to committed
    transaction_begin_s: float = 0.0  # of it: in the producer's begin_transaction
    # In-process gateways: the raw batches forwarded (copies sent to acknowledged) and
    # the time that took, summed; without transactions the raw loop's offset commits and
    # their time, summed.
    forwards: int = 0
    forward_s: float = 0.0
    offset_commits: int = 0
    offset_commit_s: float = 0.0

    @property
    def rate(self) -> float:
        return self.records / self.seconds

    @property
    def correct(self) -> bool:
        return (self.forwarded, self.duplicates) == (
            self.expected_forwarded,
            self.expected_duplicates,
        ) and self.committed_ids_once is not False

    def as_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "rate": self.rate, "correct": self.correct}


@dataclass
class LatencyRun:
    variant: str
    load: str  # which of the common loads, e.g. "5,000/s"
    offered_rate: float
    produced: int
    forwarded: int
    expected_forwarded: int
    machine_busy: float  # share of all cores busy while the load ran (every process)
    samples_ms: list[float] = field(repr=False)

    @property
    def correct(self) -> bool:
        return self.forwarded == self.expected_forwarded

    def percentile(self, p: int) -> float:
        if len(self.samples_ms) < 2:
            return self.samples_ms[0] if self.samples_ms else float("nan")
        return statistics.quantiles(self.samples_ms, n=100, method="inclusive")[p - 1]

    def as_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items() if k != "samples_ms"}
        return {**out, "samples": len(self.samples_ms), "p50_ms": self.percentile(50),
                "p99_ms": self.percentile(99), "max_ms": max(self.samples_ms, default=0.0),
                "correct": self.correct}  # fmt: skip


@dataclass(frozen=True)
class Members:
    """A variant's quorum members on the stack: the URLs the gateway is given, and
    the servers behind them as plain URLs (INFO and FLUSHALL go to each alone)."""

    urls: list[str]  # as in `[redis] nodes`
    standalone: list[str]  # the members that are one redis-server
    cluster_nodes: list[str]  # the cluster member's masters; empty without one

    @property
    def servers(self) -> list[str]:
        """Every redis-server the variant's marks live on: the cluster's masters first."""
        return [*self.cluster_nodes, *self.standalone]


def members(stack: LocalStack, variant: Variant) -> Members:
    """The first member is the stack's cluster for a cluster variant, then standalone ones."""
    if not variant.cluster:
        urls = stack.redis_urls[: variant.redis]
        return Members(urls, urls, [])
    if stack.cluster is None:
        raise RuntimeError(f"{variant.name} needs a LocalStack with a cluster (cluster_masters)")
    standalone = stack.redis_urls[: variant.redis - 1]
    return Members([stack.cluster.url, *standalone], standalone, stack.cluster_node_urls)


# The local broker holds every fetch for its whole wait, even with records
# ready (Apache Kafka answers at once); a short wait keeps that out of latency.
FETCH_MAX_WAIT = "5ms"


def bench_config(
    stack: LocalStack, variant: Variant, raw: str, clean: str, port: int = 0, buckets: int = 0
) -> dict[str, Any]:
    """The settings of one run, as config sections (`buckets`: `[redis] buckets`, 0 for
    the default)."""
    config: dict[str, Any] = {
        "kafka": {"bootstrap_servers": stack.bootstrap, "raw_topics": [raw], "clean_topic": clean,
                  "group_id": f"bench-{clean}", "quarantine_topic": f"{clean}-quarantine",
                  "failure_topic": "bench-failures", "dead_letter_topic": "bench-dead-letter",
                  "fetch_max_wait": os.environ.get("BENCH_FETCH_MAX_WAIT", FETCH_MAX_WAIT)},
        "redis": {"nodes": members(stack, variant).urls},
        "dedup": {"enabled": variant.dedup},
        "metrics": {"host": "127.0.0.1", "port": port},
        "log": {"level": "ERROR"},
    }  # fmt: skip
    config["kafka"]["exactly_once"] = "on" if variant.exactly_once else "off"
    if buckets:
        config["redis"]["buckets"] = buckets
    if variant.lanes:
        del config["kafka"]["raw_topics"]
        config["lanes"] = [
            {"name": "urgent", "raw_topics": [urgent_topic(raw)], "priority": 1},
            {"name": "bulk", "raw_topics": [raw], "priority": 0},
        ]
    return config


def urgent_topic(raw: str) -> str:
    """The lanes variant's high lane: an empty topic beside `raw`."""
    return f"{raw}-urgent"


def bench_settings(
    stack: LocalStack, variant: Variant, raw: str, clean: str, buckets: int = 0
) -> Settings:
    return load_settings(None, **bench_config(stack, variant, raw, clean, buckets=buckets))


def steady_fill(variant: Variant, fill: int) -> int:
    """The marks per bucket `variant`'s members are filled to before a run (bench/steady.py):
    `fill` for the product on standalone members; 0 (fresh members, default buckets) for
    gateway-3-fresh, the cluster member and the variants without marks."""
    steady = variant.dedup and not (variant.naive or variant.fresh or variant.cluster)
    return fill if steady else 0


async def prefill(urls: Sequence[str], buckets: int, fill: int) -> None:
    """Every member's older live slices full: `buckets` x `fill` marks each."""
    redis = load_settings(redis={"nodes": urls}).redis
    ttl_ms = int(redis.ttl.total_seconds() * 1000)

    async def one(url: str) -> None:
        async with aioredis.Redis.from_url(url) as client:
            await fill_older(client, redis.key_prefix.encode(), buckets, fill, ttl_ms)

    await asyncio.gather(*(one(u) for u in urls))


@contextlib.asynccontextmanager
async def running(subject: Subject) -> AsyncIterator[asyncio.Task[None]]:
    """`subject` running as a task of this event loop; stopped (drained) on exit."""
    stop = asyncio.Event()
    task = asyncio.create_task(subject.run(stop))
    try:
        yield task
    finally:
        stop.set()
        await asyncio.wait_for(task, 60)


async def until(
    task: asyncio.Task[None], done: Callable[[], bool], *, timeout_s: float | None = None
) -> None:
    """Wait until `done()` holds; raise the subject's own error if it stops first."""
    loop = asyncio.get_running_loop()
    deadline = None if timeout_s is None else loop.time() + timeout_s
    while not done():
        if task.done():
            task.result()
            raise RuntimeError("the variant stopped before the run finished")
        if deadline is not None and loop.time() > deadline:
            raise TimeoutError(f"not done within {timeout_s}s")
        await asyncio.sleep(0.01)


class TransactionWatch:
    """A running gateway's raw-loop transactions (`[kafka] exactly_once` on), watched:
    how many committed and aborted, whether one is open, how long they were open (and
    of that, from the batch's last acknowledged copy to the end: the offsets sent to the
    transaction and EndTxn), and `on_end(committed)` called as each ends. Installed on
    the gateway's `Transactions` once its raw loop exists."""

    def __init__(self, gateway: Gateway, on_end: Callable[[bool], None] | None = None) -> None:
        source = gateway.source
        completion = source.checkpoint.completion if source is not None else None
        if not isinstance(completion, TransactionalCompletion):
            raise RuntimeError("the gateway's raw loop writes no transactions (exactly_once off?)")
        self.open = False
        self.commits = 0
        self.aborts = 0
        self.open_s = 0.0  # summed over the transactions: begun to ended
        self.begin_s = 0.0  # of it, in the producer's begin_transaction
        self.closing_s = 0.0  # of it, the step's end (copies acknowledged) to the end
        transactions = completion.transactions
        run = transactions.run
        timed_producers: set[int] = set()

        def time_begin(producer: Any) -> None:
            """Time `producer.begin_transaction` (a renewed producer is a new object)."""
            if id(producer) in timed_producers:
                return
            timed_producers.add(id(producer))
            begin = producer.begin_transaction

            async def begin_transaction() -> None:
                started = time.perf_counter()
                try:
                    await begin()
                finally:
                    self.begin_s += time.perf_counter() - started

            producer.begin_transaction = begin_transaction

        async def watched(
            step: Awaitable[dict[TopicPartition, int]], *args: Any, **kwargs: Any
        ) -> dict[TopicPartition, int]:
            self.open = True
            time_begin(transactions.producer)
            began = time.perf_counter()
            acked: float | None = None

            async def timed() -> dict[TopicPartition, int]:
                nonlocal acked
                offsets = await step
                acked = time.perf_counter()
                return offsets

            try:
                offsets = await run(timed(), *args, **kwargs)
            except BaseException:
                if asyncio.iscoroutine(step):
                    step.close()  # never started when the transaction could not begin
                self.aborts += 1
                if on_end is not None:
                    on_end(False)
                raise
            finally:
                self.open = False
                ended = time.perf_counter()
                self.open_s += ended - began
                self.closing_s += ended - acked if acked is not None else 0.0
            self.commits += 1
            if on_end is not None:
                on_end(True)
            return offsets

        transactions.run = watched  # type: ignore[method-assign]


class BatchWatch:
    """A running gateway's raw batches after their vote: how long forwarding each took
    (`Pipeline.finish`: its copies sent until the broker acknowledged them; inside the
    transaction with exactly_once on), and without transactions its offset commits and
    their time (each after its batch's copies were acknowledged, as a transaction's
    closing is: the at-least-once counterpart of `TransactionWatch.closing_s`)."""

    def __init__(self, gateway: Gateway) -> None:
        if gateway.source is None:
            raise RuntimeError("the gateway's raw loop has not started")
        source = gateway.source
        checkpoint = source.checkpoint
        self.commits = 0
        self.commit_s = 0.0
        self.forwards = 0
        self.forward_s = 0.0
        completion = checkpoint.completion
        assert isinstance(completion, (PlainCompletion, TransactionalCompletion))
        commits = completion.commits
        commit, finish = commits.commit, source.pipeline.finish

        async def forwarding(ready: Ready) -> dict[TopicPartition, int]:
            began = time.perf_counter()
            try:
                return await finish(ready)
            finally:
                self.forwards += 1
                self.forward_s += time.perf_counter() - began

        source.pipeline.finish = forwarding  # type: ignore[method-assign]

        async def watched(offsets: dict[TopicPartition, int]) -> bool:
            began = time.perf_counter()
            try:
                return await commit(offsets)
            finally:
                self.commits += 1
                self.commit_s += time.perf_counter() - began

        commits.commit = watched  # type: ignore[method-assign]


async def watch_transactions(
    task: asyncio.Task[None], gateway: Gateway, on_end: Callable[[bool], None] | None = None
) -> TransactionWatch:
    """A `TransactionWatch` on `gateway` as soon as its raw loop exists."""
    await until(task, lambda: gateway.source is not None)
    return TransactionWatch(gateway, on_end)


async def committed_ids_once(bootstrap: str, clean: str, ids: set[str]) -> bool:
    """Whether a `read_committed` reader of `clean` sees each of `ids` once, and nothing else."""
    seen = ids_of(await read_topic(bootstrap, clean, min_records=len(ids), timeout_s=120))
    return set(seen) == ids and max(seen.values(), default=1) == 1


async def redis_info(urls: Sequence[str]) -> list[dict[str, Any]]:
    async def one(url: str) -> dict[str, Any]:
        async with aioredis.Redis.from_url(url) as client:
            info: dict[str, Any] = await client.info()
            return info

    return list(await asyncio.gather(*(one(u) for u in urls)))


async def flush(urls: Sequence[str]) -> None:
    async def one(url: str) -> None:
        async with aioredis.Redis.from_url(url) as client:
            await client.flushall()

    await asyncio.gather(*(one(u) for u in urls))


def machine_cpu() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine since boot, from /proc/stat."""
    ticks = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = ticks[3] + ticks[4]  # idle + iowait
    hz = os.sysconf("SC_CLK_TCK")
    return (sum(ticks) - idle) / hz, sum(ticks) / hz


def redis_cpu(infos: Sequence[dict[str, Any]]) -> float:
    return sum(float(i["used_cpu_user"]) + float(i["used_cpu_sys"]) for i in infos)


async def delete_topics(bootstrap: str, topics: Sequence[str]) -> None:
    """Drop a run's output: the broker keeps everything in memory."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.delete_topics(list(topics))
    finally:
        await admin.close()


def _per_mark(
    after: Sequence[dict[str, Any]], before: Sequence[dict[str, Any]], ids: int,
    stat: str = "used_memory",
) -> float:  # fmt: skip
    """`stat`'s growth summed over these servers, per distinct id."""
    growth = sum(float(a[stat]) - float(b[stat]) for a, b in zip(after, before, strict=True))
    return growth / ids


def clean_topic(variant: str, share: float, round_no: int) -> str:
    """The clean topic a variant's run writes."""
    return f"clean-{variant}-{int(share * 100)}-{round_no}"


async def throughput(
    stack: LocalStack, variant: Variant, raw: PreparedTopic, round_no: int, progress: Progress,
    *, keep_clean: bool = False, fill: int = 0,
) -> ThroughputRun:  # fmt: skip
    """`keep_clean`: leave the clean topic for the spark variants (they delete it).
    `fill`: marks per bucket at steady state (`steady_fill`): `[redis] buckets` is the
    run's distinct ids / fill, and every member's older slices are filled first, so a
    new id is searched in SLICES_BACK + 1 slices of `fill`-mark buckets."""
    on = members(stack, variant)
    urls = on.servers
    assert stack.broker is not None and stack.broker.proc is not None
    broker_pid = stack.broker.proc.pid
    await flush(urls)
    fill = steady_fill(variant, fill)
    ids = len(raw.traffic.unique_ids)
    buckets = max(1, ids // fill) if fill else 0
    if fill:
        await prefill(on.servers, buckets, fill)
    clean = clean_topic(variant.name, raw.share, round_no)
    await create_topics(stack.bootstrap, {clean: 4, f"{clean}-quarantine": 1})
    if variant.lanes:
        await create_topics(stack.bootstrap, {urgent_topic(raw.name): 4})
    subject: Subject
    cpu_of: Callable[[], float] = time.process_time
    if variant.kind == "processes":
        port = free_port()
        config = write_config(
            stack.state_dir / f"{clean}.toml",
            bench_config(stack, variant, raw.name, clean, port, buckets),
        )
        processes = GatewayProcesses(
            config, variant.workers, port, stack.state_dir / f"{clean}.log"
        )
        subject, cpu_of = processes, processes.cpu_s
    else:
        subject = build_subject(variant, bench_settings(stack, variant, raw.name, clean, buckets))
    counts = subject.metrics
    before = await redis_info(urls)
    total = raw.traffic.produced
    watch: TransactionWatch | None = None
    batches: BatchWatch | None = None
    async with running(subject) as task:
        if isinstance(subject, Gateway):
            gateway = subject
            await until(task, lambda: gateway.source is not None)
            batches = BatchWatch(gateway)
            if variant.exactly_once:
                watch = TransactionWatch(gateway)
        # The clock starts when the first batch is in hand: the group join is not timed.
        await until(task, lambda: counts.consumed() > 0)
        t0, cpu0, broker0 = time.perf_counter(), cpu_of(), process_cpu(broker_pid)
        waited0 = counts.vote_wait_s()
        redis0 = [redis_cpu([info]) for info in await redis_info(urls)]

        def finished() -> bool:  # polled every 10 ms: one read of the counters (~75 µs)
            handled = counts.handled()
            progress(handled)
            # Exactly once: handled at the copies' acknowledgement, done at the commit.
            return handled >= total and (watch is None or not watch.open)

        await until(task, finished)
        seconds, cpu = time.perf_counter() - t0, cpu_of() - cpu0
        broker_cpu = process_cpu(broker_pid) - broker0
        waited = counts.vote_wait_s() - waited0
        after = await redis_info(urls)
    once = None
    if watch is not None:
        once = await committed_ids_once(stack.bootstrap, clean, raw.traffic.unique_ids)
    await delete_topics(
        stack.bootstrap, [f"{clean}-quarantine"] if keep_clean else [clean, f"{clean}-quarantine"]
    )
    expected_forwarded, expected_duplicates = raw.expected(variant)
    clustered = len(on.cluster_nodes)
    return ThroughputRun(
        variant=variant.name, share=raw.share, round=round_no, records=total,
        seconds=seconds, gateway_cpu_s=cpu, redis_cpu_s=redis_cpu(after) - sum(redis0),
        redis_cpu_each_s=[redis_cpu([a]) - b for a, b in zip(after, redis0, strict=True)],
        broker_cpu_s=broker_cpu, vote_wait_s=waited,
        forwarded=counts.forwarded_total(),
        duplicates=counts.duplicates_total(),
        expected_forwarded=expected_forwarded, expected_duplicates=expected_duplicates,
        bytes_per_mark=[
            _per_mark([a], [b], ids)
            for a, b in zip(after[clustered:], before[clustered:], strict=True)
            if variant.dedup
        ],
        cluster_bytes_per_mark=[
            _per_mark(after[:clustered], before[:clustered], ids)
        ] if clustered and variant.dedup else [],
        cluster_client_bytes_per_mark=[
            _per_mark(after[:clustered], before[:clustered], ids, "mem_clients_normal")
        ] if clustered and variant.dedup else [],
        live_slices=(SLICES_BACK + 1 if fill else 1) if variant.dedup and not variant.naive else 0,
        marks_per_bucket=(
            ids / (buckets or RedisSettings.model_fields["buckets"].default)
            if variant.dedup and not variant.naive else 0.0
        ),
        transactions=watch.commits if watch is not None else 0,
        transactions_aborted=watch.aborts if watch is not None else 0,
        transaction_open_s=watch.open_s if watch is not None else 0.0,
        transaction_closing_s=watch.closing_s if watch is not None else 0.0,
        transaction_begin_s=watch.begin_s if watch is not None else 0.0,
        forwards=batches.forwards if batches is not None else 0,
        forward_s=batches.forward_s if batches is not None else 0.0,
        offset_commits=batches.commits if batches is not None else 0,
        offset_commit_s=batches.commit_s if batches is not None else 0.0,
        committed_ids_once=once,
    )  # fmt: skip


class Recorder:
    """Stands in for the forward-latency histogram: keeps every sample, after the warm-up."""

    def __init__(self) -> None:
        self.samples_ms: list[float] = []
        self.from_time = float("inf")

    def observe(self, seconds: float) -> None:
        if time.monotonic() >= self.from_time:
            self.samples_ms.append(seconds * 1000)


class RecordingMetrics(Metrics):
    """The gateway's metrics, with every forward latency kept (the product samples them).

    `at_commit` (exactly once): a copy's latency runs to the commit of its transaction,
    not to its acknowledgement: the acknowledged copies' timestamps wait in `pending`
    until `transaction_ended` (a `TransactionWatch`) says it committed; an aborted one's
    copies are dropped (their records are read and forwarded again)."""

    def __init__(self) -> None:
        super().__init__()
        self.recorder = Recorder()
        self.at_commit = False
        self.pending: list[int] = []

    def observe_forward_latency(self, now_ms: float, timestamps_ms: Sequence[int | None]) -> None:
        if self.at_commit:
            self.pending.extend(ts for ts in timestamps_ms if ts is not None)
            return
        observe = self.recorder.observe
        for ts in timestamps_ms:
            if ts is not None:
                observe((now_ms - ts) / 1000)

    def transaction_ended(self, committed: bool, now_ms: float | None = None) -> None:
        pending, self.pending = self.pending, []
        if committed:
            now_ms = time.time() * 1000 if now_ms is None else now_ms
            observe = self.recorder.observe
            for ts in pending:
                observe((now_ms - ts) / 1000)


async def _offer_load(
    stack: LocalStack, raw: str, rate: float, seconds: float, share: float, value_size: int
) -> tuple[dict[str, int], float]:
    """Run the load generator against `raw`; what it produced and how busy the machine was."""
    busy0, total0 = machine_cpu()
    loader = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "bench.loader", "--bootstrap", stack.bootstrap, "--topic", raw,
        "--rate", str(rate), "--seconds", str(seconds), "--duplicates", str(share),
        "--value-size", str(value_size),
        stdout=asyncio.subprocess.PIPE, cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    out, _ = await loader.communicate()
    busy1, total1 = machine_cpu()
    if loader.returncode != 0:
        raise RuntimeError(f"the load generator failed with exit code {loader.returncode}")
    produced: dict[str, int] = json.loads(out)
    return produced, (busy1 - busy0) / (total1 - total0)


async def latency(
    stack: LocalStack, variant: Variant, load: str, rate: float, seconds: float, warmup: float,
    share: float, value_size: int,
) -> LatencyRun:  # fmt: skip
    """Offer `rate` records/s for `seconds` from a separate process; per-record latency."""
    await flush(members(stack, variant).servers)
    tag = f"{variant.name}-{int(rate)}"
    raw, clean = f"latency-raw-{tag}", f"latency-clean-{tag}"
    await create_topics(stack.bootstrap, {raw: 4, clean: 4, f"{clean}-quarantine": 1})
    if variant.lanes:
        await create_topics(stack.bootstrap, {urgent_topic(raw): 4})
    metrics = RecordingMetrics()
    subject = build_subject(variant, bench_settings(stack, variant, raw, clean), metrics)
    recorder = metrics.recorder
    async with running(subject) as task:
        if variant.exactly_once:  # before the load starts: the raw topic is empty
            assert isinstance(subject, Gateway)
            await watch_transactions(task, subject, metrics.transaction_ended)
            metrics.at_commit = True
        await until(task, lambda: bool(subject.partitions()))
        recorder.from_time = time.monotonic() + warmup
        produced, busy = await _offer_load(stack, raw, rate, seconds, share, value_size)
        # A variant slower than the load works off a backlog after it (half the
        # forwarder's maximum is more than gateway-5 carries on two cores).
        await until(task, lambda: metrics.handled() >= produced["produced"], timeout_s=300)
    await delete_topics(stack.bootstrap, [raw, clean, f"{clean}-quarantine"])
    return LatencyRun(
        variant=variant.name, load=load, offered_rate=rate, produced=produced["produced"],
        forwarded=metrics.forwarded_total(),
        expected_forwarded=produced["produced"] if not variant.dedup else produced["unique"],
        machine_busy=busy, samples_ms=recorder.samples_ms,
    )  # fmt: skip


FLOOR = "broker-floor"


async def floor_latency(
    stack: LocalStack, load: str, rate: float, seconds: float, warmup: float, share: float,
    value_size: int,
) -> LatencyRun:  # fmt: skip
    """The same load read by a bare consumer (no vote, no produce, no commit).

    Raw CreateTime to the record in the consumer's hands: what the broker, the
    load generator and the client cost before the gateway does anything.
    """
    raw = f"latency-raw-{FLOOR}-{int(rate)}"
    await create_topics(stack.bootstrap, {raw: 4})
    consumer = AIOKafkaConsumer(
        raw, bootstrap_servers=stack.bootstrap, auto_offset_reset="earliest",
        fetch_max_wait_ms=int(parse_duration(FETCH_MAX_WAIT).total_seconds() * 1000),
    )  # fmt: skip
    await consumer.start()
    samples: list[float] = []
    seen = 0
    loader = asyncio.create_task(_offer_load(stack, raw, rate, seconds, share, value_size))
    from_time = time.monotonic() + warmup
    deadline = from_time + seconds + 60
    try:
        while not loader.done() or seen < loader.result()[0]["produced"]:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{FLOOR}: {seen} records read, the loader produced more")
            batch = await consumer.getmany(timeout_ms=100)
            now_ms = time.time() * 1000
            counted = time.monotonic() >= from_time
            for records in batch.values():
                seen += len(records)
                if counted:
                    samples.extend(now_ms - r.timestamp for r in records)
        produced, busy = loader.result()
    finally:
        await consumer.stop()
        if not loader.done():
            loader.cancel()
    await delete_topics(stack.bootstrap, [raw])
    return LatencyRun(
        variant=FLOOR, load=load, offered_rate=rate, produced=produced["produced"], forwarded=seen,
        expected_forwarded=produced["produced"], machine_busy=busy, samples_ms=samples,
    )  # fmt: skip
