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
- **The delay loop** (`DelayLoop`, group `<group_id>.delay`) reads every tier.
  A record whose step is more than one smallest tier ahead stops its partition:
  seek to it, pause, resume when it comes within that lead (and at least every
  `PEEK_EVERY_MS`, which refreshes the high watermark). Nearer records are held
  in memory (bounded) and stepped on time: to the clean topic when due, else
  to the largest tier that fits the time left, else held until due.
- **Commit after the acknowledgement.** A tier offset is committed only when
  every record before it was moved and the broker acknowledged the move. A
  crash (or a restart) replays the uncommitted tier records; a replayed move
  carries the same `dedup-id`, `dedup-source` and `dedup-token` as the first
  one, which the Spark job drops (by `dedup-id`, `dedup-attempt`).
- **Never early**: a record goes to the clean topic only once its due time has
  passed on the clock of the gateway that moves it.

Costs: each step is one produce and one commit per tier partition per loop
turn; a record makes at most about three moves per tier it passes through
(tiers 4x apart); memory holds at most `MAX_HELD` records (about the move rate
times twice the smallest tier).
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import logging
import re
import time
from bisect import bisect_right
from collections import defaultdict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRebalanceListener, TopicPartition
from aiokafka.errors import CommitFailedError, IllegalStateError

from gateway.coalesce import WINDOW_EXPIRED, Verdict, now_ms
from gateway.coalesce import Coalescer as Closer
from gateway.config import ConfigError, Settings, parse_duration
from gateway.errors import BadRecord
from gateway.ids import IdExtractor
from gateway.kafka import build_consumer, partitions_of, stop_within, unless_stopped
from gateway.metrics import Metrics
from gateway.progress import Progress
from gateway.records import (
    H_DELIVER_AT,
    H_ID,
    H_SOURCE,
    H_TIER_AT,
    H_WINDOW,
    Headers,
    OutRecord,
    OutRow,
    Record,
    quarantine_record,
    source_ref,
)
from gateway.sink import Sink

logger = logging.getLogger(__name__)

MAX_HELD = 20_000  # tier records held in memory at once; past it, partitions pause
MAX_HELD_BYTES = 64 * 1024 * 1024  # and their bytes (keys, values, headers)
PEEK_EVERY_MS = 10_000  # a paused tier partition is fetched again at least this often
STOP_DRAIN_MS = 5_000  # at stop, held records due for a step within this are moved first
FULL_RETRY_MS = 50  # memory full: how soon a partition paused for room is tried again
FETCH_TIMEOUT_MS = 100  # longest an idle fetch waits: bounds the reaction to stop
REPORT_EVERY_S = 1.0
SCAN_LIMIT = 1_000_000  # `inspect`: most tier records read looking for an id
SCAN_TIMEOUT_S = 60.0

_EPOCH_MS = re.compile(rb"\d{1,15}")  # up to year 33658: larger is not a time
_MAX_DURATION_CHARS = 32


def millis(duration: timedelta) -> int:
    return duration // timedelta(milliseconds=1)


def tier_label(tier: timedelta) -> str:
    """The tier's name in its topic: the largest unit that divides it (`1s`, `16m`, `250ms`)."""
    ms = millis(tier)
    for unit, size in (("d", 86_400_000), ("h", 3_600_000), ("m", 60_000), ("s", 1000)):
        if ms % size == 0:
            return f"{ms // size}{unit}"
    return f"{ms}ms"


def tier_topic(clean_topic: str, tier: timedelta) -> str:
    return f"{clean_topic}.delay.{tier_label(tier)}"


def tier_topics(settings: Settings) -> list[str]:
    """The topics `[delay] tiers` needs, smallest tier first (they must exist)."""
    return [tier_topic(settings.kafka.clean_topic, t) for t in settings.delay.tiers]


def pick_tier(remaining_ms: int, tiers_ms: Sequence[int]) -> int | None:
    """Index of the largest tier not longer than `remaining_ms`; None when none is."""
    index = bisect_right(tiers_ms, remaining_ms) - 1
    return index if index >= 0 else None


def next_step_ms(tier_at_ms: int, tier_ms: int, due_ms: int) -> int:
    """When a tier record takes its next step: its tier's delay after entry, or due."""
    return min(tier_at_ms + tier_ms, due_ms)


def requested_due(
    headers: Headers, timestamp_ms: int, at_name: str, after_name: str, max_delay_ms: int
) -> int | None:
    """The due time (epoch ms) a raw record's headers ask for; None when they ask none.

    `deliver-at` is epoch milliseconds; `deliver-after` a duration with a unit
    (`parse_duration`) from `timestamp_ms`. Raises BadRecord (`bad_deliver_at`,
    `bad_deliver_after`, `conflicting_delay`, `delay_too_long`: due more than
    `max_delay_ms` after the timestamp). The first header of each name counts.
    """
    at = after = None
    for key, value in headers:
        if key == at_name and at is None:
            at = value or b""
        elif key == after_name and after is None:
            after = value or b""
    if at is None and after is None:
        return None
    if at is not None and after is not None:
        raise BadRecord("conflicting_delay", f"both {at_name!r} and {after_name!r} headers")
    if at is not None:
        if not _EPOCH_MS.fullmatch(at):
            raise BadRecord("bad_deliver_at", f"{at_name!r} is not epoch milliseconds: {at!r:.80}")
        due = int(at)
    else:
        assert after is not None
        try:
            if len(after) > _MAX_DURATION_CHARS:
                raise ValueError("too long")
            due = timestamp_ms + millis(parse_duration(after.decode("ascii")))
        except (ValueError, OverflowError) as exc:  # UnicodeDecodeError is a ValueError
            raise BadRecord(
                "bad_deliver_after", f"{after_name!r} is not a duration like '90s': {after!r:.80}"
            ) from exc
    if due - timestamp_ms > max_delay_ms:
        raise BadRecord(
            "delay_too_long",
            f"due {(due - timestamp_ms) / 1000:.0f}s after the record's timestamp; "
            f"[delay] max_delay is {max_delay_ms / 1000:.0f}s",
        )
    return due


def _int_header(headers: Headers, name: str) -> int:
    for key, value in headers:
        if key == name:
            if value is None or not _EPOCH_MS.fullmatch(value):
                raise ValueError(f"{name} is not epoch milliseconds: {value!r:.40}")
            return int(value)
    raise ValueError(f"no {name} header")


def _replace_tier_at(headers: Headers, tier_at_ms: int | None) -> list[tuple[str, bytes]]:
    """`headers` without `dedup-tier-at`, plus a new one when `tier_at_ms` is given."""
    kept = [(k, v) for k, v in headers if k != H_TIER_AT]
    if tier_at_ms is not None:
        kept.append((H_TIER_AT, str(tier_at_ms).encode()))
    return kept


class Tiers:
    """The tier topics of one gateway: their names, delays and metric labels."""

    def __init__(self, settings: Settings) -> None:
        tiers = settings.delay.tiers
        self.ms = [millis(t) for t in tiers]
        self.labels = [tier_label(t) for t in tiers]
        self.topics = tier_topics(settings)
        self.by_topic = {topic: i for i, topic in enumerate(self.topics)}


class Router:
    """The raw path's side: refuse bad delay headers, send what is not yet due to a tier."""

    def __init__(self, settings: Settings, metrics: Metrics) -> None:
        delay = settings.delay
        self.at_name = delay.deliver_at_header
        self.after_name = delay.deliver_after_header
        self.max_delay_ms = millis(delay.max_delay)
        self.tiers = Tiers(settings)
        self.metrics = metrics

        for label in self.tiers.labels:  # every tier's series exists from the start
            metrics.delayed.labels(label)
            metrics.delay_backlog.labels(label).set(0)

    def due(self, headers: Headers, timestamp_ms: int | None) -> int | None:
        now = now_ms()
        base = timestamp_ms if timestamp_ms is not None and timestamp_ms >= 0 else now
        due = requested_due(headers, base, self.at_name, self.after_name, self.max_delay_ms)
        # A timestamp in the future (a producer's clock) must not stretch the wait past
        # the mark's life: the mark is written now. A replay is later, so it agrees.
        if due is not None and due - now > self.max_delay_ms:
            raise BadRecord(
                "delay_too_long",
                f"due {(due - now) / 1000:.0f}s from now (the record's timestamp is ahead of "
                f"this clock); [delay] max_delay is {self.max_delay_ms / 1000:.0f}s",
            )
        return due

    def checked(self, extract: IdExtractor) -> Callable[[Record], bytes]:
        """`extract`, also refusing (BadRecord) a record whose delay headers are bad, so it
        is quarantined before it claims its id."""

        def extract_checked(record: Record) -> bytes:
            message_id = extract(record)
            self.due(record.headers, record.timestamp)
            return message_id

        return extract_checked

    def route(
        self, records: Sequence[OutRow], closes: Sequence[int] | None = None
    ) -> tuple[list[OutRow], dict[str, list[OutRow]]]:
        """Split decided-new records: (due now, for the clean topic; per tier topic, the rest).

        Records that asked for a delay gain `dedup-deliver-at`; tier copies also
        `dedup-tier-at`. The headers were checked on the way in (`checked`).
        With `closes` (coalescing, gateway/coalesce.py), every record waits in a
        tier until its window's close at least: its close is decided there.
        """
        now = now_ms()
        clean: list[OutRow] = []
        delayed: dict[str, list[OutRow]] = defaultdict(list)
        for i, rec in enumerate(records):
            key, value, timestamp_ms, rec_headers, source_partition = rec
            due = self.due(rec_headers, timestamp_ms)
            if closes is not None:
                due = max(due or 0, closes[i])
            if due is None:
                clean.append(rec)
                continue
            headers = [*rec_headers, (H_DELIVER_AT, str(due).encode())]
            if due <= now and closes is None:
                clean.append((key, value, timestamp_ms, headers, source_partition))
                continue
            tier = pick_tier(due - now, self.tiers.ms) or 0  # shorter than all: the smallest
            headers.append((H_TIER_AT, str(now).encode()))
            delayed[self.tiers.topics[tier]].append(
                (key, value, timestamp_ms, headers, source_partition)
            )
        for topic, moved in delayed.items():
            self.metrics.delayed.labels(self.tiers.labels[self.tiers.by_topic[topic]]).inc(
                len(moved)
            )
        return clean, delayed


@dataclass(order=True, slots=True)
class _Held:
    """A tier record in memory until its next step."""

    step_ms: int
    seq: int
    record: Record = field(compare=False)
    due_ms: int = field(compare=False)
    size: int = field(compare=False)
    problem: str | None = field(compare=False, default=None)  # unreadable: quarantine it
    window: bool = field(compare=False, default=False)  # coalesced: its close is decided


@dataclass(slots=True)
class _Partition:
    """What the loop took from one tier partition and has not yet committed."""

    taken: deque[int] = field(default_factory=deque)  # offsets in memory, in order
    moved: set[int] = field(default_factory=set)  # moved, but behind one still taken
    next_offset: int | None = None  # first offset not taken
    committed: int | None = None
    resume_at_ms: int | None = None  # paused until then

    def commit_point(self) -> int | None:
        """The first offset not yet moved and acknowledged (what may be committed)."""
        while self.taken and self.taken[0] in self.moved:
            self.moved.discard(self.taken.popleft())
        return self.taken[0] if self.taken else self.next_offset


class DelayLoop:
    """Reads the tier topics, moves each record on when its step comes (module docstring)."""

    def __init__(
        self,
        settings: Settings,
        consumer: AIOKafkaConsumer,
        sink: Sink,
        metrics: Metrics,
        closer: Closer | None = None,
    ) -> None:
        self.closer = closer
        self.consumer = consumer
        self.sink = sink
        self.metrics = metrics
        self.clean_topic = settings.kafka.clean_topic
        self.quarantine_topic = settings.kafka.quarantine_topic
        self.max_bytes = settings.kafka.max_request_bytes
        self.tiers = Tiers(settings)
        self.lead_ms = self.tiers.ms[0]
        self.lock = asyncio.Lock()  # a step (move, ack, commit) against a rebalance
        self.held: list[_Held] = []  # a heap by next step
        self.held_bytes = 0
        self.parts: dict[TopicPartition, _Partition] = {}
        self._seq = 0
        self._report_due = 0.0

    def listener(self) -> ConsumerRebalanceListener:
        return _ForgetRevoked(self)

    async def run(self, stop: asyncio.Event) -> None:
        """Take, step and commit until `stop`; then `drain`."""
        consumer = self.consumer
        while not stop.is_set():
            now = now_ms()
            self._resume(now)
            wait = FETCH_TIMEOUT_MS
            if self.held:
                wait = max(0, min(wait, self.held[0].step_ms - now))
            room = max(1, MAX_HELD - len(self.held))
            fetched = await unless_stopped(
                consumer.getmany(timeout_ms=wait, max_records=room), stop
            )
            if fetched is None:
                break
            batch = fetched
            async with self.lock:
                now = now_ms()
                for tp, records in batch.items():
                    self._take(tp, records, now)
                await self._step(now_ms())
            self._report()
        await self.drain()

    async def drain(self) -> None:
        """Take nothing more; step the held records whose step comes within two
        smallest tiers (at most `STOP_DRAIN_MS`), so a restart repeats few moves."""
        self.consumer.pause(*self.consumer.assignment())
        deadline = now_ms() + min(STOP_DRAIN_MS, 2 * self.lead_ms)
        while self.held and self.held[0].step_ms <= deadline:
            await asyncio.sleep(max(0, self.held[0].step_ms - now_ms()) / 1000)  # its time
            async with self.lock:
                await self._step(now_ms())

    def _full(self) -> bool:
        return len(self.held) >= MAX_HELD or self.held_bytes >= MAX_HELD_BYTES

    def _take(self, tp: TopicPartition, records: Sequence[Record], now: int) -> None:
        """Hold the records whose step is within the lead; pause at the first that is not."""
        if tp not in self.consumer.assignment():
            return  # revoked while fetched: its new owner reads it from the commit
        part = self.parts.setdefault(tp, _Partition())
        tier_ms = self.tiers.ms[self.tiers.by_topic[tp.topic]]
        for rec in records:
            if self._full():
                self._pause(tp, part, rec.offset, now + FULL_RETRY_MS)
                return
            held = self._held(rec, tier_ms)
            if held.step_ms - now > self.lead_ms:
                resume = min(held.step_ms - self.lead_ms, now + PEEK_EVERY_MS)
                self._pause(tp, part, rec.offset, resume)
                return
            heapq.heappush(self.held, held)
            self.held_bytes += held.size
            part.taken.append(rec.offset)
            part.next_offset = rec.offset + 1

    def _held(self, rec: Record, tier_ms: int) -> _Held:
        self._seq += 1
        size = len(rec.key or b"") + len(rec.value or b"") + sum(len(v) for _, v in rec.headers)
        try:
            due = _int_header(rec.headers, H_DELIVER_AT)
            step = next_step_ms(_int_header(rec.headers, H_TIER_AT), tier_ms, due)
            window = any(k == H_WINDOW for k, _ in rec.headers)
            if window and self.closer is None:
                raise ValueError("a coalesced record, but [coalesce] is not enabled here")
        except ValueError as exc:
            # Not written by a gateway: set it aside now rather than stop the tier.
            return _Held(0, self._seq, rec, 0, size, f"bad_tier_record: {exc}")
        return _Held(step, self._seq, rec, due, size, window=window)

    def _pause(self, tp: TopicPartition, part: _Partition, offset: int, until_ms: int) -> None:
        # Seek too: records of this partition already fetched stay buffered otherwise.
        self.consumer.seek(tp, offset)
        self.consumer.pause(tp)
        part.next_offset = offset
        part.resume_at_ms = until_ms

    def _resume(self, now: int) -> None:
        assigned = self.consumer.assignment()
        for tp, part in self.parts.items():
            due = part.resume_at_ms is not None and part.resume_at_ms <= now
            if due and tp in assigned and not self._full():
                self.consumer.resume(tp)
                part.resume_at_ms = None

    async def _step(self, now: int) -> None:
        """Move every held record whose step has come; commit after the acknowledgements."""
        moves: dict[str, list[OutRecord]] = defaultdict(list)
        stepped: list[_Held] = []
        to_clean: list[_Held] = []
        closing: list[_Held] = []
        while self.held and self.held[0].step_ms <= now:
            held = heapq.heappop(self.held)
            rec = held.record
            if held.problem is not None:
                moves[self.quarantine_topic].append(self._quarantined(rec, held.problem))
            elif held.due_ms <= now and held.window:
                closing.append(held)  # its window's close is decided below
                continue
            elif held.due_ms <= now:
                moves[self.clean_topic].append(_copy(rec, tier_at_ms=None))
                to_clean.append(held)
            elif (tier := pick_tier(held.due_ms - now, self.tiers.ms)) is None:
                held.step_ms = held.due_ms  # less than any tier left: wait here
                heapq.heappush(self.held, held)
                continue
            else:
                moves[self.tiers.topics[tier]].append(_copy(rec, tier_at_ms=now))
            stepped.append(held)
        emitted = await self._close(closing, now, moves, stepped) if closing else []
        if not stepped:
            return
        await asyncio.gather(*(self._deliver(topic, recs) for topic, recs in moves.items()))
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
            part = self.parts.get(TopicPartition(held.record.topic, held.record.partition))
            if part is not None:
                part.moved.add(held.record.offset)
        await self._commit()

    async def _close(
        self,
        closing: list[_Held],
        now: int,
        moves: dict[str, list[OutRecord]],
        stepped: list[_Held],
    ) -> list[int]:
        """Decide the windows of due coalesced records (gateway/coalesce.py): the newest
        goes to the clean topic, the superseded are dropped, the rest wait again; one
        that cannot be decided (bad headers, its window's state gone) goes to
        quarantine alone. Returns the emitted windows' close times."""
        assert self.closer is not None  # records with a window are read only with one
        closings = await self.closer.close([h.record for h in closing])
        emitted = []
        for held, decided in zip(closing, closings, strict=True):
            rec = held.record
            if decided.verdict is Verdict.BAD:
                moves[self.quarantine_topic].append(self._quarantined(rec, decided.problem))
            elif decided.verdict is Verdict.LOST:
                moves[self.quarantine_topic].append(
                    self._quarantined(rec, WINDOW_EXPIRED, "window_expired")
                )
            elif decided.verdict is Verdict.EMIT:
                headers = self.closer.emitted(_replace_tier_at(rec.headers, None), decided)
                moves[self.clean_topic].append(
                    OutRecord(rec.key, rec.value, rec.timestamp, headers, rec.partition)
                )
                emitted.append(decided.closed_ms)
                self.metrics.coalesce_emitted.inc()
            elif decided.verdict is Verdict.DROP:
                self.metrics.coalesce_merged.inc()
            elif (
                decided.verdict is Verdict.WAIT
                and (tier := pick_tier(decided.close_ms - now, self.tiers.ms)) is not None
            ):  # extended by a later update: back to a tier until then
                headers = [(k, v) for k, v in rec.headers if k != H_DELIVER_AT]
                headers.append((H_DELIVER_AT, str(decided.close_ms).encode()))
                moves[self.tiers.topics[tier]].append(
                    OutRecord(rec.key, rec.value, rec.timestamp,
                              _replace_tier_at(headers, now), rec.partition)
                )  # fmt: skip
            else:  # soon, or no majority answered: held here until then
                held.due_ms = held.step_ms = decided.close_ms
                heapq.heappush(self.held, held)
                continue
            stepped.append(held)
        return emitted

    async def _deliver(self, topic: str, records: Sequence[OutRecord]) -> None:
        futures: list[asyncio.Future[Any]] = await self.sink.send(topic, records)
        await asyncio.gather(*futures)

    async def _commit(self) -> None:
        assigned = self.consumer.assignment()
        offsets = {}
        for tp, part in self.parts.items():
            point = part.commit_point()
            if tp in assigned and point is not None and point != part.committed:
                offsets[tp] = point
        if not offsets:
            return
        try:
            await self.consumer.commit(offsets)
        except (CommitFailedError, IllegalStateError) as exc:
            # The partitions moved on; their new owner replays the moves (same tokens).
            logger.warning("delay tier commit failed after a rebalance: %s", exc)
            return
        for tp, point in offsets.items():
            self.parts[tp].committed = point

    def _quarantined(self, rec: Record, problem: str, reason: str = "bad_tier_record") -> OutRecord:
        self.metrics.quarantined.labels(reason).inc()
        logger.warning(
            "quarantined tier record %s: %s", source_ref(rec.topic, rec.partition, rec.offset),
            problem, extra={"topic": rec.topic, "partition": rec.partition, "offset": rec.offset},
        )  # fmt: skip
        return quarantine_record(rec, problem, self.max_bytes)

    def _report(self) -> None:
        """Held records, and the backlog per tier from the fetch-response high watermark."""
        now = time.monotonic()
        if now < self._report_due:
            return
        self._report_due = now + REPORT_EVERY_S
        self.metrics.delay_held.set(len(self.held))
        backlog = dict.fromkeys(self.tiers.labels, 0)
        for tp in self.consumer.assignment():
            part = self.parts.get(tp)
            high = self.consumer.highwater(tp)
            point = part.commit_point() if part is not None else None
            if high is not None and point is not None:
                backlog[self.tiers.labels[self.tiers.by_topic[tp.topic]]] += max(0, high - point)
        for label, records in backlog.items():
            self.metrics.delay_backlog.labels(label).set(records)

    def forget(self, partitions: Iterable[TopicPartition]) -> None:
        """Revoked partitions: drop what was taken from them (the new owner replays it)."""
        gone = set(partitions)
        for tp in gone:
            self.parts.pop(tp, None)
        kept = [h for h in self.held if (h.record.topic, h.record.partition) not in gone]
        self.held_bytes -= sum(h.size for h in self.held) - sum(h.size for h in kept)
        heapq.heapify(kept)
        self.held = kept


def _copy(rec: Record, tier_at_ms: int | None) -> OutRecord:
    """A tier record's next copy: key, value, raw timestamp and headers kept; the tier
    entry time replaced (another tier) or dropped (the clean topic)."""
    headers = _replace_tier_at(rec.headers, tier_at_ms)
    return OutRecord(rec.key, rec.value, rec.timestamp, headers, rec.partition)


class _ForgetRevoked(ConsumerRebalanceListener):  # type: ignore[misc]
    def __init__(self, loop: DelayLoop) -> None:
        self.loop = loop

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        # Wait for a step in progress: its moves are acknowledged and committed first.
        async with self.loop.lock:
            self.loop.forget(revoked)

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        if assigned:
            logger.info("delay tier partitions assigned: %s", sorted(map(str, assigned)))


async def start_delay_loop(
    settings: Settings,
    producer: AIOKafkaProducer,
    metrics: Metrics,
    stack: contextlib.AsyncExitStack,
    closer: Closer | None = None,
) -> DelayLoop:
    """Join `<group_id>.delay` on the tier topics; ConfigError naming any that is missing.
    `closer` decides the close of coalesced records (gateway/coalesce.py).

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
    loop = DelayLoop(settings, consumer, Sink(producer, kafka, metrics), metrics, closer)
    consumer.subscribe(topics, listener=loop.listener())
    logger.info("scheduled delivery: tiers %s, group %s.delay", ", ".join(topics), kafka.group_id)
    return loop


@dataclass(frozen=True)
class Waiting:
    """One tier copy of an id that has not been moved on (what `inspect` shows)."""

    topic: str
    partition: int
    offset: int
    tier: str
    due_ms: int
    tier_at_ms: int
    step_ms: int
    source: str  # the raw record's coordinates (dedup-source)


@dataclass
class Scan:
    waiting: list[Waiting]
    scanned: int  # tier records read
    complete: bool  # False: stopped at SCAN_LIMIT or SCAN_TIMEOUT_S


async def find_waiting(
    settings: Settings, message_id: bytes, progress: Progress | None = None
) -> Scan:
    """The uncommitted tier records of `message_id`: a read of every tier partition from
    the delay group's commit to its high watermark (what waits), bounded by SCAN_LIMIT;
    `progress` counts the records read."""
    kafka = settings.kafka
    tiers = Tiers(settings)
    # Names the group to read its commits; only assigns, so it never joins it.
    consumer = build_consumer(kafka, f"{kafka.group_id}.delay")
    await consumer.start()
    scan = Scan([], 0, True)
    try:
        tps = []
        for topic in tiers.topics:
            try:
                tps += [TopicPartition(topic, p) for p in await partitions_of(consumer, topic)]
            except TimeoutError as exc:
                raise ConfigError(f"delay.tiers: {exc}") from None
        consumer.assign(tps)
        for tp in tps:
            committed = await consumer.committed(tp)
            if committed is not None:
                consumer.seek(tp, committed)
        deadline = time.monotonic() + SCAN_TIMEOUT_S
        while True:
            batch = await consumer.getmany(timeout_ms=200)
            for tp, records in batch.items():
                scan.scanned += len(records)
                if progress is not None:
                    progress.advance(len(records))
                tier = tiers.by_topic[tp.topic]
                scan.waiting.extend(
                    _waiting(rec, tiers.labels[tier], tiers.ms[tier])
                    for rec in records
                    if dict(rec.headers).get(H_ID) == message_id
                )
            if await _all_read(consumer, tps):
                return scan
            if scan.scanned >= SCAN_LIMIT or time.monotonic() > deadline:
                scan.complete = False
                return scan
    finally:
        await consumer.stop()


def _waiting(rec: Record, tier: str, tier_ms: int) -> Waiting:
    """What `inspect` shows of a tier copy (an unreadable time shows as 0)."""
    times = []
    for name in (H_DELIVER_AT, H_TIER_AT):
        try:
            times.append(_int_header(rec.headers, name))
        except ValueError:
            times.append(0)
    due, tier_at = times
    source = dict(rec.headers).get(H_SOURCE) or b""
    return Waiting(
        rec.topic, rec.partition, rec.offset, tier, due, tier_at,
        next_step_ms(tier_at, tier_ms, due), source.decode("utf-8", "replace"),
    )  # fmt: skip


async def _all_read(consumer: AIOKafkaConsumer, tps: Sequence[TopicPartition]) -> bool:
    """Every partition read up to its fetch-response high watermark (never ListOffsets)."""
    for tp in tps:
        high = consumer.highwater(tp)
        if high is None or await consumer.position(tp) < high:
            return False
    return True
