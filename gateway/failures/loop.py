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

The loop (`FailureLoop`, a step on gateway/kafka/loop.py) reads and checks the
commands; the mode, chosen once in gateway/service/app.py, acts on them:
`Releases` (gateway/failures/release.py) or `Retries` (gateway/failures/retry.py).

Commands are consumed at least once and their effects are idempotent: the
handover notes which command delivery made it, so a crash replay of that
delivery redoes the effect, while another copy of the command, or a command whose
token is stale, changes nothing. Offsets are committed only once a command's effect
is acknowledged. A crash between a retry's acknowledgement and the Redis note that
it is done sends it once more (at-least-once); with `[kafka] exactly_once` the due
retries and dead letters go out in one transaction with the command offsets they
complete (`_run_due`, through the loop's `Completion`), so a `read_committed` reader
sees each once.

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
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener, TopicPartition

from gateway.config import Settings
from gateway.contract.commands import Command, parse_command
from gateway.contract.records import Record, coordinates, source_ref
from gateway.errors import InvalidCommand
from gateway.kafka.completion import Completion
from gateway.kafka.exactly_once import StepAborted
from gateway.kafka.loop import Ask, ConsumerLoop, Idle
from gateway.kafka.offsets import OffsetBook, PartitionOffsets
from gateway.kafka.salvage import Fetched
from gateway.kafka.transactions import group_member
from gateway.metrics import Metrics
from gateway.waits import wait_or_stop

logger = logging.getLogger(__name__)

FETCH_TIMEOUT_MS = 200
MAX_COMMANDS = 500  # per fetch


@dataclass(slots=True)
class CommandPartition(PartitionOffsets):
    """What the loop holds for one assigned failure-topic partition: the commands whose
    effect is scheduled are `taken`, `moved` once done; `next_offset` is after the last
    command handled."""

    # Below it, invalid commands were counted and logged already: a partition that
    # waits for a majority reads them again at every retry.
    reported_upto: int = 0


Valid = list[tuple[Record, Command]]  # the checked commands of one partition, in order


class FailureMode(Protocol):
    """What a mode does with checked commands (gateway/failures/release.py, retry.py)."""

    raw_only: bool  # its commands must name a raw topic (a record to read back)

    async def act(self, tp: TopicPartition, part: CommandPartition, valid: Valid) -> int | None:
        """Act on one partition's commands in order; the offset to rewind to, if undecided."""

    def has_due(self) -> bool:
        """An effect's time has come."""

    async def run_due(self, stop: asyncio.Event, budget_s: float | None = None) -> list[Command]:
        """Before a fetch: the effects whose time has come (for at most `budget_s`); the
        commands whose effect went out and is to be noted done (`noted_done`) once the
        step completed (those whose effect is out once acknowledged are noted already)."""

    async def noted_done(self, commands: list[Command]) -> None:
        """Note these commands' effects done (after their step completed)."""

    def busy(self) -> bool:
        """Too much scheduled: fetch nothing more for now."""

    def forget(self, partitions: set[TopicPartition]) -> None:
        """Revoked command partitions: their scheduled effects go with them."""


class FailureLoop:
    """A step on the consumer-loop skeleton (gateway/kafka/loop.py) over the failure
    topic: checks each command and hands the valid ones to its `mode`."""

    def __init__(
        self,
        settings: Settings,
        mode: FailureMode,
        metrics: Metrics,
        commands: AIOKafkaConsumer,
        book: OffsetBook[CommandPartition],
        completion: Completion,
    ) -> None:
        self.failures = settings.failures
        self.mode = mode
        self.metrics = metrics
        self.commands = commands
        self.raw_topics = frozenset(settings.kafka.raw_topics)
        self.book = book
        self.completion = completion
        self.loop = ConsumerLoop(
            commands, settings.kafka, "failure command", self, book.position, book.read_on
        )
        self._rewound = False  # a partition waits for a majority: back off before the next

    def listener(self) -> ConsumerRebalanceListener:
        return self.loop.listener("failure-topic partitions", self.forget)

    async def run(self, stop: asyncio.Event) -> None:
        await self.loop.run(stop)

    async def ask(self, stop: asyncio.Event) -> Ask | Idle:
        """The effects due first; no fetch while too many are scheduled, and one that
        does not wait while more are due."""
        if self.mode.has_due():
            await self._run_due(stop)
        if self.mode.busy():
            return Idle(FETCH_TIMEOUT_MS)  # let scheduled effects drain
        return Ask(0 if self.mode.has_due() else FETCH_TIMEOUT_MS, MAX_COMMANDS)

    async def _run_due(self, stop: asyncio.Event) -> None:
        """The due effects' copies, for at most the completion's `step_s`, then the
        command offsets they complete (in one transaction with `[kafka] exactly_once`),
        under the loop's lock (a revoke waits for it), committed as the group member the
        consumer is now: a zombie's transaction is refused, and aborts."""
        sent: list[Command] = []

        async def step() -> dict[TopicPartition, int]:
            sent.extend(await self.mode.run_due(stop, self.completion.step_s))
            # In a transaction every partition's point, moved or not: a retry behind an
            # older command still scheduled moves none, and a transaction without
            # offsets is checked against no group generation (a zombie's retry
            # committed twice).
            return self.completion.step_offsets(self.book, self.commands)

        async with self.loop.lock:
            try:
                committed = await self.completion.complete(step(), group_member(self.commands))
            except StepAborted:
                await self._read_again()
                return
            if committed is not None:
                self.book.committed(committed)
            # Under the lock: a revoke waits for the notes. A command's offset may stay
            # uncommitted (an older command's retry still scheduled): the partition's
            # next owner replays it, and before its note it redoes the retry (a way the
            # 3 repeated retries of a 210k-id crash run, seed 20001, can come).
            await self.mode.noted_done(sent)

    async def _read_again(self) -> None:
        """A transaction aborted (`ConsumerLoop.read_again`): every scheduled effect is
        dropped, and reading each command partition again from its commit hands over
        again (the same command: redone) and reschedules."""
        await self.loop.read_again(self.forget)

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

    async def settle(self) -> None:
        """Nothing to settle: a salvage reads on from where the offset book stands."""

    async def after(self, stop: asyncio.Event) -> None:
        """Commit up to the oldest command whose effect is still scheduled; after a
        rewind, wait `backoff_initial` before reading the undecided command again."""
        offsets = self.book.due_commits(self.commands)
        if offsets and await self.completion.commit(offsets):
            self.book.committed(offsets)
        if self._rewound:
            self._rewound = False
            await wait_or_stop(stop, self.failures.backoff_initial.total_seconds())

    async def drain(self) -> None:
        """Nothing to finish: scheduled effects not done are redone from the commits."""

    async def handle(
        self,
        tp: TopicPartition,
        part: CommandPartition,
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
                    invalid(self.metrics, rec, "bad_header", f"{dropped} header name(s) not UTF-8")
                continue
            try:
                cmd = parse_command(rec)
            except InvalidCommand as exc:
                if new:
                    detail = str(exc).removeprefix(f"{exc.reason}: ")
                    invalid(self.metrics, rec, exc.reason, detail)
                continue
            if self.mode.raw_only and cmd.topic not in self.raw_topics:
                # Nothing to read back (a release needs only the token, whatever the topic).
                if new:
                    detail = f"{cmd.topic!r} is not a raw topic"
                    invalid(self.metrics, cmd, "unknown_source", detail)
                continue
            valid.append((rec, cmd))
        part.next_offset = records[-1].offset + 1
        part.reported_upto = max(part.reported_upto, part.next_offset)
        if not valid:
            return None
        return await self.mode.act(tp, part, valid)

    def forget(self, partitions: set[TopicPartition]) -> None:
        """Revoked command partitions: their scheduled effects go with them (the new
        owner replays the uncommitted commands and redoes them)."""
        self.mode.forget(partitions)
        self.book.forget(partitions)


def invalid(metrics: Metrics, command: Record | Command, reason: str, detail: str) -> None:
    """Count and log a command that is skipped, naming where it is on the failure
    topic and, once parsed, the raw record it names."""
    metrics.invalid_commands.labels(reason).inc()
    if isinstance(command, Command):
        where, fields = command.ref, command_fields(command)
    else:
        where = source_ref(command.topic, command.partition, command.offset)
        fields = {"command": where}
    logger.warning(
        "invalid failure command at %s skipped (%s): %s", where, reason, detail,
        extra={**fields, "reason": reason},
    )  # fmt: skip


def stale(metrics: Metrics, cmd: Command, what: str, why: str) -> None:
    """A command that changes nothing: counted `stale`, logged as `what for ID (REF): why`."""
    metrics.releases.labels("stale").inc()
    logger.info(
        "%s for %s (%s): %s", what, cmd.readable_id, cmd.ref, why, extra=command_fields(cmd)
    )


def undecided(
    metrics: Metrics,
    part: CommandPartition,
    rec: Record,
    cmd: Command,
    answers: Sequence[int | str],
    majority: int,
) -> int:
    """No majority of counted members agreed on a command: its partition waits there
    (the offset to rewind to) and tries again after `backoff_initial`."""
    metrics.releases.labels("no_quorum").inc()
    logger.warning(
        "no majority decided failure command %s for %s (counted answers %s, %d needed): "
        "its partition waits", cmd.ref, cmd.readable_id, answers, majority,
        extra=command_fields(cmd),
    )  # fmt: skip
    rewind: int = rec.offset
    part.next_offset = rewind
    return rewind


def command_fields(cmd: Command) -> dict[str, str | int]:
    """Log fields of a command: the raw record it names, and where the command is."""
    return {**coordinates(cmd.topic, cmd.partition, cmd.offset), "command": cmd.ref}
