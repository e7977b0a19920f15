"""Scheduled delivery: hold a decided-new record until its time, with the state in Kafka.

A producer asks for it with a header: `[delay] deliver_at_header` (epoch
milliseconds) or `deliver_after_header` (a duration such as `90s`, counted from
the raw record's timestamp, so a replay computes the same due time). The id is
claimed when the record arrives, like any other, so a copy arriving while the
first waits is a duplicate, and the record that waits is the first one.

- **Route** (the raw path, `Router`): a decided-new record that is due goes to
  the clean topic; one that is not goes to the largest tier not longer than the
  time it has left (the smallest tier when none is that short), with
  `dedup-deliver-at` (due) and `dedup-tier-at` (entry) headers and its other
  `dedup-*` headers as on the clean topic. Tiers are topics
  `<clean_topic>.delay.<tier>`, one fixed delay each (`[delay] tiers`).
- **Step rule.** A tier record takes its next step at
  min(entry + tier delay, due). The tier was chosen no longer than the time
  left, so that is entry + delay in every tier (arrival order is step order:
  the head of a tier partition steps first), except records with less than the
  smallest tier left, which step when due.
- **The delay loop** (`DelayLoop`, group `<group_id>.delay`) reads every tier,
  and the tier topics the configuration no longer names until they are empty
  (gateway/delay/leftovers.py). A coalesced record met with `[coalesce]` off is
  delivered when due (its window's close) as a plain delayed record.
  A record whose step is more than one smallest tier ahead stops its partition:
  seek to it, pause, resume when it comes within that lead (and at least every
  `PEEK_EVERY_MS`, which refreshes the high watermark). Nearer records are held
  in memory (bounded) and stepped on time: to the clean topic when due, else
  to the largest tier that fits the time left, else held until due.
- **Commit after the acknowledgement.** A tier offset is committed only when
  every record before it was moved and the broker acknowledged the move. A
  crash (or a restart) replays the uncommitted tier records. With `[kafka]
  exactly_once` on, a step's moves and its tier offsets are one transaction
  (gateway/kafka/exactly_once.py): a step killed before its commit was aborted, and a
  `read_committed` reader sees its moves once. The offset committed is the first not
  yet moved, so a record moved ahead of an earlier one still held is moved again
  after a restart; such a replayed move (and every one with `exactly_once` off)
  carries the same `dedup-id`, `dedup-source` and `dedup-token` as the first, which
  the Spark job drops.
- **Never early**: a record goes to the clean topic only once its due time has
  passed on the clock of the gateway that moves it.

Costs: each step is one produce and one commit per tier partition per loop
turn; a record makes at most about three moves per tier it passes through
(tiers 4x apart); memory holds at most `MAX_HELD` records (about the move rate
times twice the smallest tier).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener, TopicPartition

from gateway import faults
from gateway.config import Settings
from gateway.contract.records import (
    H_WINDOW,
    OutRecord,
    Record,
)
from gateway.delay.closing import WindowCloses
from gateway.delay.coalescer import Coalescer as Closer
from gateway.delay.coalescer import now_ms
from gateway.delay.held import Held, TierRecords, size_of
from gateway.kafka.completion import Completion
from gateway.kafka.due import DueQueue
from gateway.kafka.exactly_once import StepAborted
from gateway.kafka.loop import Ask, ConsumerLoop
from gateway.kafka.offsets import OffsetBook, PartitionOffsets, fetch_position
from gateway.kafka.salvage import Fetched
from gateway.kafka.transactions import Member
from gateway.metrics import Metrics
from gateway.rules.tiers import (
    Tiers,
    millis,
    pick_tier,
    replace_tier_at,
)

logger = logging.getLogger(__name__)

MAX_HELD = 20_000  # tier records held in memory at once; past it, partitions pause
MAX_HELD_BYTES = 64 * 1024 * 1024  # and their bytes (keys, values, headers)
PEEK_EVERY_MS = 10_000  # a paused tier partition is fetched again at least this often
STOP_DRAIN_MS = 5_000  # at stop, held records due for a step within this are moved first
FULL_RETRY_MS = 50  # memory full: how soon a partition paused for room is tried again
FETCH_TIMEOUT_MS = 100  # longest an idle fetch waits: bounds the reaction to stop
REPORT_EVERY_S = 1.0


@dataclass(slots=True)
class _Partition(PartitionOffsets):
    """What the loop took from one tier partition (`taken`: held in memory; `moved`:
    moved on and acknowledged) and has not yet committed."""

    resume_at_ms: int | None = None  # paused until then


class DelayLoop:
    """Reads the tier topics, moves each record on when its step comes (module docstring):
    a step on the consumer-loop skeleton (gateway/kafka/loop.py)."""

    def __init__(
        self,
        settings: Settings,
        consumer: AIOKafkaConsumer,
        completion: Completion,
        metrics: Metrics,
        closer: Closer | None = None,
        leftover: Mapping[str, int] | None = None,
    ) -> None:
        self.closer = closer
        self.completion = completion  # a step's moves, then (or with) its offsets
        self.fetched_as: Member = (-1, "", None)  # who the consumer was at the last fetch
        self.leftover = dict(leftover or {})  # tier topics no longer configured -> delay ms
        self.consumer = consumer
        self.sink = completion.sink
        self.metrics = metrics
        self.kafka = settings.kafka
        self.clean_topic = settings.kafka.clean_topic
        self.quarantine_topic = settings.kafka.quarantine_topic
        self.max_bytes = settings.kafka.max_request_bytes
        self.tiers = Tiers(settings)
        self.lead_ms = self.tiers.ms[0]
        self.max_delay_ms = millis(settings.delay.max_delay)
        self.records = TierRecords(
            self.tiers, self.leftover, self.max_delay_ms, closer is not None, metrics,
            self.max_bytes,
        )  # fmt: skip
        self.held: DueQueue[Held] = DueQueue()  # by next step
        self.closes = None if closer is None else WindowCloses(
            closer, self.records, self.tiers, self.held, metrics, self.clean_topic,
            self.quarantine_topic,
        )  # fmt: skip
        self.held_bytes = 0
        self.book: OffsetBook[_Partition] = OffsetBook(_Partition)
        self.loop = ConsumerLoop(
            consumer, settings.kafka, "delay tier", self, self.book.position, self.book.read_on
        )  # a step (move, ack, commit) holds its lock against a rebalance
        self._report_due = 0.0

    def listener(self) -> ConsumerRebalanceListener:
        # A revoke waits for a step in progress: its moves are acknowledged and committed first.
        return self.loop.listener("delay tier partitions", self.forget)

    async def run(self, stop: asyncio.Event) -> None:
        """Take, step and commit until `stop`; then `drain`."""
        await self.loop.run(stop)

    async def ask(self, stop: asyncio.Event) -> Ask:
        """Resume the partitions due; fetch no longer than until the first held step,
        no more than there is room for."""
        now = now_ms()
        self._resume(now)
        wait = FETCH_TIMEOUT_MS
        if (first := self.held.next_at()) is not None:
            wait = max(0, min(wait, int(first) - now))
        return Ask(wait, max(1, MAX_HELD - len(self.held)))

    async def take(self, fetched: Fetched) -> set[TopicPartition]:
        """Hold what is fetched (pausing where a step is further ahead), then step."""
        self.fetched_as = fetched.member
        now = now_ms()
        stopped = {
            tp
            for tp, records in fetched.records.items()
            if not self._take(tp, records, now, fetched.bad.get(tp))
        }
        await self._step(now_ms())
        return stopped

    async def settle(self) -> None:
        """Nothing to settle: a salvage reads on from where the offset book stands."""

    async def after(self, stop: asyncio.Event) -> None:
        self._report()

    async def drain(self) -> None:
        """Take nothing more; step the held records whose step comes within two
        smallest tiers (at most `STOP_DRAIN_MS`), so a restart repeats few moves."""
        self.consumer.pause(*self.consumer.assignment())
        deadline = now_ms() + min(STOP_DRAIN_MS, 2 * self.lead_ms)
        while (first := self.held.next_at()) is not None and first <= deadline:
            await asyncio.sleep(max(0, first - now_ms()) / 1000)  # its time
            async with self.loop.lock:
                await self._step(now_ms())

    def _full(self) -> bool:
        return len(self.held) >= MAX_HELD or self.held_bytes >= MAX_HELD_BYTES

    def _take(
        self,
        tp: TopicPartition,
        records: Sequence[Record],
        now: int,
        bad_headers: Mapping[int, int] | None = None,
    ) -> bool:
        """Hold the records whose step is within the lead; pause at the first that is not
        (False). `bad_headers`: offsets of records read leniently, with how many header
        names that are not UTF-8 were dropped from each (they are quarantined)."""
        if tp not in self.consumer.assignment():
            return False  # revoked while fetched: its new owner reads it from the commit
        part = self.book.of(tp)
        tier_ms = self.records.tier_ms(tp.topic)
        for rec in records:
            if self._full():
                self._pause(tp, part, rec.offset, now + FULL_RETRY_MS)
                return False
            if bad_headers and rec.offset in bad_headers:
                problem = f"{bad_headers[rec.offset]} header name(s) not UTF-8, dropped"
                held = Held(0, rec, 0, size_of(rec), f"bad_tier_record: {problem}")
            else:
                held = self.records.held(rec, tier_ms, now)
            if held.step_ms - now > self.lead_ms:
                resume = min(held.step_ms - self.lead_ms, now + PEEK_EVERY_MS)
                self._pause(tp, part, rec.offset, resume)
                return False
            self.held.push(held.step_ms, held)
            self.held_bytes += held.size
            part.take(rec.offset)
            part.next_offset = rec.offset + 1
        return True

    def _pause(self, tp: TopicPartition, part: _Partition, offset: int, until_ms: int) -> None:
        # Seek too: records of this partition already fetched stay buffered otherwise.
        self.consumer.seek(tp, offset)
        self.consumer.pause(tp)
        part.next_offset = offset
        part.resume_at_ms = until_ms

    def _resume(self, now: int) -> None:
        assigned = self.consumer.assignment()
        for tp, part in self.book.parts.items():
            due = part.resume_at_ms is not None and part.resume_at_ms <= now
            if due and tp in assigned and not self._full():
                self.consumer.resume(tp)
                part.resume_at_ms = None

    async def _step(self, now: int) -> None:
        """Move every held record whose step has come; commit after the acknowledgements."""
        moves: dict[str, list[OutRecord]] = defaultdict(list)
        stepped: list[Held] = []
        to_clean: list[Held] = []
        closing: list[Held] = []
        while (held := self.held.pop_due(now)) is not None:
            rec = held.record
            if held.problem is not None:
                moves[self.quarantine_topic].append(
                    self.records.quarantined(rec, held.problem, held.reason)
                )
            elif held.due_ms <= now and held.window:
                closing.append(held)  # its window's close is decided below
                continue
            elif held.due_ms <= now:
                moves[self.clean_topic].append(_copy(rec, tier_at_ms=None, window=False))
                to_clean.append(held)
            elif (tier := pick_tier(held.due_ms - now, self.tiers.ms)) is None:
                held.step_ms = held.due_ms  # less than any tier left: wait here
                self.held.push(held.step_ms, held)
                continue
            else:
                moves[self.tiers.topics[tier]].append(_copy(rec, tier_at_ms=now))
            stepped.append(held)
        emitted = []
        if closing:
            assert self.closes is not None  # records with a window are read only with one
            emitted = await self.closes.decide(closing, now, moves, stepped)
        if not stepped:
            return
        try:
            committed = await self.completion.complete(
                self._moved(moves, to_clean, emitted, stepped), self.fetched_as
            )
        except StepAborted:
            await self._read_again()
            return
        if committed is not None:
            self.book.committed(committed)

    async def _moved(
        self,
        moves: dict[str, list[OutRecord]],
        to_clean: list[Held],
        emitted: list[int],
        stepped: list[Held],
    ) -> dict[TopicPartition, int]:
        await self._move(moves, to_clean, emitted, stepped)
        faults.reached("delay-acked")
        # A partition that moved on: its new owner replays the moves (same tokens).
        return self.completion.step_offsets(self.book, self.consumer)

    async def _read_again(self) -> None:
        """A step's transaction aborted (`ConsumerLoop.read_again`): everything taken is
        dropped, and the partitions paused for it resumed."""
        assigned = self.consumer.assignment()
        await self.loop.read_again(self.forget)
        self.consumer.resume(*(self.consumer.assignment() & assigned))  # not one revoked since

    async def _move(
        self,
        moves: dict[str, list[OutRecord]],
        to_clean: list[Held],
        emitted: list[int],
        stepped: list[Held],
    ) -> None:
        """Send the step's copies, wait for the acknowledgements, mark them moved."""
        await asyncio.gather(*(self.sink.deliver(topic, recs) for topic, recs in moves.items()))
        acked = now_ms()
        for held in to_clean:
            self.metrics.delay_lateness.observe((acked - held.due_ms) / 1000)
        for close_ms in emitted:
            self.metrics.coalesce_lateness.observe((acked - close_ms) / 1000)
        for topic, recs in moves.items():
            if (tier := self.tiers.by_topic.get(topic)) is not None:
                self.metrics.delayed.labels(self.tiers.labels[tier]).inc(len(recs))
        for held in stepped:
            self.held_bytes -= held.size
            part = self.book.parts.get(TopicPartition(held.record.topic, held.record.partition))
            if part is not None:
                part.moved.add(held.record.offset)

    def _report(self) -> None:
        """Held records, and the backlog per tier (`waiting`)."""
        now = time.monotonic()
        if now < self._report_due:
            return
        self._report_due = now + REPORT_EVERY_S
        self.metrics.delay_held.set(len(self.held))
        backlog = dict.fromkeys([*self.tiers.labels, *self.leftover], 0)
        for tp in self.consumer.assignment():
            part = self.book.parts.get(tp)
            backlog[self.records.label(tp.topic)] += waiting(part, self.consumer, tp)
        for label, records in backlog.items():
            self.metrics.delay_backlog.labels(label).set(records)

    def forget(self, partitions: Iterable[TopicPartition]) -> None:
        """Revoked partitions: drop what was taken from them (the new owner replays it)."""
        gone = set(partitions)
        self.book.forget(gone)
        dropped = self.held.drop(lambda h: (h.record.topic, h.record.partition) in gone)
        self.held_bytes -= sum(h.size for h in dropped)


def waiting(part: _Partition | None, consumer: AIOKafkaConsumer, tp: TopicPartition) -> int:
    """Records of `tp` not yet moved on: those read after the commit point (taken,
    in memory or moved behind one that is not), and the offsets not yet read up
    to the fetch-response high watermark. Data records only where the loop has
    read: with `exactly_once` a transaction's commit marker takes an offset after
    its records, which the commit point stays before, and a drained tier shows 0,
    not 1 (offsets not read yet may hold markers too)."""
    high: int | None = consumer.highwater(tp)
    if part is None or high is None or part.commit_point() is None:
        return 0
    read_to = max(
        (at for at in (part.next_offset, fetch_position(consumer, tp)) if at is not None),
        default=high,
    )
    return len(part.taken) + max(0, high - read_to)


def _copy(rec: Record, tier_at_ms: int | None, window: bool = True) -> OutRecord:
    """A tier record's next copy: key, value, raw timestamp and headers kept; the tier
    entry time replaced (another tier) or dropped (the clean topic). `window=False`:
    without `dedup-window` (a coalesced record delivered unclosed, coalescing off)."""
    headers = replace_tier_at(rec.headers, tier_at_ms)
    if not window:
        headers = [(k, v) for k, v in headers if k != H_WINDOW]
    return OutRecord(rec.key, rec.value, rec.timestamp, headers, rec.partition)
