"""The failure loop: release commands from the Spark job, retries, dead letters.

A command (failure topic; key = id, value = JSON with `id`, `token`, `reason`,
`source` {topic, partition, offset}, optional `attempt` and `reasons`) says
processing of one clean record failed. Per `[failures] mode`:

- `release` (the patent): release the id's mark where it still holds `token`
  (compare-and-set to the tombstone `-token` on every instance; released when
  a majority did, or had before: a redone command). The next copy the
  producer sends is then new.
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

Every id is handled as the exact bytes the command names (`Command.id`, from
`id_b64` when present), so ids that are not UTF-8 are released, handed over,
checked against the raw record and dead-lettered like any other.

Reading the raw record back is the slow, fallible step. Only the broker's own
answer makes a command void (its record is below the log start offset or was
compacted away, its offset is past the end, its partition does not exist); a
broker that does not answer in time (paused, slow, electing a leader) raises
`RawFetchError` and the retry is rescheduled with backoff, its command still
holding the partition's commits back.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import heapq
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRebalanceListener, TopicPartition
from aiokafka.errors import KafkaError, KafkaTimeoutError, OffsetOutOfRangeError

from gateway.commands import Command, parse_command
from gateway.config import Settings
from gateway.errors import BadRecord, InvalidCommand, RawFetchError
from gateway.ids import build_extractor
from gateway.kafka import unless_stopped
from gateway.keys import dead_token, mark_digest, owner_token
from gateway.lanes import lane_headers
from gateway.metrics import Metrics
from gateway.pausing import backoff_delay
from gateway.quorum import (
    EFFECT_DONE,
    HANDED_OVER_BY_ANOTHER_COPY,
    HELD_BY_LATER_ATTEMPT,
    MOVED,
    NO_LIVE_MARK,
    RELEASED,
    RELEASED_NOW,
    Handover,
    Quorum,
)
from gateway.records import (
    H_ATTEMPT,
    H_REASON,
    H_REASONS,
    Record,
    clean_headers,
    clean_record,
    coordinates,
    source_ref,
)
from gateway.salvage import read_leniently
from gateway.sink import Sink

logger = logging.getLogger(__name__)

MAX_PENDING = 10_000  # scheduled retries held in memory before fetching pauses
FETCH_TIMEOUT_MS = 200
RAW_FETCH_DEADLINE_S = 10.0  # longest one raw read waits for the broker before trying later
FRESH_ANSWER_S = 2.0  # a high watermark this recent is the broker's current word
COMMIT_TIMEOUT_S = 5.0  # a commit the broker does not answer is retried on the next pass


@dataclass(frozen=True)
class Absent:
    """The broker's answer that no record is at a command's coordinates."""

    reason: str  # the invalid-command metric label
    detail: str


class RawFetcher:
    """Reads single raw records back by coordinates (no group; retries are rare)."""

    def __init__(
        self, consumer: AIOKafkaConsumer, deadline_s: float = RAW_FETCH_DEADLINE_S
    ) -> None:
        self.consumer = consumer
        self.deadline_s = deadline_s

    async def fetch(self, topic: str, partition: int, offset: int) -> Record | Absent:
        """The record at that offset, or `Absent` when the broker says there is none:

        - `raw_record_gone`: below the log start offset (retention), or the fetch
          returned a later record (compacted away, or an aborted transaction's);
        - `beyond_end`: past the end of the partition, as the broker still says at
          the deadline (a leader's high watermark that lags for a moment after an
          election is waited out);
        - `unknown_source`: the partition does not exist.

        Raises RawFetchError when the broker gives no such answer within the
        deadline (paused or slow broker, leader election, open transaction).
        """
        tp = TopicPartition(topic, partition)
        ref = source_ref(topic, partition, offset)
        deadline = time.monotonic() + self.deadline_s
        assigned = self.consumer.assignment()
        if tp not in assigned:
            self.consumer.assign([*assigned, tp])
        if not await self._exists(tp, ref, deadline):
            self.consumer.assign([p for p in self.consumer.assignment() if p != tp])
            return Absent("unknown_source", f"no partition {tp.topic}/{tp.partition}")
        self.consumer.seek(tp, offset)
        while (left_ms := int((deadline - time.monotonic()) * 1000)) > 0:
            try:
                batch = await self.consumer.getmany(
                    tp, timeout_ms=min(FETCH_TIMEOUT_MS, left_ms), max_records=1
                )
            except OffsetOutOfRangeError:
                return await self._out_of_range(tp, ref, offset, deadline)
            except UnicodeDecodeError:
                # A header name that is not UTF-8 in the record's batch (gateway/salvage.py).
                return await self._read_leniently(tp, ref, offset)
            for rec in batch.get(tp, []):
                if rec.offset == offset:
                    return rec
                return Absent("raw_record_gone", f"{ref}: the next record is at {rec.offset}")
        high = self.consumer.highwater(tp)
        answered_ms = self.consumer.last_poll_timestamp(tp)
        if (
            high is not None
            and high <= offset
            and answered_ms is not None
            and answered_ms >= (time.time() - FRESH_ANSWER_S) * 1000
        ):
            return Absent("beyond_end", f"{ref}: the partition ends at {high}")
        raise RawFetchError(f"{ref}: not read within {self.deadline_s:g}s")

    async def _read_leniently(self, tp: TopicPartition, ref: str, offset: int) -> Record | Absent:
        """The record at `offset` when aiokafka cannot parse its batch."""
        found = await read_leniently(self.consumer._client, tp, offset, max_records=1)
        for rec in found.records:
            if rec.offset == offset:
                return rec
        if any(rec.offset == offset for rec, _ in found.bad):
            return Absent("bad_header", f"{ref}: a header name is not UTF-8")
        return Absent("raw_record_gone", f"{ref}: not found by a lenient read")

    async def _exists(self, tp: TopicPartition, ref: str, deadline: float) -> bool:
        """Whether the partition exists, refreshing metadata when it is not known yet."""
        parts = self.consumer.partitions_for_topic(tp.topic)
        if parts and tp.partition in parts:
            return True
        try:
            refreshed = await asyncio.wait_for(
                self.consumer._client.force_metadata_update(), deadline - time.monotonic()
            )
        except TimeoutError:
            refreshed = False
        if not refreshed:
            raise RawFetchError(f"{ref}: no metadata for {tp.topic} within {self.deadline_s:g}s")
        parts = self.consumer.partitions_for_topic(tp.topic)
        return bool(parts) and tp.partition in parts

    async def _out_of_range(
        self, tp: TopicPartition, ref: str, offset: int, deadline: float
    ) -> Absent:
        """The broker has nothing at `offset`: below the log start, or past the end.

        ListOffsets "earliest" is right on every broker (only "latest" is not on Tansu).
        """
        try:
            starts = await asyncio.wait_for(
                self.consumer.beginning_offsets([tp]), max(deadline - time.monotonic(), 0.001)
            )
        except (TimeoutError, KafkaError) as exc:
            raise RawFetchError(f"{ref}: out of range, log start unknown ({exc!r})") from exc
        if offset < starts[tp]:
            return Absent("raw_record_gone", f"{ref}: below the log start offset {starts[tp]}")
        return Absent("beyond_end", f"{ref}: past the end of the partition")


@dataclass
class _Partition:
    """What the loop holds for one assigned failure-topic partition.

    Replaced when the partition is revoked: work started before then still
    points at the old object, which is how it knows it is no longer ours.
    """

    pending: set[int] = field(default_factory=set)  # commands whose effect is scheduled
    next_offset: int | None = None  # after the last command handled
    # Below it, invalid commands were counted and logged already: a partition that
    # waits for a majority reads them again at every retry.
    reported_upto: int = 0


@dataclass(order=True)
class _Due:
    at: float
    seq: int
    command: Command = field(compare=False)
    tp: TopicPartition = field(compare=False)
    offset: int = field(compare=False)
    dead: bool = field(compare=False)
    owner: _Partition = field(compare=False)
    fetch_failures: int = field(default=0, compare=False)


def handover_decision(answers: Sequence[int], majority: int) -> str:
    """What to do with a failure command, from the counted members' HANDOVER replies
    (scripts.HANDOVER): "act" (hand over and retry or dead-letter), "skip" (stale, or
    another copy's, or done) or "wait" (no majority yet: retry the command later).

    `EFFECT_DONE` is written only after the effect was acknowledged, so one member
    saying so settles it: a member that missed that note (it gave no answer to
    `mark_done`) says `HANDED_OVER_BEFORE` ("redo") instead, and with a third member
    recovering that tie would hold the command partition forever (chaos seed 1).
    `HELD_BY_LATER_ATTEMPT` settles it too: a later command acted, so this one had.
    When the members that hold the next attempt now are a majority only with those
    another copy of the command moved (`HANDED_OVER_BY_ANOTHER_COPY`), this copy acts
    as well: at worst the retry goes out twice under one token, which the Spark job
    drops (`dedup-token`); waiting would hold the partition until that third member
    is counted again."""
    if EFFECT_DONE in answers or HELD_BY_LATER_ATTEMPT in answers:
        return "skip"
    mine = sum(1 for a in answers if a in MOVED)
    theirs = answers.count(HANDED_OVER_BY_ANOTHER_COPY)
    if mine >= majority:
        return "act"
    if theirs >= majority:
        return "skip"
    if mine + theirs >= majority:
        return "act"
    if len(answers) - mine >= majority:
        return "skip"
    return "wait"


def handover_of(cmd: Command, max_attempts: int) -> Handover:
    """The mark's handover from the command's failed attempt to the next one (or to
    the dead letter), with the source record's other attempts' tokens: a member still
    holding an earlier one missed a handover; one holding a later one (or the dead
    letter's) shows the command is stale."""
    src = (cmd.topic, cmd.partition, cmd.offset)
    dead = cmd.attempt >= max_attempts
    nxt = dead_token(*src) if dead else owner_token(*src, cmd.attempt + 1)
    # No attempt past max_attempts is ever forwarded, whatever a command says.
    earlier = [owner_token(*src, k) for k in range(1, min(cmd.attempt, max_attempts + 1))]
    later = [] if dead else [
        *(owner_token(*src, k) for k in range(cmd.attempt + 2, max_attempts + 1)), dead_token(*src)
    ]  # fmt: skip
    return Handover(mark_digest(cmd.id), cmd.token, nxt, cmd.ref, earlier, later)


def release_decision(answers: Sequence[int], majority: int) -> str:
    """What a release command did, from the counted members' RELEASE replies (1
    released now, 2 released before from that token, 3 no live mark, 0 held by
    another owner): "released", "repeated" (released, every one of them before: the
    command was delivered twice or redone after a crash), "stale" (a majority does
    not hold that token) or "wait" (no majority yet: retry the command later).

    Released means the id is free on a majority: released there, or never marked (a
    member that missed the claim and its fill). Counted as "stale" instead, that
    member tied with one that released it while a third recovered, and the command
    partition waited forever, as a handover's did (see handover_decision)."""
    released = sum(1 for a in answers if a in RELEASED)
    if released and released + answers.count(NO_LIVE_MARK) >= majority:
        return "released" if RELEASED_NOW in answers else "repeated"
    if len(answers) - released >= majority:
        return "stale"
    return "wait"


class FailureLoop:
    def __init__(
        self, settings: Settings, quorum: Quorum, producer: AIOKafkaProducer, metrics: Metrics
    ) -> None:
        self.settings = settings
        self.failures = settings.failures
        self.quorum = quorum
        self.sink = Sink(producer, settings.kafka, metrics)
        self.metrics = metrics
        self.extract = build_extractor(settings.dedup.id, settings.dedup.max_id_bytes)
        self.raw_topics = frozenset(settings.kafka.raw_topics)
        self.lane_extra = lane_headers(settings)  # a retry keeps its lane's header and topic
        self.due: list[_Due] = []
        self.partitions: dict[TopicPartition, _Partition] = {}
        self._seq = 0
        self._committing: asyncio.Future[None] | None = None  # the last offset commit

    async def run(
        self, commands: AIOKafkaConsumer, fetcher: RawFetcher, stop: asyncio.Event
    ) -> None:
        while not stop.is_set():
            await self._run_due(fetcher, stop)
            if len(self.due) >= MAX_PENDING:
                await asyncio.sleep(FETCH_TIMEOUT_MS / 1000)  # let scheduled retries drain first
                continue
            fetched = await unless_stopped(
                commands.getmany(timeout_ms=FETCH_TIMEOUT_MS, max_records=500), stop
            )
            if fetched is None:
                break
            batch = fetched
            for tp, records in batch.items():
                part = self.partitions.setdefault(tp, _Partition())
                rewind = await self.handle(tp, part, records)
                # Only while the partition is still ours: after a rebalance its new
                # position is the committed offset, and seeking on would skip commands.
                # Checked with no await before the seek: it cannot be revoked in between.
                if rewind is not None and self._owns(tp, part, commands):
                    # No majority: retry this command later.
                    commands.seek(tp, rewind)
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(
                            stop.wait(), self.failures.backoff_initial.total_seconds()
                        )
            await self._commit(commands)

    async def handle(
        self, tp: TopicPartition, part: _Partition, records: Sequence[Record]
    ) -> int | None:
        """Act on one partition's commands in order; the offset to rewind to, if undecided."""
        valid: list[tuple[Record, Command]] = []
        for rec in records:
            new = rec.offset >= part.reported_upto
            try:
                cmd = parse_command(rec)
            except InvalidCommand as exc:
                if new:
                    self._invalid(rec, exc.reason, str(exc).removeprefix(f"{exc.reason}: "))
                continue
            if self.failures.mode == "retry" and cmd.topic not in self.raw_topics:
                # Nothing to read back (a release needs only the token, whatever the topic).
                if new:
                    self._invalid(cmd, "unknown_source", f"{cmd.topic!r} is not a raw topic")
                continue
            valid.append((rec, cmd))
        part.next_offset = records[-1].offset + 1
        part.reported_upto = max(part.reported_upto, part.next_offset)
        if not valid:
            return None
        if self.failures.mode == "release":
            return await self._release(part, valid)
        return await self._hand_over(tp, part, valid)

    async def _release(self, part: _Partition, valid: list[tuple[Record, Command]]) -> int | None:
        digests = [mark_digest(c.id) for _, c in valid]
        replies = await self.quorum.release(digests, [c.token for _, c in valid])
        for j, (rec, cmd) in enumerate(valid):
            answers = [a for r in replies if (a := r[j]) is not None]
            decision = release_decision(answers, self.quorum.majority)
            if decision == "repeated":  # counted stale, as a handover's second copy is
                self.metrics.releases.labels("stale").inc()
                logger.info(
                    "repeated release for %s (%s): released before", cmd.readable_id, cmd.ref,
                    extra=_fields(cmd),
                )  # fmt: skip
            elif decision == "released":
                self.metrics.releases.labels("released").inc()
                logger.info(
                    "released %s (%s): %s", cmd.readable_id, cmd.ref, cmd.reason, extra=_fields(cmd)
                )
            elif decision == "stale":
                self.metrics.releases.labels("stale").inc()
                logger.info(
                    "stale release for %s (%s): token no longer holds", cmd.readable_id, cmd.ref,
                    extra=_fields(cmd),
                )  # fmt: skip
            else:
                return self._undecided(part, rec, cmd, answers)
        return None

    def _undecided(self, part: _Partition, rec: Record, cmd: Command, answers: list[int]) -> int:
        """No majority of counted members agreed on a command: its partition waits there
        (the offset to rewind to) and tries again after `backoff_initial`."""
        self.metrics.releases.labels("no_quorum").inc()
        logger.warning(
            "no majority decided failure command %s for %s (counted answers %s, %d needed): "
            "its partition waits", cmd.ref, cmd.readable_id, answers, self.quorum.majority,
            extra=_fields(cmd),
        )  # fmt: skip
        rewind: int = rec.offset
        part.next_offset = rewind
        return rewind

    async def _hand_over(
        self, tp: TopicPartition, part: _Partition, valid: list[tuple[Record, Command]]
    ) -> int | None:
        marks = [handover_of(cmd, self.failures.max_attempts) for _, cmd in valid]
        replies = await self.quorum.handover(marks)
        now = time.monotonic()
        for j, (rec, cmd) in enumerate(valid):
            answers = [a for r in replies if (a := r[j]) is not None]
            decision = handover_decision(answers, self.quorum.majority)
            if decision == "act":
                self.metrics.releases.labels("released").inc()
                dead = cmd.attempt >= self.failures.max_attempts
                delay = 0.0 if dead else self._backoff(cmd.attempt)
                self._schedule(_Due(now + delay, self._next_seq(), cmd, tp, rec.offset, dead, part))
            elif decision == "skip":
                self.metrics.releases.labels("stale").inc()
                logger.info(
                    "stale or repeated command for %s (%s): skipped", cmd.readable_id, cmd.ref,
                    extra=_fields(cmd),
                )  # fmt: skip
            else:
                return self._undecided(part, rec, cmd, answers)
        return None

    def _backoff(self, attempt: int) -> float:
        return backoff_delay(
            self.failures.backoff_initial.total_seconds(),
            self.failures.backoff_max.total_seconds(),
            attempt,
        )

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _schedule(self, due: _Due) -> None:
        heapq.heappush(self.due, due)
        due.owner.pending.add(due.offset)

    def _owns(self, tp: TopicPartition, part: _Partition, commands: AIOKafkaConsumer) -> bool:
        """Whether `part` is still this loop's state of `tp`, which is still assigned."""
        return self.partitions.get(tp) is part and tp in commands.assignment()

    def _ours(self, due: _Due) -> bool:
        """False once the due's command partition was revoked (its new owner redoes it)."""
        return self.partitions.get(due.tp) is due.owner

    async def _run_due(self, fetcher: RawFetcher, stop: asyncio.Event) -> None:
        while self.due and self.due[0].at <= time.monotonic() and not stop.is_set():
            due = heapq.heappop(self.due)
            if not self._ours(due):
                continue
            try:
                await self._redo(due, fetcher)
            except (RawFetchError, KafkaError) as exc:
                if isinstance(exc, KafkaError) and not (
                    exc.retriable or isinstance(exc, KafkaTimeoutError)
                ):
                    raise
                self._later(due, exc)
                return  # the broker is slow or away: let the command loop run before the next
            due.owner.pending.discard(due.offset)

    def _later(self, due: _Due, exc: Exception) -> None:
        """Reschedule a retry the broker could not serve now; its command stays pending."""
        failures = due.fetch_failures + 1
        delay = self._backoff(failures)
        heapq.heappush(
            self.due,
            replace(
                due, at=time.monotonic() + delay, seq=self._next_seq(), fetch_failures=failures
            ),
        )
        cmd = due.command
        logger.warning(
            "%s of %s (%s) not done, trying again in %.1fs: %s",
            "dead letter" if due.dead else "retry", cmd.readable_id,
            source_ref(cmd.topic, cmd.partition, cmd.offset), delay, exc,
            extra={**_fields(cmd), "tries": failures},
        )  # fmt: skip

    async def _redo(self, due: _Due, fetcher: RawFetcher) -> None:
        """Forward the retry or the dead letter, then note it done; or count the command
        invalid when the broker says its raw record is not there."""
        cmd = due.command
        raw = await fetcher.fetch(cmd.topic, cmd.partition, cmd.offset)
        if not self._ours(due):
            return  # revoked during the fetch: the new owner replays the command
        if isinstance(raw, Absent):
            self._invalid(cmd, raw.reason, raw.detail)
            return
        try:
            raw_id: bytes | None = self.extract(raw)
        except BadRecord:
            raw_id = None
        if raw_id != cmd.id:
            self._invalid(cmd, "id_mismatch", f"the raw record has id {raw_id!r}, not {cmd.id!r}")
            return
        reasons = json.dumps(cmd.history).encode()
        if due.dead:
            headers = clean_headers(
                raw,
                raw_id,
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
                cmd.readable_id,
                source_ref(raw.topic, raw.partition, raw.offset),
                cmd.attempt,
                cmd.reason,
                extra=_fields(cmd),
            )
        else:
            attempt = cmd.attempt + 1
            token = owner_token(raw.topic, raw.partition, raw.offset, attempt)
            headers = clean_headers(
                raw,
                raw_id,
                token,
                [*self.lane_extra.get(raw.topic, ()), (H_ATTEMPT, str(attempt).encode()),
                 (H_REASONS, reasons)],
            )  # fmt: skip
            await self._deliver(self.settings.clean_topic_of(raw.topic), raw, headers)
            self.metrics.retries.labels(str(attempt)).inc()
        await self.quorum.mark_done([mark_digest(cmd.id)], [cmd.ref])

    async def _deliver(self, topic: str, raw: Record, headers: list[tuple[str, bytes]]) -> None:
        for fut in await self.sink.send(topic, [clean_record(raw, headers)]):
            await fut

    def listener(self) -> ConsumerRebalanceListener:
        return _ForgetRevoked(self)

    async def _commit(self, commands: AIOKafkaConsumer) -> None:
        """Commit up to the oldest command whose effect is still scheduled."""
        offsets = {}
        assigned = commands.assignment()
        for tp, part in self.partitions.items():
            if tp not in assigned or part.next_offset is None:
                continue
            offsets[tp] = min(part.pending) if part.pending else part.next_offset
        if not offsets:
            return
        if self._committing is not None and not self._committing.done():
            return  # the last commit is still under way (broker away): the next pass tries
        where = {source_ref(tp.topic, tp.partition, o): o for tp, o in offsets.items()}
        # Bounded, but never cancelled: aiokafka retries a commit for as long as the
        # broker is away (due retries must still get their turn meanwhile), and a
        # cancelled commit leaves its own inner task to fail unobserved.
        task = asyncio.ensure_future(commands.commit(offsets))
        self._committing = task
        done, _ = await asyncio.wait([task], timeout=COMMIT_TIMEOUT_S)
        if not done:
            task.add_done_callback(functools.partial(_commit_done, where))
            logger.warning(
                "failure-topic commit still under way after %.0fs; the next pass commits again",
                COMMIT_TIMEOUT_S, extra={"commit": where},
            )  # fmt: skip
            return
        _commit_done(where, task)

    def forget(self, partitions: set[TopicPartition]) -> None:
        """Revoked command partitions: their scheduled effects go with them (the new
        owner replays the uncommitted commands and redoes them)."""
        self.due = [d for d in self.due if d.tp not in partitions]
        heapq.heapify(self.due)
        for tp in partitions:
            self.partitions.pop(tp, None)

    def _invalid(self, command: Record | Command, reason: str, detail: str) -> None:
        """Count and log a command that is skipped, naming where it is on the failure
        topic and, once parsed, the raw record it names."""
        self.metrics.invalid_commands.labels(reason).inc()
        if isinstance(command, Command):
            where, fields = command.ref, _fields(command)
        else:
            where = source_ref(command.topic, command.partition, command.offset)
            fields = {"command": where}
        logger.warning(
            "invalid failure command at %s skipped (%s): %s", where, reason, detail,
            extra={**fields, "reason": reason},
        )  # fmt: skip


def _fields(cmd: Command) -> dict[str, str | int]:
    """Log fields of a command: the raw record it names, and where the command is."""
    return {**coordinates(cmd.topic, cmd.partition, cmd.offset), "command": cmd.ref}


def _commit_done(where: dict[str, int], task: asyncio.Future[None]) -> None:
    """Log a failed command-offset commit (its exception retrieved, never left unobserved)."""
    if task.cancelled() or (exc := task.exception()) is None:
        return
    # Revoked meanwhile (CommitFailedError, IllegalStateError), or a broker error:
    # the next pass commits again, or the new owner replays the commands.
    logger.warning(
        "failure-topic commit failed, left for the next pass: %r", exc, extra={"commit": where}
    )


class _ForgetRevoked(ConsumerRebalanceListener):  # type: ignore[misc]
    """Failure-topic partitions that move: drop their scheduled effects here."""

    def __init__(self, failures: FailureLoop) -> None:
        self.failures = failures

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        self.failures.forget(revoked)

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        pass
