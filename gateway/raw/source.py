"""The raw fetch loop: fetch a batch, vote on it, hand it to the checkpoint; rebalances.

Three batches are in flight at most: one whose ids are being claimed, the
one before it whose vote is being finished (its claims were sent first, so
Redis always has the next batch's work while the gateway classifies), and
the one before that being forwarded and committed (gateway/raw/checkpoint.py).
The loop holds `batch_lock` while it votes and hands a batch over; a
rebalance takes the same lock and finishes the batch being claimed and
drains, so a revoked partition's batches in hand are forwarded and
committed before the partition moves. A batch fetched before the revoke but
not yet in hand when it ran is dropped: it is read again from the commits.

A block (policy `block`) rewinds its partition to the undecided record: the
next batch, fetched before the block was known, leaves that partition's
records out (they were claimed by their own tokens, so reading them again
finds their marks theirs).

A raw record with a header name that is not UTF-8 makes aiokafka's `getmany`
raise, every time (gateway/kafka/salvage.py). The loop then reads the partitions
leniently from their committed offsets and quarantines such a record
(`bad_header`, those headers dropped), after the records before it, and the
partition reads on after it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterable

from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener, ConsumerRecord, TopicPartition

from gateway.errors import BadRecord
from gateway.kafka.clients import unless_stopped
from gateway.kafka.exactly_once import StepAborted, Transactions, read_again_from_commits
from gateway.kafka.offsets import (
    Rebalance,
    RevocationGuard,
    fetch_past_bad_headers,
)
from gateway.kafka.transactions import Member, group_member
from gateway.metrics import Metrics
from gateway.raw.blocking import BlockedPartitions
from gateway.raw.checkpoint import Checkpoint
from gateway.raw.lanes import LaneScheduler
from gateway.raw.pipeline import Pipeline, Voting
from gateway.rules.backoff import backoff_delay
from gateway.rules.classify import Decided
from gateway.waits import wait_or_stop

logger = logging.getLogger(__name__)

FETCH_TIMEOUT_MS = 100  # how long an idle fetch waits: bounds the reaction to stop
STARVED_FETCH_MS = 50  # how long a starved lane's own fetch waits before the usual one
LAG_EVERY_S = 1.0


class RawSource:
    """The raw topics' consumer loop. Owns the blocked partitions and the lag gauges."""

    def __init__(
        self,
        consumer: AIOKafkaConsumer,
        pipeline: Pipeline,
        blocked: BlockedPartitions,
        metrics: Metrics,
        max_records: int,
        lanes: LaneScheduler | None = None,
        transactions: Transactions | None = None,
    ) -> None:
        self.consumer = consumer
        self.pipeline = pipeline
        self.blocked = blocked
        self.lanes = lanes
        self.metrics = metrics
        self.max_records = max_records
        self.checkpoint = Checkpoint(consumer, transactions)
        self.batch_lock = asyncio.Lock()
        self.claiming: Voting | None = None  # the batch whose ids are being claimed
        self.guard = RevocationGuard()  # a batch fetched before a revoke is stale
        self.fetched_as: Member = (-1, "", None)  # who the consumer was at the last fetch
        self._salvage_failures = 0  # salvages in a row that found nothing to get past
        self.batches = 0
        self._lag_due = 0.0

    def listener(self) -> ConsumerRebalanceListener:
        # A revoke waits for the batches in hand: they are forwarded and committed
        # before the partitions move, so the next owner neither loses nor repeats them.
        return Rebalance(
            "partitions", self.batch_lock, self.guard, self._revoked, self._settle, self._assigned
        )

    def _revoked(self, partitions: Iterable[TopicPartition]) -> None:
        self.forget(partitions)  # looked up at the revoke: a test may wrap `forget`

    async def _settle(self) -> None:
        await self.hand_over(None)
        await self._drained()

    async def _drained(self) -> None:
        """`checkpoint.drain`, reading everything again when its transaction aborted."""
        try:
            await self.checkpoint.drain()
        except StepAborted:
            await self._read_again()

    async def _read_again(self) -> None:
        """A batch's transaction aborted: nothing it forwarded is visible and no offset
        moved. Every assigned partition reads again from its committed offset; the
        batch being claimed and any batch fetched meanwhile forward nothing (their
        records come again)."""
        if self.claiming is not None:
            self.claiming.dropped.update(self.claiming.parts)
        self.guard.revoked()  # a batch fetched before this is stale
        self.metrics.transactions_aborted.labels("raw").inc()
        await read_again_from_commits(self.consumer)

    def _assigned(self) -> None:
        if self.lanes is not None:  # hold lanes before the first fetch brings them
            self.lanes.apply(self.consumer)

    async def run(self, stop: asyncio.Event) -> None:
        """Fetch, vote, forward, commit until `stop`; the batches in hand are finished first."""
        consumer = self.consumer
        try:
            while not stop.is_set():
                self.blocked.resume_due(consumer)
                # After the blocks: a held lane stays paused.
                first = self.lanes.apply(consumer) if self.lanes is not None else []
                try:
                    # A batch being claimed: take what is fetched already, do not wait.
                    fetched = await unless_stopped(
                        self._fetch(consumer, first, waiting=self.claiming is None), stop
                    )
                    if fetched is None:
                        break
                    batch = fetched
                except UnicodeDecodeError as exc:  # a header name (gateway/kafka/salvage.py)
                    started = time.perf_counter()
                    async with self.batch_lock:
                        await self.hand_over(None)
                        salvaged = await self._salvage(exc, started)
                    if salvaged:
                        self._salvage_failures = 0
                    else:  # nothing lost: every partition was rewound to its commit
                        self._salvage_failures += 1
                        await wait_or_stop(stop, backoff_delay(0.5, 30.0, self._salvage_failures))
                    continue
                if not batch:
                    if self.claiming is not None:  # nothing more yet: finish its vote
                        async with self.batch_lock:
                            await self.hand_over(None)
                    else:  # idle: the last batch's commit is waited for here
                        await self._drained()
                    await self._update_lag()
                    continue
                async with self.batch_lock:
                    if self.guard.stale():
                        # A revoke ran between the fetch and the lock: each partition
                        # reads again from its committed offset (aiokafka resets every
                        # position on the assignment that follows), so this batch is
                        # left to whoever owns its partitions then.
                        stale = sum(map(len, batch.values()))
                        self.metrics.records_reread.labels("rebalance").inc(stale)
                        logger.info(
                            "%d records fetched before a rebalance are left to be read again",
                            stale,
                        )
                        continue
                    if self.lanes is not None:
                        self.lanes.fetched(batch.keys())
                    voting = self.pipeline.begin(batch)
                    voting.member = self.fetched_as
                    await self.hand_over(voting)
                await self._update_lag()
        finally:
            async with self.batch_lock:
                await self.hand_over(None)
            try:
                await self.checkpoint.drain()
            except StepAborted:  # nothing of it committed: the partitions' next reader replays it
                self.metrics.transactions_aborted.labels("raw").inc()

    async def hand_over(self, voting: Voting | None) -> None:
        """Finish the vote on the batch being claimed and hand it to the checkpoint;
        `voting` (its claims already sent) is claimed meanwhile and takes its place.
        Called with `batch_lock` held."""
        done, self.claiming = self.claiming, voting
        if done is None:
            return
        decided = await self.pipeline.end(done)
        # Block before the next fetch, so it brings nothing past a block; the batch
        # fetched before it leaves the blocked partitions out.
        fetched = done.fetched()
        for tp in done.dropped & done.parts.keys():
            self.metrics.records_reread.labels("block").inc(len(done.parts[tp].records))
            logger.info(
                "partition %s: %d records fetched before its block are left to be read again",
                tp, len(done.parts[tp].records),
                extra={"topic": tp.topic, "partition": tp.partition},
            )  # fmt: skip
        self.blocked.update(self.consumer, decided.blocked, fetched)
        if voting is not None:
            voting.dropped.update(decided.blocked)
        size = sum(len(done.parts[tp].records) for tp in fetched)
        try:
            await self.checkpoint.then(self._finish(decided, done.started, size), done.member)
        except StepAborted:  # the batch before `done`: `done` is read again too
            await self._read_again()

    async def _fetch(
        self, consumer: AIOKafkaConsumer, first: list[TopicPartition], waiting: bool
    ) -> dict[TopicPartition, list[ConsumerRecord[bytes, bytes]]]:
        """One fetch; a starved lane's partitions (`first`) are asked on their own first.
        Not `waiting`: the usual fetch takes only what the consumer has fetched already."""
        most = self.max_records
        batch: dict[TopicPartition, list[ConsumerRecord[bytes, bytes]]] = {}
        if first:
            batch = await consumer.getmany(*first, timeout_ms=STARVED_FETCH_MS, max_records=most)
        if not batch:
            wait_ms = FETCH_TIMEOUT_MS if waiting else 0
            batch = await consumer.getmany(timeout_ms=wait_ms, max_records=most)
        # Read as getmany returns, no await between: a getmany that waited for a
        # rebalance returns records of the new assignment, which are not stale.
        self.guard.fetched()
        self.fetched_as = group_member(consumer)
        return batch

    async def _salvage(self, error: UnicodeDecodeError, started: float) -> bool:
        """Get past the records aiokafka could not parse, as one batch; False to try again.

        The failed `getmany` may have moved partitions past records it never
        returned: once everything handed out is committed, each partition is
        rewound to its committed offset. Each one not paused is read leniently
        from there; where one holds records with header names that are not
        UTF-8, those are quarantined, the others up to the end of their batch
        (aiokafka cannot read past them in it) decided as usual, and the
        partition reads on after that batch.
        """
        consumer = self.consumer
        logger.warning("a raw record cannot be parsed (%s): reading past it", error)
        await self._drained()  # everything handed out is committed: read from there
        member = group_member(consumer)
        found = await fetch_past_bad_headers(
            consumer, self.pipeline.settings.kafka, self.max_records
        )
        if found is None:
            return False
        bad = {tp: f for tp, f in found.items() if f.bad}
        if not bad:  # moved or gone meanwhile (a rebalance): the next fetch tells
            logger.error(
                "no unparseable record found where the fetch failed (%s) in %s: fetching again",
                error,
                ", ".join(f"{tp.topic}/{tp.partition}" for tp in sorted(found)) or "no partition",
            )
            return False
        batch = {tp: f.records for tp, f in bad.items() if f.records}
        decided = await self.pipeline.decide(batch) if batch else Decided()
        for tp, f in bad.items():
            # Under `block`, records from the blocked one on wait for the partition to resume.
            until = decided.blocked.get(tp)
            for rec, dropped in f.bad:
                if until is None or rec.offset < until:
                    self.metrics.records_in.labels(tp.topic).inc()
                    reason = f"{dropped} header name(s) not UTF-8, dropped"
                    decided.quarantine.append((rec, BadRecord("bad_header", reason)))
            if until is None:  # aiokafka could read nothing more of that batch: read on after it
                decided.commits[tp] = f.next_offset
                consumer.seek(tp, f.next_offset)
            else:
                decided.commits[tp] = until  # everything before it is forwarded or quarantined
        self.blocked.update(consumer, decided.blocked, bad.keys())
        size = sum(len(f.records) + len(f.bad) for f in bad.values())
        try:
            await self.checkpoint.then(self._finish(decided, started, size), member)
        except StepAborted:
            await self._read_again()
            return False
        return True

    async def _finish(
        self, decided: Decided, started: float, size: int
    ) -> dict[TopicPartition, int]:
        commits = await self.pipeline.finish(decided)
        self.batches += 1
        self.metrics.batch_seconds.observe(time.perf_counter() - started)
        self.metrics.batch_records.observe(size)
        return commits

    async def _update_lag(self) -> None:
        """Lag from the fetch-response high watermark (right on every broker), once a second."""
        now = time.monotonic()
        if now < self._lag_due:
            return
        self._lag_due = now + LAG_EVERY_S
        for tp in self.consumer.assignment():
            high = self.consumer.highwater(tp)
            if high is not None:  # a fetch happened, so the position is known
                lag = max(0, high - await self.consumer.position(tp))
                self.metrics.consumer_lag.labels(tp.topic, str(tp.partition)).set(lag)

    def forget(self, partitions: Iterable[TopicPartition]) -> None:
        partitions = list(partitions)
        self.blocked.forget(partitions)
        for tp in partitions:
            with contextlib.suppress(KeyError):
                self.metrics.consumer_lag.remove(tp.topic, str(tp.partition))
