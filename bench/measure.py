"""One measured run of one variant: throughput on a pre-filled topic, or latency
under a fixed offered load.

Throughput: the gateway reads a raw topic that was filled before it started
(so no load generator competes with it), and the clock runs from the first
fetched batch to the last handled record, which excludes the group join.
CPU: the benchmark process's own CPU time over the same window (it runs the
gateway; the progress display polls at 20 Hz), the Redis instances'
`used_cpu_user + used_cpu_sys` and the broker's from /proc. Memory per mark:
each instance's `used_memory` growth over the run divided by the distinct ids
(each instance holds one mark per id), after a FLUSHALL at the start.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis
from aiokafka import AIOKafkaConsumer
from aiokafka.admin import AIOKafkaAdminClient

from bench.variants import Variant, build_gateway
from gateway.app import Gateway
from gateway.config import Settings, load_settings, parse_duration
from gateway.localstack import LocalStack
from gateway.topics import create_topics
from gateway.traffic import Traffic

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
    forwarded: int
    duplicates: int
    expected_forwarded: int
    expected_duplicates: int
    bytes_per_mark: list[float] = field(default_factory=list)  # one per instance

    @property
    def rate(self) -> float:
        return self.records / self.seconds

    @property
    def correct(self) -> bool:
        return (self.forwarded, self.duplicates) == (
            self.expected_forwarded,
            self.expected_duplicates,
        )

    def as_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "rate": self.rate, "correct": self.correct}


@dataclass
class LatencyRun:
    variant: str
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


# The local broker holds every fetch for its whole wait, even with records
# ready (Apache Kafka answers at once); a short wait keeps that out of latency.
FETCH_MAX_WAIT = "5ms"


def bench_settings(stack: LocalStack, variant: Variant, raw: str, clean: str) -> Settings:
    return load_settings(
        kafka={"bootstrap_servers": stack.bootstrap, "raw_topics": [raw], "clean_topic": clean,
               "group_id": f"bench-{clean}", "quarantine_topic": f"{clean}-quarantine",
               "failure_topic": "bench-failures", "dead_letter_topic": "bench-dead-letter",
               "fetch_max_wait": os.environ.get("BENCH_FETCH_MAX_WAIT", FETCH_MAX_WAIT)},
        redis={"nodes": stack.redis_urls[: variant.redis]},
        dedup={"enabled": variant.dedup},
        metrics={"host": "127.0.0.1", "port": 0},
        log={"level": "ERROR"},
    )  # fmt: skip


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


def process_cpu(pid: int) -> float:
    """User + system CPU seconds of another process (the broker), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


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


async def _until(gateway: Gateway, task: asyncio.Task[None], done: Callable[[], bool]) -> None:
    while not done():
        if task.done():
            task.result()  # surface the gateway's error
            raise RuntimeError("the gateway stopped before the run finished")
        await asyncio.sleep(0.01)


async def throughput(
    stack: LocalStack, variant: Variant, raw: PreparedTopic, round_no: int, progress: Progress
) -> ThroughputRun:
    urls = stack.redis_urls[: variant.redis]
    assert stack.broker is not None and stack.broker.proc is not None
    broker_pid = stack.broker.proc.pid
    await flush(urls)
    clean = f"clean-{variant.name}-{int(raw.share * 100)}-{round_no}"
    await create_topics(stack.bootstrap, {clean: 4, f"{clean}-quarantine": 1})
    settings = bench_settings(stack, variant, raw.name, clean)
    gateway = build_gateway(variant, settings)
    before = await redis_info(urls)
    total = raw.traffic.produced
    stop = asyncio.Event()
    task = asyncio.create_task(gateway.run(stop))
    try:
        # The clock starts when the first batch is in hand: the group join is not timed.
        consumed = gateway.metrics.records_in.labels(raw.name)._value
        await _until(gateway, task, lambda: consumed.get() > 0)
        t0, cpu0, broker0 = time.perf_counter(), time.process_time(), process_cpu(broker_pid)
        redis0 = redis_cpu(await redis_info(urls))

        def finished() -> bool:
            progress(gateway.metrics.handled())
            return gateway.metrics.handled() >= total

        await _until(gateway, task, finished)
        seconds, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        broker_cpu = process_cpu(broker_pid) - broker0
        after = await redis_info(urls)
    finally:
        stop.set()
        await task
    await delete_topics(stack.bootstrap, [clean, f"{clean}-quarantine"])
    expected_forwarded, expected_duplicates = raw.expected(variant)
    return ThroughputRun(
        variant=variant.name, share=raw.share, round=round_no, records=total,
        seconds=seconds, gateway_cpu_s=cpu, redis_cpu_s=redis_cpu(after) - redis0,
        broker_cpu_s=broker_cpu,
        forwarded=int(gateway.metrics.forwarded._value.get()),
        duplicates=int(gateway.metrics.duplicates._value.get()),
        expected_forwarded=expected_forwarded, expected_duplicates=expected_duplicates,
        bytes_per_mark=[
            (a["used_memory"] - b["used_memory"]) / len(raw.traffic.unique_ids)
            for a, b in zip(after, before, strict=True)
            if variant.dedup
        ],
    )  # fmt: skip


class _Recorder:
    """Stands in for the forward-latency histogram: keeps every sample, after the warm-up."""

    def __init__(self) -> None:
        self.samples_ms: list[float] = []
        self.from_time = float("inf")

    def observe(self, seconds: float) -> None:
        if time.monotonic() >= self.from_time:
            self.samples_ms.append(seconds * 1000)


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
    stack: LocalStack, variant: Variant, rate: float, seconds: float, warmup: float,
    share: float, value_size: int,
) -> LatencyRun:  # fmt: skip
    """Offer `rate` records/s for `seconds` from a separate process; per-record latency."""
    urls = stack.redis_urls[: variant.redis]
    await flush(urls)
    raw, clean = f"latency-raw-{variant.name}", f"latency-clean-{variant.name}"
    await create_topics(stack.bootstrap, {raw: 4, clean: 4, f"{clean}-quarantine": 1})
    gateway = build_gateway(variant, bench_settings(stack, variant, raw, clean))
    recorder = _Recorder()
    gateway.metrics.forward_latency = recorder  # type: ignore[assignment]
    stop = asyncio.Event()
    task = asyncio.create_task(gateway.run(stop))
    try:
        await _until(gateway, task, lambda: gateway.readiness()[0])
        recorder.from_time = time.monotonic() + warmup
        produced, busy = await _offer_load(stack, raw, rate, seconds, share, value_size)
        await asyncio.wait_for(
            _until(gateway, task, lambda: gateway.metrics.handled() >= produced["produced"]), 60
        )
    finally:
        stop.set()
        await task
    await delete_topics(stack.bootstrap, [raw, clean, f"{clean}-quarantine"])
    return LatencyRun(
        variant=variant.name, offered_rate=rate, produced=produced["produced"],
        forwarded=int(gateway.metrics.forwarded._value.get()),
        expected_forwarded=produced["produced"] if not variant.dedup else produced["unique"],
        machine_busy=busy, samples_ms=recorder.samples_ms,
    )  # fmt: skip


FLOOR = "broker-floor"


async def floor_latency(
    stack: LocalStack, rate: float, seconds: float, warmup: float, share: float, value_size: int
) -> LatencyRun:
    """The same load read by a bare consumer (no vote, no produce, no commit).

    Raw CreateTime to the record in the consumer's hands: what the broker, the
    load generator and the client cost before the gateway does anything.
    """
    raw = f"latency-raw-{FLOOR}"
    await create_topics(stack.bootstrap, {raw: 4})
    consumer = AIOKafkaConsumer(
        raw, bootstrap_servers=stack.bootstrap, auto_offset_reset="earliest",
        fetch_max_wait_ms=int(parse_duration(FETCH_MAX_WAIT).total_seconds() * 1000),
    )  # fmt: skip
    await consumer.start()
    samples: list[float] = []
    seen = 0
    load = asyncio.create_task(_offer_load(stack, raw, rate, seconds, share, value_size))
    from_time = time.monotonic() + warmup
    deadline = from_time + seconds + 60
    try:
        while not load.done() or seen < load.result()[0]["produced"]:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{FLOOR}: {seen} records read, the loader produced more")
            batch = await consumer.getmany(timeout_ms=100)
            now_ms = time.time() * 1000
            counted = time.monotonic() >= from_time
            for records in batch.values():
                seen += len(records)
                if counted:
                    samples.extend(now_ms - r.timestamp for r in records)
        produced, busy = load.result()
    finally:
        await consumer.stop()
        if not load.done():
            load.cancel()
    await delete_topics(stack.bootstrap, [raw])
    return LatencyRun(
        variant=FLOOR, offered_rate=rate, produced=produced["produced"], forwarded=seen,
        expected_forwarded=produced["produced"], machine_busy=busy, samples_ms=samples,
    )  # fmt: skip
