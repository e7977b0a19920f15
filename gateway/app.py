"""Wiring and lifecycle: start, run the batch loop, stop.

start: health endpoint, wait for a Redis majority, producer, consumer (join
the group). run: fetch a batch, process it under the batch lock, commit.
stop (the stop event, e.g. SIGTERM): stop fetching, finish the batch in
hand, commit it, leave the group, flush and close; teardown runs in reverse.

Two batches are in flight at most: one being voted on, the one before it
being forwarded (`Gateway._loop`). A rebalance waits on the batch lock and
drains (`on_partitions_revoked`), so a revoked partition's in-flight batches
are forwarded and committed before it moves.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRebalanceListener, TopicPartition
from aiokafka.errors import CommitFailedError

from gateway.config import KafkaSettings, Settings, redacted
from gateway.failures import FailureLoop, RawFetcher
from gateway.health import HealthServer
from gateway.metrics import Metrics
from gateway.pipeline import BatchResult, Decided, Pipeline
from gateway.quorum import Quorum
from gateway.sink import Sink

logger = logging.getLogger(__name__)

FETCH_TIMEOUT_MS = 100  # how long an idle fetch waits: bounds the reaction to stop


def kafka_client_options(kafka: KafkaSettings) -> dict[str, Any]:
    """Connection and security options shared by every aiokafka client we build."""
    options: dict[str, Any] = {
        "bootstrap_servers": kafka.bootstrap_servers,
        "security_protocol": kafka.security_protocol,
    }
    if kafka.sasl_mechanism:
        options["sasl_mechanism"] = kafka.sasl_mechanism
        options["sasl_plain_username"] = kafka.sasl_username
        options["sasl_plain_password"] = (
            kafka.sasl_password.get_secret_value() if kafka.sasl_password else None
        )
    if kafka.security_protocol in ("SSL", "SASL_SSL"):
        from aiokafka.helpers import create_ssl_context

        options["ssl_context"] = create_ssl_context(
            cafile=str(kafka.ssl_cafile) if kafka.ssl_cafile else None,
            certfile=str(kafka.ssl_certfile) if kafka.ssl_certfile else None,
            keyfile=str(kafka.ssl_keyfile) if kafka.ssl_keyfile else None,
        )
    return options


def build_producer(kafka: KafkaSettings) -> AIOKafkaProducer:
    return AIOKafkaProducer(
        **kafka_client_options(kafka),
        acks="all",
        enable_idempotence=kafka.producer_idempotence,
        # The sink hands over whole per-partition batches: lingering could only
        # add latency, never batch more (bench/RESULTS.md, latency).
        linger_ms=0,
        max_batch_size=1_000_000,
        max_request_size=1_048_576,
    )


@dataclass
class _Backoff:
    delay_s: float
    resume_at: float


class Gateway:
    """The dedup gateway service. `await Gateway(settings).run(stop_event)`."""

    def __init__(self, settings: Settings, metrics: Metrics | None = None) -> None:
        self.settings = settings
        self.metrics = metrics or Metrics()
        self.quorum = Quorum(settings.redis, self.metrics)
        self.health = HealthServer(
            self.metrics.registry, self.readiness, settings.metrics.host, settings.metrics.port
        )
        self.batch_lock = asyncio.Lock()
        self.consumer: AIOKafkaConsumer | None = None
        self.blocked: dict[TopicPartition, _Backoff] = {}
        self.batches = 0
        self._lag_due = 0.0
        self._finishing: asyncio.Task[None] | None = None  # the batch being forwarded

    def readiness(self) -> tuple[bool, str]:
        if not self.quorum.healthy:
            return False, "no Redis majority"
        if self.consumer is None or not self.consumer.assignment():
            return False, "not in the consumer group (no partitions assigned)"
        if self.blocked:
            return False, f"{len(self.blocked)} partition(s) blocked on undecided votes"
        return True, "ready"

    async def run(self, stop: asyncio.Event) -> None:
        kafka = self.settings.kafka
        logger.info(
            "starting: raw=%s clean=%s group=%s redis=[%s] id=%s on_no_quorum=%s",
            ",".join(kafka.raw_topics), kafka.clean_topic, kafka.group_id,
            ", ".join(redacted(n) for n in self.settings.redis.nodes),
            self.settings.dedup.id, self.settings.dedup.on_no_quorum,
        )  # fmt: skip
        async with contextlib.AsyncExitStack() as stack:
            await self.health.start()
            stack.push_async_callback(self.health.stop)
            stack.push_async_callback(self.quorum.close)
            await self.quorum.wait_for_majority(stop)
            if stop.is_set():
                return
            producer = build_producer(kafka)
            await producer.start()
            stack.push_async_callback(producer.stop)
            consumer = AIOKafkaConsumer(
                **kafka_client_options(kafka),
                group_id=kafka.group_id,
                enable_auto_commit=False,
                auto_offset_reset="earliest",
                max_partition_fetch_bytes=4 * 1024 * 1024,
                fetch_max_wait_ms=int(kafka.fetch_max_wait.total_seconds() * 1000),
                session_timeout_ms=int(kafka.session_timeout.total_seconds() * 1000),
                heartbeat_interval_ms=int(kafka.session_timeout.total_seconds() * 1000 / 3),
            )
            await consumer.start()
            stack.push_async_callback(consumer.stop)
            consumer.subscribe(kafka.raw_topics, listener=_Rebalance(self))
            self.consumer = consumer
            pipeline = Pipeline(self.settings, self.quorum, Sink(producer), self.metrics)

            failures = FailureLoop(self.settings, self.quorum, producer, self.metrics)
            commands = AIOKafkaConsumer(
                **kafka_client_options(kafka),
                group_id=f"{kafka.group_id}.failures",
                enable_auto_commit=False,
                auto_offset_reset="earliest",
            )
            await commands.start()
            stack.push_async_callback(commands.stop)
            commands.subscribe([kafka.failure_topic], listener=_ForgetRevoked(failures))
            raw_reader = AIOKafkaConsumer(
                **kafka_client_options(kafka), enable_auto_commit=False, auto_offset_reset="none"
            )
            await raw_reader.start()
            stack.push_async_callback(raw_reader.stop)
            async with asyncio.TaskGroup() as tasks:
                tasks.create_task(self._loop(consumer, pipeline, stop))
                tasks.create_task(failures.run(commands, RawFetcher(raw_reader), stop))
        logger.info("stopped after %d batches", self.batches)

    async def _loop(
        self, consumer: AIOKafkaConsumer, pipeline: Pipeline, stop: asyncio.Event
    ) -> None:
        """Fetch, vote, forward, commit; two batches in flight at most.

        Batch k+1 is voted on while batch k is still being acknowledged by the
        broker (the Redis round trip overlaps the Kafka one); batches are
        forwarded and committed strictly in fetch order, and a batch's offsets
        are committed only after its records were acknowledged.
        """
        max_records = self.settings.kafka.max_batch_records
        try:
            while not stop.is_set():
                self._resume_due(consumer)
                batch = await consumer.getmany(timeout_ms=FETCH_TIMEOUT_MS, max_records=max_records)
                self.metrics.ready.set(1 if self.readiness()[0] else 0)
                if not batch:
                    await self.drain()
                    await self._update_lag(consumer)
                    continue
                started = time.perf_counter()
                async with self.batch_lock:
                    decided = await pipeline.decide(batch)
                    # Block before the next fetch, so it brings nothing past a block.
                    self._block(consumer, decided.result, batch.keys())
                    await self.drain()
                    size = sum(len(r) for r in batch.values())
                    self._finishing = asyncio.create_task(
                        self._finish(consumer, pipeline, decided, started, size)
                    )
                await self._update_lag(consumer)
        finally:
            await self.drain()

    async def drain(self) -> None:
        """Wait until the batch being forwarded is acknowledged and committed."""
        if self._finishing is not None:
            finishing, self._finishing = self._finishing, None
            await finishing

    async def _finish(
        self,
        consumer: AIOKafkaConsumer,
        pipeline: Pipeline,
        decided: Decided,
        started: float,
        size: int,
    ) -> None:
        result = await pipeline.finish(decided)
        await self._commit(consumer, result)
        self.batches += 1
        self.metrics.batch_seconds.observe(time.perf_counter() - started)
        self.metrics.batch_records.observe(size)

    async def _commit(self, consumer: AIOKafkaConsumer, result: BatchResult) -> None:
        if not result.commits:
            return
        try:
            await consumer.commit(result.commits)
        except CommitFailedError as exc:
            # The partitions moved on; their new owner replays from the last
            # commit, and finds our marks owned by these same source records.
            logger.warning("commit failed after a rebalance, batch will be replayed: %s", exc)

    def _block(
        self, consumer: AIOKafkaConsumer, result: BatchResult, fetched: Iterable[TopicPartition]
    ) -> None:
        """Pause partitions with an undecided vote; lift blocks that have cleared."""
        backoff = self.settings.dedup
        now = time.monotonic()
        for tp in fetched:
            if tp in result.blocked:
                consumer.seek(tp, result.blocked[tp])
                consumer.pause(tp)
                previous = self.blocked.get(tp)
                delay = (
                    backoff.retry_backoff_initial.total_seconds()
                    if previous is None
                    else min(previous.delay_s * 2, backoff.retry_backoff_max.total_seconds())
                )
                self.blocked[tp] = _Backoff(delay, now + delay)
                logger.warning(
                    "partition %s blocked at offset %d: no majority decided; retry in %.2fs",
                    tp, result.blocked[tp], delay,
                )  # fmt: skip
            elif self.blocked.pop(tp, None) is not None:
                logger.info("partition %s unblocked", tp)
        self.metrics.partitions_blocked.set(len(self.blocked))

    def _resume_due(self, consumer: AIOKafkaConsumer) -> None:
        now = time.monotonic()
        due = [tp for tp, b in self.blocked.items() if b.resume_at <= now]
        if due:
            consumer.resume(*due)

    async def _update_lag(self, consumer: AIOKafkaConsumer) -> None:
        """Lag from the fetch-response high watermark (right on every broker), once a second."""
        now = time.monotonic()
        if now < self._lag_due:
            return
        self._lag_due = now + 1.0
        for tp in consumer.assignment():
            high = consumer.highwater(tp)
            if high is not None:  # a fetch happened, so the position is known
                lag = max(0, high - await consumer.position(tp))
                self.metrics.consumer_lag.labels(tp.topic, str(tp.partition)).set(lag)

    def forget(self, partitions: Iterable[TopicPartition]) -> None:
        for tp in partitions:
            self.blocked.pop(tp, None)
            with contextlib.suppress(KeyError):
                self.metrics.consumer_lag.remove(tp.topic, str(tp.partition))
        self.metrics.partitions_blocked.set(len(self.blocked))


class _Rebalance(ConsumerRebalanceListener):  # type: ignore[misc]
    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        # Wait for the batches in hand: they are forwarded and committed before
        # the partitions move, so the next owner neither loses nor repeats them.
        async with self.gateway.batch_lock:
            await self.gateway.drain()
            self.gateway.forget(revoked)
        if revoked:
            logger.info("partitions revoked: %s", sorted(map(str, revoked)))

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        logger.info("partitions assigned: %s", sorted(map(str, assigned)))


class _ForgetRevoked(ConsumerRebalanceListener):  # type: ignore[misc]
    """Failure-topic partitions that move: drop their scheduled effects here."""

    def __init__(self, failures: FailureLoop) -> None:
        self.failures = failures

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        self.failures.forget(revoked)

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        pass
