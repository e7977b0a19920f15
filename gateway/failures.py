"""The failure loop: release commands from the Spark job, retries, dead letters.

A command (failure topic; key = id, value = JSON with `id`, `token`, `reason`,
`source` {topic, partition, offset}, optional `attempt` and `reasons`) says
processing of one clean record failed. Per `[failures] mode`:

- `release` (the patent): delete the id's mark where it still holds `token`
  (compare-and-delete on every instance; released when a majority did). The
  next copy the producer sends is then new.
- `retry` (default): hand the mark over from the failed attempt's token to the
  next attempt's, then, after a backoff that doubles per attempt, fetch the raw
  record by its coordinates and forward it again with `dedup-attempt` + 1.
  After `max_attempts` the record goes to the dead-letter topic instead and the
  mark is handed to a dead-letter token, so producer resends stay duplicates.

Commands are consumed at least once and their effects are idempotent: the
handover notes which command delivery made it, so a crash replay of that
delivery redoes the effect (at most one extra copy of the retry), while another
copy of the command, or a command whose token is stale, changes nothing.
Offsets are committed only once a command's effect is acknowledged.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TypeAlias

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRecord, TopicPartition
from aiokafka.errors import CommitFailedError, OffsetOutOfRangeError

from gateway.config import Settings
from gateway.ids import BadRecord, build_extractor
from gateway.keys import dead_token, mark_digest, owner_token, source_ref
from gateway.metrics import Metrics
from gateway.pipeline import H_ATTEMPT, clean_headers
from gateway.quorum import Quorum
from gateway.sink import OutRecord, Sink

logger = logging.getLogger(__name__)

Record: TypeAlias = ConsumerRecord[bytes, bytes]
H_REASON, H_REASONS = "dedup-reason", "dedup-reasons"
KEEP_REASONS = 5  # reasons carried on retried and dead-lettered records
MAX_PENDING = 10_000  # scheduled retries held in memory before fetching pauses
FETCH_TIMEOUT_MS = 200


class InvalidCommand(ValueError):
    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


@dataclass(frozen=True)
class Command:
    id: str
    token: str
    reason: str
    topic: str
    partition: int
    offset: int
    attempt: int
    reasons: tuple[str, ...]
    ref: str  # failure-topic coordinates of this delivery

    @property
    def history(self) -> list[str]:
        return [*self.reasons, self.reason][-KEEP_REASONS:]


def parse_command(rec: Record) -> Command:
    """Validate one failure-topic record; raise InvalidCommand with a reason code."""
    try:
        body = json.loads(rec.value or b"")
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidCommand("not_json", str(exc)) from None
    if not isinstance(body, dict):
        raise InvalidCommand("not_object", "command is not a JSON object")
    source = body.get("source")
    try:
        message_id, token = body["id"], body["token"]
        topic, partition, offset = source["topic"], source["partition"], source["offset"]  # type: ignore[index]
    except (KeyError, TypeError):
        raise InvalidCommand(
            "missing_field", "needs id, token, source.topic/partition/offset"
        ) from None
    attempt = body.get("attempt", 1)
    reasons = body.get("reasons", [])
    checks = [
        isinstance(message_id, str) and message_id != "",
        isinstance(token, str) and token.isdigit(),
        isinstance(topic, str) and topic != "",
        isinstance(partition, int) and partition >= 0,
        isinstance(offset, int) and offset >= 0,
        isinstance(attempt, int) and attempt >= 1,
        isinstance(reasons, list) and all(isinstance(r, str) for r in reasons),
    ]
    if not all(checks):
        raise InvalidCommand("bad_field", f"a field has the wrong type or value: {body!r:.200}")
    return Command(
        id=message_id,
        token=token,
        reason=str(body.get("reason", "")),
        topic=topic,
        partition=partition,
        offset=offset,
        attempt=attempt,
        reasons=tuple(reasons),
        ref=source_ref(rec.topic, rec.partition, rec.offset),
    )


class RawFetcher:
    """Reads single raw records back by coordinates (no group; retries are rare)."""

    def __init__(self, consumer: AIOKafkaConsumer) -> None:
        self.consumer = consumer

    async def fetch(self, topic: str, partition: int, offset: int) -> Record | None:
        """The record at that offset, or None when retention or compaction removed it."""
        tp = TopicPartition(topic, partition)
        if tp not in self.consumer.assignment():
            self.consumer.assign([*self.consumer.assignment(), tp])
        self.consumer.seek(tp, offset)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                batch = await self.consumer.getmany(tp, timeout_ms=FETCH_TIMEOUT_MS, max_records=1)
            except OffsetOutOfRangeError:
                return None
            for rec in batch.get(tp, []):
                return rec if rec.offset == offset else None  # compacted: the next one came
            high = self.consumer.highwater(tp)
            if high is not None and high <= offset:
                return None  # nothing at or after that offset (deleted topic data)
        return None


@dataclass(order=True)
class _Due:
    at: float
    seq: int
    command: Command = field(compare=False)
    tp: TopicPartition = field(compare=False)
    offset: int = field(compare=False)
    dead: bool = field(compare=False)


class FailureLoop:
    def __init__(
        self, settings: Settings, quorum: Quorum, producer: AIOKafkaProducer, metrics: Metrics
    ) -> None:
        self.settings = settings
        self.failures = settings.failures
        self.quorum = quorum
        self.sink = Sink(producer)
        self.metrics = metrics
        self.extract = build_extractor(settings.dedup.id, settings.dedup.max_id_bytes)
        self.due: list[_Due] = []
        self.pending: dict[TopicPartition, set[int]] = {}
        self.next_offset: dict[TopicPartition, int] = {}
        self._seq = 0

    async def run(
        self, commands: AIOKafkaConsumer, fetcher: RawFetcher, stop: asyncio.Event
    ) -> None:
        while not stop.is_set():
            await self._run_due(fetcher, stop)
            if len(self.due) >= MAX_PENDING:
                await asyncio.sleep(FETCH_TIMEOUT_MS / 1000)  # let scheduled retries drain first
                continue
            batch = await commands.getmany(timeout_ms=FETCH_TIMEOUT_MS, max_records=500)
            for tp, records in batch.items():
                rewind = await self.handle(tp, records)
                if rewind is not None:  # no majority: retry this command later
                    commands.seek(tp, rewind)
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(
                            stop.wait(), self.failures.backoff_initial.total_seconds()
                        )
            await self._commit(commands)

    async def handle(self, tp: TopicPartition, records: Sequence[Record]) -> int | None:
        """Act on one partition's commands in order; the offset to rewind to, if undecided."""
        valid: list[tuple[Record, Command]] = []
        for rec in records:
            try:
                valid.append((rec, parse_command(rec)))
            except InvalidCommand as exc:
                self._invalid(rec, exc.reason, str(exc))
        self.next_offset[tp] = records[-1].offset + 1
        if not valid:
            return None
        if self.failures.mode == "release":
            return await self._release(tp, valid)
        return await self._hand_over(tp, valid)

    async def _release(self, tp: TopicPartition, valid: list[tuple[Record, Command]]) -> int | None:
        digests = [mark_digest(c.id.encode()) for _, c in valid]
        replies = await self.quorum.release(digests, [c.token for _, c in valid])
        for j, (rec, cmd) in enumerate(valid):
            answers = [r[j] for r in replies if r is not None]
            if sum(answers) >= self.quorum.majority:
                self.metrics.releases.labels("released").inc()
                logger.info("released %s (%s): %s", cmd.id, cmd.ref, cmd.reason)
            elif len(answers) - sum(answers) >= self.quorum.majority:
                self.metrics.releases.labels("stale").inc()
                logger.info("stale release for %s (%s): token no longer holds", cmd.id, cmd.ref)
            else:
                self.metrics.releases.labels("no_quorum").inc()
                rewind: int = rec.offset
                self.next_offset[tp] = rewind
                return rewind
        return None

    async def _hand_over(
        self, tp: TopicPartition, valid: list[tuple[Record, Command]]
    ) -> int | None:
        marks = []
        for _, cmd in valid:
            dead = cmd.attempt >= self.failures.max_attempts
            nxt = (
                dead_token(cmd.topic, cmd.partition, cmd.offset)
                if dead
                else owner_token(cmd.topic, cmd.partition, cmd.offset, cmd.attempt + 1)
            )
            marks.append((mark_digest(cmd.id.encode()), cmd.token, nxt, cmd.ref))
        replies = await self.quorum.handover(marks)
        now = time.monotonic()
        for j, (rec, cmd) in enumerate(valid):
            answers = [r[j] for r in replies if r is not None]
            act = sum(1 for a in answers if a in (1, 2))
            skip = len(answers) - act
            if act >= self.quorum.majority:
                self.metrics.releases.labels("released").inc()
                dead = cmd.attempt >= self.failures.max_attempts
                delay = 0.0 if dead else self._backoff(cmd.attempt)
                self._schedule(_Due(now + delay, self._next_seq(), cmd, tp, rec.offset, dead))
            elif skip >= self.quorum.majority:
                self.metrics.releases.labels("stale").inc()
                logger.info("stale or repeated command for %s (%s): skipped", cmd.id, cmd.ref)
            else:
                self.metrics.releases.labels("no_quorum").inc()
                rewind: int = rec.offset
                self.next_offset[tp] = rewind
                return rewind
        return None

    def _backoff(self, attempt: int) -> float:
        initial = self.failures.backoff_initial.total_seconds()
        return float(min(initial * 2 ** (attempt - 1), self.failures.backoff_max.total_seconds()))

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _schedule(self, due: _Due) -> None:
        heapq.heappush(self.due, due)
        self.pending.setdefault(due.tp, set()).add(due.offset)

    async def _run_due(self, fetcher: RawFetcher, stop: asyncio.Event) -> None:
        while self.due and self.due[0].at <= time.monotonic() and not stop.is_set():
            due = heapq.heappop(self.due)
            if await self._redo(due, fetcher):
                cmd = due.command
                await self.quorum.mark_done([mark_digest(cmd.id.encode())], [cmd.ref])
            self.pending[due.tp].discard(due.offset)

    async def _redo(self, due: _Due, fetcher: RawFetcher) -> bool:
        """Forward the retry or the dead letter; False when the command was invalid."""
        cmd = due.command
        raw = await fetcher.fetch(cmd.topic, cmd.partition, cmd.offset)
        if raw is None:
            self._invalid(
                None,
                "raw_record_gone",
                f"{cmd.ref}: no raw record at {source_ref(cmd.topic, cmd.partition, cmd.offset)}",
            )
            return False
        try:
            raw_id = self.extract(raw).decode(errors="replace")
        except BadRecord:
            raw_id = None
        if raw_id != cmd.id:
            self._invalid(
                None, "id_mismatch", f"{cmd.ref}: raw record has id {raw_id!r}, not {cmd.id!r}"
            )
            return False
        reasons = json.dumps(cmd.history).encode()
        if due.dead:
            headers = clean_headers(
                raw,
                raw_id.encode(),
                dead_token(raw.topic, raw.partition, raw.offset),
                [
                    (H_ATTEMPT, str(cmd.attempt).encode()),
                    (H_REASON, cmd.reason.encode()),
                    (H_REASONS, reasons),
                ],
            )
            await self._deliver(self.settings.kafka.dead_letter_topic, raw, headers)
            self.metrics.dead_lettered.inc()
            logger.warning(
                "dead-lettered %s (%s) after %d attempts: %s",
                cmd.id,
                source_ref(raw.topic, raw.partition, raw.offset),
                cmd.attempt,
                cmd.reason,
            )
            return True
        attempt = cmd.attempt + 1
        token = owner_token(raw.topic, raw.partition, raw.offset, attempt)
        headers = clean_headers(
            raw, raw_id.encode(), token, [(H_ATTEMPT, str(attempt).encode()), (H_REASONS, reasons)]
        )
        await self._deliver(self.settings.kafka.clean_topic, raw, headers)
        self.metrics.retries.labels(str(attempt)).inc()
        return True

    async def _deliver(self, topic: str, raw: Record, headers: list[tuple[str, bytes]]) -> None:
        out = OutRecord(raw.key, raw.value, raw.timestamp, headers, raw.partition)
        for fut in await self.sink.send(topic, [out]):
            await fut

    async def _commit(self, commands: AIOKafkaConsumer) -> None:
        """Commit up to the oldest command whose effect is still scheduled."""
        offsets = {}
        for tp, nxt in self.next_offset.items():
            waiting = self.pending.get(tp)
            offsets[tp] = min(waiting) if waiting else nxt
        if offsets:
            try:
                await commands.commit(offsets)
            except CommitFailedError as exc:
                logger.warning("failure-topic commit failed after a rebalance: %s", exc)

    def forget(self, partitions: set[TopicPartition]) -> None:
        """Revoked command partitions: their scheduled effects go with them (the new
        owner replays the uncommitted commands and redoes them)."""
        self.due = [d for d in self.due if d.tp not in partitions]
        heapq.heapify(self.due)
        for tp in partitions:
            self.pending.pop(tp, None)
            self.next_offset.pop(tp, None)

    def _invalid(self, rec: Record | None, reason: str, detail: str) -> None:
        self.metrics.invalid_commands.labels(reason).inc()
        where = f" at {source_ref(rec.topic, rec.partition, rec.offset)}" if rec is not None else ""
        logger.warning("invalid failure command%s skipped: %s", where, detail)
