"""The failure loop: release commands from the Spark job, retries, dead letters.

A command (failure topic; key = id, value = JSON with `id`, `token`, `reason`,
`source` {topic, partition, offset}, optional `attempt` and `reasons`) says
processing of one clean record failed. Per `[failures] mode`:

- `release` (the patent): release the id's mark where it still holds `token`
  (compare-and-set to the tombstone `-token` on every member; released when
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
import json
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRebalanceListener, TopicPartition
from aiokafka.errors import KafkaError, KafkaTimeoutError

from gateway.config import Settings
from gateway.contract.commands import Command, parse_command
from gateway.contract.records import (
    H_ATTEMPT,
    H_REASON,
    H_REASONS,
    Record,
    clean_headers,
    clean_record,
    coordinates,
    source_ref,
)
from gateway.contract.tokens import dead_token, mark_digest, owner_token
from gateway.errors import BadRecord, InvalidCommand, RawFetchError
from gateway.failures.fetch_back import Absent, RawFetcher
from gateway.kafka.due import DueQueue
from gateway.kafka.loop import Commits, ConsumerLoop
from gateway.kafka.offsets import OffsetBook, PartitionOffsets
from gateway.kafka.salvage import Fetched
from gateway.kafka.sink import Sink
from gateway.metrics import Metrics
from gateway.quorum.quorum import Quorum
from gateway.rules.backoff import backoff_delay
from gateway.rules.commands import handover_decision, handover_of, release_decision
from gateway.rules.ids import build_extractor
from gateway.rules.lanes import lane_headers
from gateway.waits import wait_or_stop

logger = logging.getLogger(__name__)

MAX_PENDING = 10_000  # scheduled retries held in memory before fetching pauses
FETCH_TIMEOUT_MS = 200
MAX_COMMANDS = 500  # per fetch


@dataclass(slots=True)
class _Partition(PartitionOffsets):
    """What the loop holds for one assigned failure-topic partition: the commands whose
    effect is scheduled are `taken`, `moved` once done; `next_offset` is after the last
    command handled."""

    # Below it, invalid commands were counted and logged already: a partition that
    # waits for a majority reads them again at every retry.
    reported_upto: int = 0


@dataclass
class _Due:
    """A retry or dead letter scheduled after its command's handover."""

    command: Command
    tp: TopicPartition
    offset: int
    dead: bool
    owner: _Partition
    fetch_failures: int = 0


class FailureLoop:
    """A step on the consumer-loop skeleton (gateway/kafka/loop.py) over the failure
    topic. `out`: the service's sink (gateway/service/app.py), or a producer to send on;
    `fetcher` reads raw records back."""

    def __init__(
        self,
        settings: Settings,
        quorum: Quorum,
        out: Sink | AIOKafkaProducer,
        metrics: Metrics,
        commands: AIOKafkaConsumer,
        fetcher: RawFetcher,
    ) -> None:
        self.settings = settings
        self.failures = settings.failures
        self.quorum = quorum
        self.sink = out if isinstance(out, Sink) else Sink(out, settings.kafka, metrics)
        self.metrics = metrics
        self.commands = commands
        self.fetcher = fetcher
        self.extract = build_extractor(settings.dedup.id, settings.dedup.max_id_bytes)
        self.raw_topics = frozenset(settings.kafka.raw_topics)
        self.lane_extra = lane_headers(settings)  # a retry keeps its lane's header and topic
        self.due: DueQueue[_Due] = DueQueue()  # by time.monotonic()
        self.book: OffsetBook[_Partition] = OffsetBook(_Partition)
        self.commits = Commits(commands, "failure-topic")
        self.loop = ConsumerLoop(
            commands, settings.kafka, "failure command", self, self.book.position, self.book.read_on
        )
        self._rewound = False  # a partition waits for a majority: back off before the next

    def listener(self) -> ConsumerRebalanceListener:
        return self.loop.listener("failure-topic partitions", self.forget)

    async def run(self, stop: asyncio.Event) -> None:
        await self.loop.run(stop)

    async def ask(self, stop: asyncio.Event) -> tuple[int, int] | None:
        """The retries due first; no fetch while too many are scheduled."""
        await self._run_due(stop)
        if len(self.due) >= MAX_PENDING:
            await wait_or_stop(stop, FETCH_TIMEOUT_MS / 1000)  # let scheduled retries drain
            return None
        return FETCH_TIMEOUT_MS, MAX_COMMANDS

    async def take(self, fetched: Fetched) -> set[TopicPartition]:
        """Act on each partition's commands; one that waits for a majority reads its
        undecided command again after a pause (it is not read on)."""
        rewound = set()
        for tp, records in fetched.records.items():
            rewind = await self.handle(tp, self.book.of(tp), records, fetched.bad.get(tp))
            if rewind is not None:
                self.commands.seek(tp, rewind)
                rewound.add(tp)
        self._rewound = self._rewound or bool(rewound)
        return rewound

    async def after(self, stop: asyncio.Event) -> None:
        """Commit up to the oldest command whose effect is still scheduled; after a
        rewind, wait `backoff_initial` before reading the undecided command again."""
        offsets = self.book.due_commits(self.commands)
        if offsets and await self.commits.commit(offsets):
            self.book.committed(offsets)
        if self._rewound:
            self._rewound = False
            await wait_or_stop(stop, self.failures.backoff_initial.total_seconds())

    async def drain(self) -> None:
        """Nothing to finish: scheduled effects not done are redone from the commits."""

    async def handle(
        self,
        tp: TopicPartition,
        part: _Partition,
        records: Sequence[Record],
        bad_headers: Mapping[int, int] | None = None,
    ) -> int | None:
        """Act on one partition's commands in order; the offset to rewind to, if undecided.
        `bad_headers`: offsets of records read leniently, with how many header names
        that are not UTF-8 were dropped from each (they are skipped as invalid)."""
        valid: list[tuple[Record, Command]] = []
        for rec in records:
            new = rec.offset >= part.reported_upto
            if bad_headers and rec.offset in bad_headers:
                if new:
                    dropped = bad_headers[rec.offset]
                    self._invalid(rec, "bad_header", f"{dropped} header name(s) not UTF-8")
                continue
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
                self._stale(cmd, "repeated release", "released before")
            elif decision == "released":
                self.metrics.releases.labels("released").inc()
                logger.info(
                    "released %s (%s): %s", cmd.readable_id, cmd.ref, cmd.reason, extra=_fields(cmd)
                )
            elif decision == "stale":
                self._stale(cmd, "stale release", "token no longer holds")
            else:
                return self._undecided(part, rec, cmd, answers)
        return None

    def _stale(self, cmd: Command, what: str, why: str) -> None:
        """A command that changes nothing: counted `stale`, logged as `what for ID (REF): why`."""
        self.metrics.releases.labels("stale").inc()
        logger.info("%s for %s (%s): %s", what, cmd.readable_id, cmd.ref, why, extra=_fields(cmd))

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
                self._schedule(now + delay, _Due(cmd, tp, rec.offset, dead, part))
            elif decision == "skip":
                self._stale(cmd, "stale or repeated command", "skipped")
            else:
                return self._undecided(part, rec, cmd, answers)
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

    async def _run_due(self, stop: asyncio.Event) -> None:
        while not stop.is_set() and (due := self.due.pop_due(time.monotonic())) is not None:
            if not self._ours(due):
                continue
            try:
                await self._redo(due, self.fetcher)
            except (RawFetchError, KafkaError) as exc:
                if isinstance(exc, KafkaError) and not (
                    exc.retriable or isinstance(exc, KafkaTimeoutError)
                ):
                    raise
                self._later(due, exc)
                return  # the broker is slow or away: let the command loop run before the next
            due.owner.moved.add(due.offset)

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

    def forget(self, partitions: set[TopicPartition]) -> None:
        """Revoked command partitions: their scheduled effects go with them (the new
        owner replays the uncommitted commands and redoes them)."""
        self.due.drop(lambda due: due.tp in partitions)
        self.book.forget(partitions)

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
