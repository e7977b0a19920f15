"""The raw loop, a step on the consumer-loop skeleton (gateway/kafka/loop.py): fetch a
batch, vote on it, hand it to the checkpoint; rebalances.

Three batches are in flight at most: one whose ids are being claimed, the
one before it whose vote is being finished (its claims were sent first, so
Redis always has the next batch's work while the gateway classifies), and
the one before that being forwarded and committed (gateway/raw/checkpoint.py).
The skeleton holds its lock while the step votes and hands a batch over; a
rebalance takes the same lock and the step settles (finishes the batch being
claimed and drains), so a revoked partition's batches in hand are forwarded and
committed before the partition moves. A batch fetched before the revoke but
not yet in hand when it ran is dropped: it is read again from the commits.

A block (policy `block`) rewinds its partition to the undecided record: the
next batch, fetched before the block was known, leaves that partition's
records out (they were claimed by their own tokens, so reading them again
finds their marks theirs).

A raw record with a header name that is not UTF-8 makes aiokafka's `getmany`
raise, every time (gateway/kafka/salvage.py). The skeleton then settles the step and
reads the partitions leniently from their committed offsets (the salvage every loop
shares), and the step
quarantines such a record (`bad_header`, those headers dropped), after the records
before it, and the partition reads on after it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterable

from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener, TopicPartition

from gateway.errors import BadRecord
from gateway.kafka.completion import Completion
from gateway.kafka.exactly_once import StepAborted
from gateway.kafka.loop import Ask, ConsumerLoop
from gateway.kafka.salvage import Fetched
from gateway.metrics import Metrics
from gateway.raw.blocking import BlockedPartitions
from gateway.raw.checkpoint import Checkpoint
from gateway.raw.lanes import LaneScheduler
from gateway.raw.pipeline import Pipeline, Ready, Voting

logger = logging.getLogger(__name__)

FETCH_TIMEOUT_MS = 100  # how long an idle fetch waits: bounds the reaction to stop
STARVED_FETCH_MS = 50  # how long a starved lane's own fetch waits before the usual one
LAG_EVERY_S = 1.0


class RawSource:
    """The raw topics' loop step (`kafka.loop.Step`). Owns the blocked partitions and
    the lag gauges."""

    def __init__(
        self,
        consumer: AIOKafkaConsumer,
        pipeline: Pipeline,
        blocked: BlockedPartitions,
        metrics: Metrics,
        max_records: int,
        completion: Completion,
        lanes: LaneScheduler | None = None,
    ) -> None:
        self.consumer = consumer
        self.pipeline = pipeline
        self.blocked = blocked
        self.lanes = lanes
        self.metrics = metrics
        self.max_records = max_records
        self.checkpoint = Checkpoint(completion)
        self.claiming: Voting | None = None  # the batch whose ids are being claimed
        self.loop = ConsumerLoop(
            consumer, pipeline.settings.kafka, "raw", self,
            reread=metrics.records_reread.labels("rebalance").inc,
        )  # fmt: skip
        self.batches = 0
        self._lag_due = 0.0

    def listener(self) -> ConsumerRebalanceListener:
        # A revoke waits for the batches in hand: they are forwarded and committed
        # before the partitions move, so the next owner neither loses nor repeats them.
        return self.loop.listener("partitions", self._revoked, self._assigned)

    def _revoked(self, partitions: Iterable[TopicPartition]) -> None:
        self.forget(partitions)  # looked up at the revoke: a test may wrap `forget`

    async def settle(self) -> None:
        """Finish the batch being claimed and commit all handed out (under the lock)."""
        await self.hand_over(None)
        await self._drained()

    async def _drained(self) -> None:
        """`checkpoint.drain`, reading everything again when its transaction aborted."""
        try:
            await self.checkpoint.drain()
        except StepAborted:
            await self._read_again()

    async def _read_again(self) -> None:
        """A batch's transaction aborted (`ConsumerLoop.read_again`): the batch being
        claimed and any batch fetched meanwhile forward nothing (their records come
        again); the blocks stay."""
        await self.loop.read_again(self._drop_claiming)

    def _drop_claiming(self, assigned: set[TopicPartition]) -> None:
        if self.claiming is not None:
            self.claiming.dropped.update(self.claiming.parts)

    def _assigned(self) -> None:
        if self.lanes is not None:  # hold lanes before the first fetch brings them
            self.lanes.apply(self.consumer)

    async def run(self, stop: asyncio.Event) -> None:
        """Fetch, vote, forward, commit until `stop`; the batches in hand are finished first."""
        await self.loop.run(stop)

    async def ask(self, stop: asyncio.Event) -> Ask:
        """Resume the blocks that are due, then the lanes (a held lane stays paused); a
        starved lane's partitions are asked first. While a batch is being claimed, the
        fetch takes what is fetched already and does not wait."""
        self.blocked.resume_due(self.consumer)
        first = self.lanes.apply(self.consumer) if self.lanes is not None else []
        wait_ms = FETCH_TIMEOUT_MS if self.claiming is None else 0
        return Ask(wait_ms, self.max_records, tuple(first), STARVED_FETCH_MS)

    async def take(self, fetched: Fetched) -> set[TopicPartition]:
        """Under the loop's lock: start claiming the batch while the one before is
        finished; nothing fetched: finish the vote in hand, or, idle, wait for the last
        commit here, under the lock as every drain (a revoke's settle that found it
        taken began the next batch's transaction beside it: chaos seed 15001, "Invalid
        state transition IN_TRANSACTION")."""
        if fetched.salvaged:
            return await self._take_salvaged(fetched)
        if not fetched.records:
            if self.claiming is not None:
                await self.hand_over(None)
            else:
                await self._drained()
            return set()
        if self.lanes is not None:
            self.lanes.fetched(fetched.records.keys())
        voting = self.pipeline.begin(fetched.records)
        voting.member = fetched.member
        await self.hand_over(voting)
        return set()

    async def after(self, stop: asyncio.Event) -> None:
        await self._update_lag()

    async def drain(self) -> None:
        """At stop: the batches in hand forwarded and committed."""
        async with self.loop.lock:
            await self.hand_over(None)
            # An aborted transaction (counted): nothing of it committed, the next reader
            # replays it.
            with contextlib.suppress(StepAborted):
                await self.checkpoint.drain()

    async def hand_over(self, voting: Voting | None) -> None:
        """Finish the vote on the batch being claimed and hand it to the checkpoint;
        `voting` (its claims already sent) is claimed meanwhile and takes its place.
        Called with the loop's lock held."""
        done, self.claiming = self.claiming, voting
        if done is None:
            return
        ready = await self.pipeline.end(done)
        decided = ready.decided
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
            await self.checkpoint.then(self._finish(ready, done.started, size), done.member)
        except StepAborted:  # the batch before `done`: `done` is read again too
            await self._read_again()

    async def _take_salvaged(self, fetched: Fetched) -> set[TopicPartition]:
        """Records read leniently (gateway/kafka/salvage.py), as one batch: those with
        header names that are not UTF-8 quarantined, the others decided as usual.
        Returns the partitions that stop: blocked, or all after an aborted transaction."""
        started = time.perf_counter()
        bad = fetched.bad
        batch = {
            tp: good
            for tp, records in fetched.records.items()
            if (good := [r for r in records if r.offset not in bad.get(tp, {})])
        }
        ready = await self.pipeline.decide(batch)
        decided = ready.decided
        for tp, records in fetched.records.items():
            # Under `block`, records from the blocked one on wait for the partition to resume.
            until = decided.blocked.get(tp)
            dropped = bad.get(tp, {})
            for rec in records:
                if rec.offset in dropped and (until is None or rec.offset < until):
                    self.metrics.records_in.labels(tp.topic).inc()
                    reason = f"{dropped[rec.offset]} header name(s) not UTF-8, dropped"
                    decided.quarantine.append((rec, BadRecord("bad_header", reason)))
            # Everything before it is forwarded or quarantined: aiokafka could read
            # nothing more of that batch, so the partition reads on after it.
            decided.commits[tp] = fetched.next_offsets[tp] if until is None else until
        self.blocked.update(self.consumer, decided.blocked, fetched.records.keys())
        size = sum(map(len, fetched.records.values()))
        try:
            await self.checkpoint.then(self._finish(ready, started, size), fetched.member)
        except StepAborted:
            await self._read_again()
            return set(fetched.records)
        return set(decided.blocked)

    async def _finish(self, ready: Ready, started: float, size: int) -> dict[TopicPartition, int]:
        commits = await self.pipeline.finish(ready)
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
