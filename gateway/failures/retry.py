"""Retry mode (`[failures] mode = "retry"`, the default): a command hands the mark
over from the failed attempt's token to the next attempt's, then, after a backoff
that doubles per attempt, the raw record is read back by its coordinates and
forwarded again with `dedup-attempt` + 1. After `max_attempts` it goes to the
dead-letter topic instead and the mark is handed to a dead-letter token, so
producer resends stay duplicates. Handovers are counted apart from releases
(`dedup_gateway_releases_total{result="handed_over"}`).

Reading the raw record back is the slow, fallible step. Only the broker's own
answer makes a command void (its record is below the log start offset or was
compacted away, its offset is past the end, its partition does not exist); a
broker that does not answer in time raises `RawFetchError` and the retry is
rescheduled with backoff, its command still holding the partition's commits back.

With `[kafka] exactly_once` (a completion whose copies are not out on their
acknowledgement, `Completion.out_on_ack`), the failure loop runs the due retries
and dead letters in a transaction with the command offsets they complete
(gateway/failures/loop.py): a crash before it commits leaves no copy a
`read_committed` reader sees, and the commands are read again. Their effects are
noted done in Redis only once it committed (`noted_done`): noted before, a replayed
command would find its effect done and never send the copy the abort threw away.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, replace

from aiokafka import TopicPartition
from aiokafka.errors import KafkaError, KafkaTimeoutError

from gateway import faults
from gateway.config import Settings
from gateway.contract.commands import Command
from gateway.contract.records import (
    H_ATTEMPT,
    H_REASON,
    H_REASONS,
    Record,
    clean_headers,
    clean_record,
    source_ref,
)
from gateway.contract.tokens import dead_token, mark_digest, owner_token
from gateway.errors import BadRecord, RawFetchError
from gateway.failures.loop import (
    CommandPartition,
    Valid,
    command_fields,
    invalid,
    stale,
    undecided,
)
from gateway.kafka.completion import Completion
from gateway.kafka.due import DueQueue
from gateway.kafka.offsets import OffsetBook
from gateway.kafka.read_back import Absent, RawFetcher
from gateway.metrics import Metrics
from gateway.quorum.quorum import Quorum
from gateway.rules.backoff import backoff_delay
from gateway.rules.commands import (
    HandoverDecision,
    goes_to_dead_letter,
    handover_decision,
    handover_of,
)
from gateway.rules.ids import build_extractor
from gateway.rules.lanes import lane_headers

logger = logging.getLogger(__name__)

MAX_PENDING = 10_000  # scheduled retries held in memory before fetching pauses


@dataclass
class _Due:
    """A retry or dead letter scheduled after its command's handover."""

    command: Command
    tp: TopicPartition
    offset: int
    dead: bool
    owner: CommandPartition
    fetch_failures: int = 0


class Retries:
    """Hands each command's mark over and schedules its retry or dead letter. `book`:
    the failure loop's (a retry whose command partition was revoked is not done)."""

    raw_only = True  # a retry reads its raw record back

    def __init__(
        self,
        settings: Settings,
        quorum: Quorum,
        completion: Completion,
        metrics: Metrics,
        fetcher: RawFetcher,
        book: OffsetBook[CommandPartition],
    ) -> None:
        self.settings = settings
        # A copy out once acknowledged is noted done at once; one in a transaction only
        # after its commit (`noted_done`).
        self.note_on_ack = completion.out_on_ack
        self.failures = settings.failures
        self.quorum = quorum
        self.sink = completion.sink
        self.metrics = metrics
        self.fetcher = fetcher
        self.book = book
        self.extract = build_extractor(settings.dedup.id, settings.dedup.max_id_bytes)
        self.lane_extra = lane_headers(settings)  # a retry keeps its lane's header and topic
        self.due: DueQueue[_Due] = DueQueue()  # by time.monotonic()

    def busy(self) -> bool:
        return len(self.due) >= MAX_PENDING

    def has_due(self) -> bool:
        at = self.due.next_at()
        return at is not None and at <= time.monotonic()

    def forget(self, partitions: set[TopicPartition]) -> None:
        self.due.drop(lambda due: due.tp in partitions)

    async def act(self, tp: TopicPartition, part: CommandPartition, valid: Valid) -> int | None:
        marks = [handover_of(cmd, self.failures.max_attempts) for _, cmd in valid]
        replies = await self.quorum.handover(marks)
        now = time.monotonic()
        for j, (rec, cmd) in enumerate(valid):
            answers = [a for r in replies if (a := r[j]) is not None]
            decision = handover_decision(answers, self.quorum.majority, cmd.ref, self.quorum.size)
            if decision is HandoverDecision.ACT:
                self.metrics.releases.labels("handed_over").inc()
                dead = goes_to_dead_letter(cmd, self.failures.max_attempts)
                delay = 0.0 if dead else self._backoff(cmd.attempt)
                self._schedule(now + delay, _Due(cmd, tp, rec.offset, dead, part))
            elif decision is HandoverDecision.SKIP:
                stale(self.metrics, cmd, "stale or repeated command", "skipped")
            else:
                return undecided(self.metrics, part, rec, cmd, answers, self.quorum.majority)
        return None

    def _backoff(self, attempt: int) -> float:
        return backoff_delay(
            self.failures.backoff_initial.total_seconds(),
            self.failures.backoff_max.total_seconds(),
            attempt,
        )

    def _schedule(self, at: float, due: _Due) -> None:
        self.due.push(at, due)
        due.owner.take(due.offset)

    def _ours(self, due: _Due) -> bool:
        """False once the due's command partition was revoked (its new owner redoes it)."""
        return self.book.parts.get(due.tp) is due.owner

    async def run_due(self, stop: asyncio.Event, budget_s: float | None = None) -> list[Command]:
        """Send the retries and dead letters whose time has come, for at most `budget_s`
        (one transaction's share); the commands whose copy the broker acknowledged and
        that are not noted done yet (in a transaction: `note_on_ack` false)."""
        sent: list[Command] = []
        until = None if budget_s is None else time.monotonic() + budget_s
        while not stop.is_set() and (until is None or time.monotonic() < until):
            if (due := self.due.pop_due(time.monotonic())) is None:
                break
            if not self._ours(due):
                continue
            try:
                if await self._redo(due, self.fetcher):  # its copy is out
                    if self.note_on_ack:
                        await self.noted_done([due.command])
                    else:
                        sent.append(due.command)  # noted done once the transaction commits
            except (RawFetchError, KafkaError) as exc:
                if isinstance(exc, KafkaError) and not (
                    exc.retriable or isinstance(exc, KafkaTimeoutError)
                ):
                    raise
                self._later(due, exc)
                break  # the broker is slow or away: let the command loop run before the next
            due.owner.moved.add(due.offset)
        return sent

    async def noted_done(self, commands: list[Command]) -> None:
        """Note in Redis that these commands' copies are out (see `note_on_ack`), and
        count them: a copy of a transaction that aborts is not counted (its command is
        redone)."""
        for cmd in commands:
            if goes_to_dead_letter(cmd, self.failures.max_attempts):
                self.metrics.dead_lettered.inc()
            else:
                self.metrics.retries.labels(str(cmd.attempt + 1)).inc()
        if commands:
            await self.quorum.mark_done(
                [mark_digest(c.id) for c in commands], [c.ref for c in commands]
            )

    def _later(self, due: _Due, exc: Exception) -> None:
        """Reschedule a retry the broker could not serve now; its command stays pending."""
        failures = due.fetch_failures + 1
        delay = self._backoff(failures)
        self.due.push(time.monotonic() + delay, replace(due, fetch_failures=failures))
        cmd = due.command
        logger.warning(
            "%s of %s (%s) not done, trying again in %.1fs: %s",
            "dead letter" if due.dead else "retry", cmd.readable_id,
            source_ref(cmd.topic, cmd.partition, cmd.offset), delay, exc,
            extra={**command_fields(cmd), "tries": failures},
        )  # fmt: skip

    async def _redo(self, due: _Due, fetcher: RawFetcher) -> bool:
        """Forward the retry or the dead letter (True once the broker acknowledged it);
        or count the command invalid when the broker says its raw record is not there
        (False)."""
        cmd = due.command
        raw = await fetcher.fetch(cmd.topic, cmd.partition, cmd.offset)
        if not self._ours(due):
            return False  # revoked during the fetch: the new owner replays the command
        if isinstance(raw, Absent):
            invalid(self.metrics, cmd, raw.reason, raw.detail)
            return False
        try:
            raw_id: bytes | None = self.extract(raw)
        except BadRecord:
            raw_id = None
        if raw_id != cmd.id:
            invalid(
                self.metrics,
                cmd,
                "id_mismatch",
                f"the raw record has id {raw_id!r}, not {cmd.id!r}",
            )
            return False
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
            logger.warning(
                "dead-lettered %s (%s) after %d attempts: %s",
                cmd.readable_id,
                source_ref(raw.topic, raw.partition, raw.offset),
                cmd.attempt,
                cmd.reason,
                extra=command_fields(cmd),
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
        faults.reached("retry-acked")
        return True

    async def _deliver(self, topic: str, raw: Record, headers: list[tuple[str, bytes]]) -> None:
        for fut in await self.sink.send(topic, [clean_record(raw, headers)]):
            await fut
