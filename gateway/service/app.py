"""Wiring and lifecycle: start, run, stop. The data path itself lives elsewhere.

start: health endpoint, wait for a Redis majority, producer, every consumer and
loop (each is built here: the delay loop's, the raw consumer joining its group, the
failure loop's, its mode picked here). run: the raw fetch loop
(gateway/raw/source.py), the failure loop (gateway/failures/loop.py) and the delay
loop (gateway/delay/loop.py) side by side.
stop (the stop event, e.g. SIGTERM): stop fetching, finish and commit the
batch in hand, leave the groups, flush and close; teardown runs in reverse.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from pathlib import Path

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.errors import KafkaError

from gateway.config import Settings
from gateway.delay.coalescer import Coalescer
from gateway.delay.leftovers import leftover_tiers, refuse_stranded_tiers
from gateway.delay.loop import DelayLoop
from gateway.delay.router import Router
from gateway.delay.routes import Scheduled
from gateway.errors import ConfigError
from gateway.failures.loop import CommandPartition, FailureLoop, FailureMode
from gateway.failures.release import Releases
from gateway.failures.retry import Retries
from gateway.kafka.admin import transactions_unsupported
from gateway.kafka.clients import (
    build_consumer,
    build_producer,
    stop_all_within,
    stop_within,
)
from gateway.kafka.completion import (
    Completions,
    PlainCompletions,
    TransactionalCompletions,
)
from gateway.kafka.offsets import OffsetBook
from gateway.kafka.read_back import RawFetcher
from gateway.kafka.sink import Sink
from gateway.kafka.startup_wait import wait_for_broker
from gateway.member_urls import member_name
from gateway.metrics import Metrics
from gateway.quorum.quorum import Quorum
from gateway.raw.blocking import BlockedPartitions
from gateway.raw.lanes import LaneScheduler
from gateway.raw.pipeline import Pipeline
from gateway.raw.quarantine import QuarantineWatch
from gateway.raw.routes import Direct
from gateway.raw.source import RawSource
from gateway.rules.tiers import tier_topics
from gateway.service.health import HealthServer
from gateway.service.topic_watch import TopicWatch
from gateway.waits import wait_or_stop

logger = logging.getLogger(__name__)

READINESS_EVERY_S = 1.0


@dataclass
class Connected:
    """What start-up built that the run phase drives."""

    source: RawSource
    failures: FailureLoop
    delay: DelayLoop | None
    lanes: LaneScheduler


class Gateway:
    """The dedup gateway service. `await Gateway(settings).run(stop_event)`.

    `quorum` and `metrics` may be injected (the benchmark's naive variant, tests
    that read counters); by default they are built from `settings`. `config`: the
    file the settings came from, named in the command a missing topic's line gives.
    """

    def __init__(
        self, settings: Settings, *, quorum: Quorum | None = None, metrics: Metrics | None = None,
        config: Path | None = None,
    ) -> None:  # fmt: skip
        self.settings = settings
        self.topics = TopicWatch(settings, config)  # a configured topic that does not exist
        self.metrics = metrics or Metrics()
        self.metrics.preinit(settings)
        self.quorum = quorum or Quorum(settings.redis, self.metrics)
        self.health = HealthServer(
            self.metrics.registry, self.readiness, settings.metrics.host, settings.metrics.port
        )
        dedup = settings.dedup
        self.blocked = BlockedPartitions(
            dedup.retry_backoff_initial.total_seconds(),
            dedup.retry_backoff_max.total_seconds(),
            self.metrics,
        )
        self.source: RawSource | None = None
        self.quarantine = QuarantineWatch(settings, self.metrics)  # a wrong [dedup] id told

    def readiness(self) -> tuple[bool, str]:
        """Ready unless it cannot work: no Redis majority, a configured topic missing,
        or partitions blocked.

        A member without partitions (the group has more members than
        partitions) is ready: it takes over as soon as one moves to it. Ready but
        quarantining most records (a wrong `[dedup] id`, gateway/raw/quarantine.py):
        still 200, the body "degraded: ..." saying so.
        """
        if not self.quorum.healthy:
            return False, self.quorum.why_unhealthy()
        if self.topics.problem is not None:  # a missing topic: never created, waited for
            return False, self.topics.problem
        if len(self.blocked):
            return False, f"{len(self.blocked)} partition(s) blocked on undecided votes"
        if self.source is None:
            return False, "starting"
        if (degraded := self.quarantine.degraded()) is not None:
            return True, f"degraded: {degraded}" + self.quorum.not_answering()
        return True, "ready" + self.quorum.not_answering()

    async def run(self, stop: asyncio.Event) -> None:
        kafka = self.settings.kafka
        logger.info(
            "starting: raw=%s clean=%s group=%s redis=[%s] id=%s on_no_quorum=%s",
            ",".join(kafka.raw_topics), kafka.clean_topic, kafka.group_id,
            ", ".join(member_name(n) for n in self.settings.redis.nodes),
            self.settings.dedup.id, self.settings.dedup.on_no_quorum,
        )  # fmt: skip
        async with contextlib.AsyncExitStack() as stack:
            await self.health.start()
            stack.push_async_callback(self.health.stop)
            stack.push_async_callback(self.quorum.close)
            # After the loops stop, before close: send the fills queued for members
            # that gave no answer (a bounded wait), so they outlive this process.
            stack.push_async_callback(self.quorum.drain_at_stop)
            await self.quorum.wait_for_majority(stop)
            running = await self._connect_until_up(stack, stop)
            if running is None:
                return
            source, lanes = running.source, running.lanes
            async with asyncio.TaskGroup() as tasks:
                tasks.create_task(source.run(stop))
                tasks.create_task(running.failures.run(stop))
                tasks.create_task(self._report_readiness(stop))
                if running.delay is not None:
                    tasks.create_task(running.delay.run(stop))
                if lanes.active:
                    tasks.create_task(lanes.run(source.consumer, stop))
                tasks.create_task(self.quorum.watch(stop))
                tasks.create_task(self.topics.watch(source.consumer._client, stop))
        logger.info("stopped after %d batches", self.batches)

    async def _connect_until_up(
        self, stack: contextlib.AsyncExitStack, stop: asyncio.Event
    ) -> Connected | None:
        """Wait for the broker and for every configured topic to exist (unready, the
        missing one named on /readyz), then start every client and loop part; None at `stop`.
        A broker that stops answering in the middle (a restart, a hang) is waited for
        again, what had started stopped first: start-up never exits on it."""
        kafka = self.settings.kafka
        while await wait_for_broker(kafka, stop):
            attempt = contextlib.AsyncExitStack()
            try:
                # Every topic exists before a client names one (none is ever created).
                if not await self.topics.wait(kafka, stop):
                    return None
                running = await self._connect(attempt)
            except (KafkaError, OSError) as exc:
                await attempt.aclose()
                logger.warning(
                    "the Kafka broker at %s stopped answering during start-up (%r): waiting "
                    "for it again", kafka.bootstrap_servers, exc,
                )  # fmt: skip
                continue
            except BaseException:  # a bad setting: what started is stopped, then it stops us
                await attempt.aclose()
                raise
            stack.push_async_callback(attempt.aclose)
            return running
        return None

    async def _connect(self, stack: contextlib.AsyncExitStack) -> Connected:
        """Start the clients and build the loops (each started client's stop on `stack`)."""
        kafka = self.settings.kafka
        producer = build_producer(kafka)
        await producer.start()
        stack.push_async_callback(producer.stop)
        # Every collaborator is built here, once, and handed to those that use it.
        settings, metrics = self.settings, self.metrics
        sink = Sink(producer, kafka, metrics)  # every loop's: raw, delay, failure
        # updates on the raw path, closes in the delay loop: one window state
        q, coalesce = self.quorum, settings.coalesce.enabled
        coalescer = Coalescer(settings, q.windows, q, metrics) if coalesce else None
        router = Router(settings, metrics) if settings.delay.enabled else None
        # How every loop's steps complete, decided once: plainly, or each in a
        # transaction of the loop's own producer (gateway/kafka/completion.py).
        plain = PlainCompletions(sink)
        completions: Completions = (
            TransactionalCompletions(kafka, metrics, stack, plain)
            if await self._exactly_once(producer)
            else plain
        )
        delay = None
        if router is not None:  # before any record is routed to a tier topic
            delay = await start_delay_loop(settings, completions, metrics, stack, coalescer)
        else:  # records waiting in a tier would never be delivered: refuse
            await refuse_stranded_tiers(settings)
        consumers: list[AIOKafkaConsumer] = []  # stopped side by side: each may wait
        stack.push_async_callback(stop_all_within, consumers)  # for a held join
        consumer = build_consumer(
            kafka,
            kafka.group_id,
            max_partition_fetch_bytes=4 * 1024 * 1024,
            fetch_max_wait_ms=int(kafka.fetch_max_wait.total_seconds() * 1000),
        )
        await consumer.start()
        consumers.append(consumer)
        completion = await completions.for_loop("raw", consumer)
        # Where decided-new copies go, decided once (gateway/raw/routes.py).
        routes = (
            Direct(completion.sink, kafka.clean_topic)
            if router is None
            else Scheduled(completion.sink, kafka.clean_topic, router, coalescer)
        )
        pipeline = Pipeline(
            settings, self.quorum, completion.sink, metrics, routes=routes,
            quarantine=self.quarantine,
        )  # fmt: skip
        lanes = LaneScheduler(self.settings, self.blocked, self.metrics)
        source = RawSource(
            consumer, pipeline, self.blocked, self.metrics, kafka.max_batch_records,
            completion, lanes if lanes.active else None,
        )  # fmt: skip
        consumer.subscribe(kafka.raw_topics, listener=source.listener())
        if lanes.active:  # the lanes' lag before the first fetch, so it takes the right lanes
            await lanes.first_read(consumer)

        commands = build_consumer(kafka, f"{kafka.group_id}.failures")
        await commands.start()
        consumers.append(commands)
        raw_reader = build_consumer(kafka, None, auto_offset_reset="none")
        await raw_reader.start()
        consumers.append(raw_reader)
        failures = await failure_loop(
            settings, self.quorum, completions, metrics, commands, RawFetcher(raw_reader)
        )
        commands.subscribe([kafka.failure_topic], listener=failures.listener())
        self.source = source
        return Connected(source, failures, delay, lanes)

    async def _exactly_once(self, producer: AIOKafkaProducer) -> bool:
        """Whether `[kafka] exactly_once` resolves on for this broker; ConfigError when
        it is "on" and the broker cannot."""
        kafka = self.settings.kafka
        if kafka.exactly_once == "off":
            return False
        if (why := await transactions_unsupported(producer.client)) is not None:
            if kafka.exactly_once == "on":
                raise ConfigError(f'kafka.exactly_once: {why}; set it to "auto" or "off"')
            logger.warning("exactly_once = auto: at-least-once output, %s", why)
            return False
        return True

    def partitions(self) -> set[TopicPartition]:
        """The raw partitions assigned to this gateway now."""
        return self.source.consumer.assignment() if self.source is not None else set()

    @property
    def batches(self) -> int:
        return self.source.batches if self.source is not None else 0

    async def _report_readiness(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            self.quarantine.tick()  # the quarantine share over its window
            self.metrics.ready.set(1 if self.readiness()[0] else 0)
            await wait_or_stop(stop, READINESS_EVERY_S)


async def start_delay_loop(
    settings: Settings,
    completions: Completions,
    metrics: Metrics,
    stack: contextlib.AsyncExitStack,
    closer: Coalescer | None = None,
) -> DelayLoop:
    """Join `<group_id>.delay` on the tier topics; ConfigError naming any that is missing.
    `closer` decides the close of coalesced records (gateway/delay/coalescer.py);
    `completions`: how its steps complete (gateway/kafka/completion.py).

    Tier topics are never created here (the gateway creates no topic): a missing
    one is a deployment step left out, reported before any record is routed.
    """
    kafka = settings.kafka
    consumer = build_consumer(
        kafka,
        f"{kafka.group_id}.delay",
        fetch_max_wait_ms=int(kafka.fetch_max_wait.total_seconds() * 1000),
    )
    await consumer.start()
    stack.push_async_callback(stop_within, consumer)
    topics = tier_topics(settings)
    existing = await consumer.topics()  # all topics' metadata: never auto-creates one
    missing = [t for t in topics if t not in existing]
    if missing:
        raise ConfigError(
            f"delay.tiers: tier topic(s) {', '.join(missing)} do not exist; create them "
            "(README, Scheduled delivery) or change [delay] tiers"
        )
    leftover = await leftover_tiers(consumer, settings, existing)
    completion = await completions.for_loop("delay", consumer)
    loop = DelayLoop(settings, consumer, completion, metrics, closer, leftover)
    consumer.subscribe([*topics, *sorted(leftover)], listener=loop.listener())
    logger.info("scheduled delivery: tiers %s, group %s.delay", ", ".join(topics), kafka.group_id)
    if leftover:
        logger.warning(
            "tier topic(s) %s are not in [delay] tiers: read until empty, their records "
            "delivered when due to %s; delete them once their dedup_delay_backlog_records is 0 "
            "(docs/operations.md, Changing the configuration safely)",
            ", ".join(sorted(leftover)), kafka.clean_topic,
        )  # fmt: skip
    return loop


async def failure_loop(
    settings: Settings,
    quorum: Quorum,
    completions: Completions,
    metrics: Metrics,
    commands: AIOKafkaConsumer,
    fetcher: RawFetcher,
) -> FailureLoop:
    """The failure loop on `commands`, its mode chosen once by `[failures] mode`
    (gateway/failures/release.py or retry.py): retries and dead letters complete through
    `completions` (in transactions with `[kafka] exactly_once`); releases write nothing."""
    book: OffsetBook[CommandPartition] = OffsetBook(CommandPartition)
    mode: FailureMode
    if settings.failures.mode == "release":
        completion = await completions.for_loop("failures", commands, writes=False)
        mode = Releases(quorum, metrics)
    else:
        completion = await completions.for_loop("failures", commands)
        mode = Retries(settings, quorum, completion, metrics, fetcher, book)
    return FailureLoop(settings, mode, metrics, commands, book, completion)
