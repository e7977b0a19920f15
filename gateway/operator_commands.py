"""Operator commands: `inspect ID`, `release ID`, `redrive`, `pause MEMBER`, `resume MEMBER`.

They use the same settings file as the service, and the same scripts, so a
manual action follows the same rules as the gateway's own. Ids are exact
bytes (the CLI takes them as text, base64 or hex), so ids that are not UTF-8
can be inspected and released too. Output is aligned plain text, or one JSON
document with `output="json"`; `dry_run` reads what an action would change
and changes nothing.
"""

from __future__ import annotations

import base64
import json
import logging
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from typing import Any, Literal

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.errors import KafkaError

from gateway.config import Settings
from gateway.delay import Scan, find_waiting
from gateway.failures import release_decision
from gateway.kafka import build_consumer, build_producer, partitions_of
from gateway.keys import TOMBSTONE, dead_token, is_released, mark_digest
from gateway.metrics import Metrics
from gateway.progress import Progress
from gateway.quorum import (
    HELD_BY_ANOTHER,
    NO_LIVE_MARK,
    RELEASED,
    RELEASED_BEFORE,
    RELEASED_NOW,
    MarkView,
    Quorum,
)
from gateway.records import H_ID, H_SOURCE, PREFIX, Record, parse_source_ref, source_ref

logger = logging.getLogger(__name__)

Output = Literal["text", "json"]


def readable(message_id: bytes) -> str:
    """An id as text for people: invalid UTF-8 shown as `\\xNN` escapes."""
    return message_id.decode("utf-8", "backslashreplace")


def _id_fields(message_id: bytes) -> dict[str, str]:
    return {"id": readable(message_id), "id_b64": base64.b64encode(message_id).decode()}


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Columns padded to their widest cell, two spaces apart; nothing is cut
    (an owner token must be copied whole into `--token`)."""
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows, strict=True)]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(line, widths, strict=True)).rstrip()
             for line in (header, *rows)]  # fmt: skip
    return "\n".join(lines)


def _print_json(document: dict[str, Any]) -> None:
    print(json.dumps(document, indent=2))


async def inspect(settings: Settings, message_id: bytes, output: Output = "text") -> int:
    """Print each instance's mark for `message_id`: owner token, TTL, bucket encoding."""
    quorum = Quorum(settings.redis, Metrics())
    digest = mark_digest(message_id)
    try:
        views = await quorum.inspect(digest)
    finally:
        await quorum.close()
    names = [inst.name for inst in quorum.instances]
    if output == "json":
        waiting = await _scan(settings, message_id) if settings.delay.enabled else None
        _print_json({
            **_id_fields(message_id), "digest": digest.hex(),
            "instances": [{"instance": name, "answered": view is not None,
                           **(asdict(view) if view is not None else {})}
                          for name, view in zip(names, views, strict=True)],
            "waiting": None if waiting is None else [asdict(w) for w in waiting.waiting],
        })  # fmt: skip
        return 0
    shown = _id_fields(message_id)
    print(f"marks for id {shown['id']} (base64 {shown['id_b64']}, digest {digest.hex()})")
    rows = [_inspect_row(name, view) for name, view in zip(names, views, strict=True)]
    print(table(("instance", "owner token", "ttl", "bucket", "last handover by"), rows))
    if settings.delay.enabled:  # scheduled delivery: a read of what waits in the tiers
        await _print_waiting(settings, message_id)
    return 0


async def _scan(settings: Settings, message_id: bytes) -> Scan:
    """The delay tiers' scan, its progress on stderr (it may read many records)."""
    progress = Progress("inspect: delay tier records read")
    try:
        return await find_waiting(settings, message_id, progress)
    finally:
        progress.finish()


async def _print_waiting(settings: Settings, message_id: bytes) -> None:
    scan = await _scan(settings, message_id)
    if not scan.waiting:
        print("not waiting in any delay tier")
    else:
        print(f"waiting in delay tiers ({scan.scanned} tier records read):")
        rows = [
            [w.tier, _when(w.due_ms), _when(w.step_ms), _when(w.tier_at_ms),
             source_ref(w.topic, w.partition, w.offset), w.source]
            for w in scan.waiting
        ]  # fmt: skip
        print(table(("tier", "due", "next step", "in tier since", "at", "source"), rows))
    if not scan.complete:
        print("scan stopped at its limit: the tiers hold more")


def _inspect_row(name: str, view: MarkView | None) -> list[str]:
    if view is None:
        return [name, "NO ANSWER", "", "", ""]
    # bucket "listpack": compact; "hashtable": raise [redis] buckets
    owner = view.owner or "(none)"
    if is_released(owner):
        owner = f"released (was {owner[1:]})"
    return [name, owner, _ttl(view.ttl_ms), view.encoding or "",
            view.handed_over_by or ""]  # fmt: skip


async def release(
    settings: Settings,
    message_id: bytes,
    token: str | None,
    *,
    dry_run: bool = False,
    output: Output = "text",
) -> int:
    """Release the id's mark: only where it holds `token` when given, else whoever holds it.

    The mark becomes a tombstone (`-<token>`, gateway/keys.py): the next copy
    is new, a replay of the released source record is not. Exit code 0 when the
    gateway would count it released (failures.release_decision: free on a majority,
    released on one at least; with `dry_run`: would be), 1 otherwise.
    """
    quorum = Quorum(settings.redis, Metrics())
    digest = mark_digest(message_id)
    try:
        if dry_run:
            views = await quorum.inspect(digest)
            results = [None if v is None else _would_release(v, token) for v in views]
        elif token is not None:
            replies = await quorum.release([digest], [token])
            results = [r[0] for r in replies]
        else:
            results = await quorum.delete(digest)
    finally:
        await quorum.close()
    deleted, unmarked = sum(1 for r in results if r in RELEASED), results.count(NO_LIVE_MARK)
    answers = [r for r in results if r is not None]
    ok = release_decision(answers, quorum.majority) in ("released", "repeated")
    states = [_release_state(r, dry_run, token is not None) for r in results]
    names = [inst.name for inst in quorum.instances]
    if output == "json":
        _print_json({
            **_id_fields(message_id), "token": token, "dry_run": dry_run,
            "instances": [{"instance": n, "result": s} for n, s in zip(names, states, strict=True)],
            "deleted": deleted, "no_mark": unmarked, "size": quorum.size,
            "majority": quorum.majority, "released": ok,
        })  # fmt: skip
        return 0 if ok else 1
    print(table(("instance", "result"), list(zip(names, states, strict=True))))
    verb = "would be released" if dry_run else "released"
    free = f" (no live mark on {unmarked})" if unmarked else ""
    print(f"{verb} on {deleted} of {quorum.size} instances{free}: {'ok' if ok else 'NOT released'}")
    return 0 if ok else 1


async def set_paused(
    settings: Settings, member: str, paused: bool, *, force: bool = False,
    output: Output = "text",
) -> int:  # fmt: skip
    """Pause `member` (every gateway stops counting it and sending it claims at its
    next call, gateway/quorum.py) or resume it. A pause that would leave fewer than
    a majority of trusted members answering is refused unless `force`: every
    partition would block. Exit code 0 done, 1 refused or some key group did not
    answer (run it again), 2 no such member."""
    quorum = Quorum(settings.redis, Metrics())
    try:
        await quorum.refresh_epochs()
        target = next((i for i in quorum.instances if i.name == member), None)
        names = [i.name for i in quorum.instances]
        if target is None:
            print(f"no member {member!r}; members: {', '.join(names)}")
            return 2
        others = [i.name for i in quorum.instances if i is not target and i.up and i.trusted
                  and not i.paused]  # fmt: skip
        if paused and len(others) < quorum.majority and not force:
            done, why = (
                False,
                (
                    f"refused: only {len(others)} other members are up and trusted "
                    f"({', '.join(others) or 'none'}), fewer than a majority ({quorum.majority}); "
                    "every partition would block (--force to pause anyway)"
                ),
            )
        else:
            done = await quorum.pause(target, paused)
            why = "" if done else "some key groups did not answer: run it again"
    finally:
        await quorum.close()
    verb = "paused" if paused else "resumed"
    if output == "json":
        _print_json({"member": member, "paused": paused, "done": done, "error": why})
    else:
        print(f"{member}: {verb}" if done else f"{member}: NOT {verb}: {why}")
    return 0 if done else 1


def _would_release(view: MarkView, token: str | None) -> int:
    """What a release from `token` (scripts.RELEASE), or without one (DELETE), would
    answer on this member: 1 release now, 2 released before from that token, 3 no
    live mark, 0 not (held by another owner; without a token: absent or released)."""
    if token is None:
        return int(view.owner is not None and not is_released(view.owner))
    if view.owner is None:
        return NO_LIVE_MARK
    if view.owner == token:
        return RELEASED_NOW
    return RELEASED_BEFORE if view.owner == TOMBSTONE + token else HELD_BY_ANOTHER


def _release_state(result: int | None, dry_run: bool, with_token: bool) -> str:
    if result is None:
        return "no answer"
    if result == RELEASED_BEFORE:
        return "released before (from that token)"
    if result == NO_LIVE_MARK:
        return "no live mark"
    if result:
        return "would release" if dry_run else "released"
    return "held by another owner" if with_token else "absent / released before"


@dataclass
class _Outcome:
    """What redrive did (or, dry, would do) with one dead letter."""

    id: str
    id_b64: str
    dead_letter: str  # its coordinates on the dead-letter topic
    source: str  # the raw record it came from
    deleted: int = 0  # instances where the dead-letter mark was deleted (dry: held)
    not_held: int = 0  # instances that answered without holding it
    no_answer: int = 0
    reason: str = ""  # why it was not redriven, or skipped


async def redrive(
    settings: Settings, limit: int | None, *, dry_run: bool = False, output: Output = "text",
    verbose: bool = False, progress: Progress | None = None,
) -> int:  # fmt: skip
    """Re-inject dead-lettered records into their raw topic, as new records.

    Each record's mark is deleted where it still holds the dead-letter token,
    then the original key, value and headers go back to the raw topic. A
    record is re-injected only when a majority of instances answered (each
    deleted the mark, or did not hold it: already released, expired, or a
    previous redrive that stopped before its commit), so the copy cannot be
    judged a duplicate of the dead letter. Otherwise that partition stops
    there, uncommitted, and the exit code is 1. Progress is committed in
    group `<group_id>.redrive`, so a second run does not re-inject the same
    records. Dead letters without the gateway's headers are skipped (reported,
    exit code 1) and committed past: nothing could ever redrive them. Text output
    is a summary (a line per record with `verbose`); `progress` counts records read.
    """
    kafka = settings.kafka
    consumer = build_consumer(kafka, f"{kafka.group_id}.redrive")
    producer: AIOKafkaProducer = build_producer(kafka)
    quorum = Quorum(settings.redis, Metrics())
    run = _Redrive(settings, consumer, producer, quorum, dry_run, output == "text" and verbose)
    run.progress = progress or Progress("redrive")
    await consumer.start()
    await producer.start()
    try:
        await run.run(limit)
    finally:
        run.progress.finish()
        await quorum.close()
        await producer.stop()
        await consumer.stop()
    failed = bool(run.stopped or run.skipped)
    if output == "json":
        _print_json({"dry_run": dry_run, "redriven": [asdict(o) for o in run.redriven],
                     "not_redriven": [asdict(o) for o in run.stopped],
                     "skipped": [asdict(o) for o in run.skipped]})  # fmt: skip
        return 1 if failed else 0
    verb = "would be re-injected" if dry_run else "re-injected"
    print(f"{len(run.redriven)} dead-lettered record(s) {verb}")
    if run.skipped:
        print(f"{len(run.skipped)} skipped: no dedup-id/dedup-source headers naming a raw topic")
    if run.stopped:
        print(f"{len(run.stopped)} partition(s) stopped, uncommitted, at a record not redriven")
    return 1 if failed else 0


class _Redrive:
    def __init__(
        self,
        settings: Settings,
        consumer: AIOKafkaConsumer,
        producer: AIOKafkaProducer,
        quorum: Quorum,
        dry_run: bool,
        text: bool,
    ) -> None:
        self.settings = settings
        self.consumer = consumer
        self.producer = producer
        self.quorum = quorum
        self.dry_run = dry_run
        self.text = text
        self.redriven: list[_Outcome] = []
        self.stopped: list[_Outcome] = []
        self.skipped: list[_Outcome] = []
        self.progress = Progress("redrive")

    async def run(self, limit: int | None) -> None:
        topic = self.settings.kafka.dead_letter_topic
        active = [TopicPartition(topic, p) for p in await partitions_of(self.consumer, topic)]
        self.consumer.assign(active)
        self.progress.total = await self._waiting(active, limit)
        while active and (limit is None or len(self.redriven) < limit):
            batch = await self.consumer.getmany(*active, timeout_ms=1000, max_records=100)
            if not batch:
                return  # every partition read to its end
            for tp, records in batch.items():
                for rec in records:
                    if limit is not None and len(self.redriven) >= limit:
                        return
                    if not await self._one(tp, rec):
                        active.remove(tp)  # stop this partition here, uncommitted
                        self.consumer.pause(tp)
                        break

    async def _one(self, tp: TopicPartition, rec: Record) -> bool:
        """Redrive (or skip) one dead letter; False when its partition must stop here."""
        headers = dict(rec.headers)
        message_id = headers.get(H_ID) or b""
        where = source_ref(rec.topic, rec.partition, rec.offset)
        try:
            topic, partition, offset = parse_source_ref(headers[H_SOURCE].decode())
        except (KeyError, ValueError, UnicodeDecodeError):
            topic, partition, offset = "", 0, 0
        shown = _id_fields(message_id)
        outcome = _Outcome(
            shown["id"],
            shown["id_b64"],
            where,
            source_ref(topic, partition, offset) if topic else "",
        )
        if not message_id or not topic or topic not in self.settings.kafka.raw_topics:
            outcome.reason = "no dedup-id/dedup-source headers naming a raw topic"
            self._report(self.skipped, outcome, "SKIPPED")
            await self._commit(tp, rec)
            return True
        digest, token = mark_digest(message_id), dead_token(topic, partition, offset)
        if self.dry_run:
            views = await self.quorum.inspect(digest)
            replies: list[int | None] = [
                None if v is None else _would_release(v, token) for v in views
            ]
        else:
            replies = [r[0] for r in await self.quorum.release([digest], [token])]
        outcome.deleted = sum(1 for r in replies if r in RELEASED)
        outcome.no_answer = sum(1 for r in replies if r is None)
        outcome.not_held = len(replies) - outcome.deleted - outcome.no_answer
        # The instances that answered no longer hold the dead-letter mark: with a
        # majority of them, the re-injected copy cannot be its duplicate.
        if len(replies) - outcome.no_answer < self.quorum.majority:
            outcome.reason = (
                f"{outcome.no_answer} of {self.quorum.size} instances gave no answer; "
                "stopped here, not committed past it"
            )
            self._report(self.stopped, outcome, "NOT redriven")
            return False
        if not self.dry_run:
            original = [(k, v) for k, v in rec.headers if not k.startswith(PREFIX)]
            try:
                await self.producer.send_and_wait(topic, rec.value, key=rec.key, headers=original)
            except KafkaError as exc:
                outcome.reason = f"produce to {topic} failed: {exc!r}; stopped here"
                self._report(self.stopped, outcome, "NOT redriven")
                return False
            await self._commit(tp, rec)
        self._report(self.redriven, outcome, "would redrive" if self.dry_run else "redriven")
        return True

    async def _waiting(self, tps: list[TopicPartition], limit: int | None) -> int | None:
        """Dead letters past the group's commits (the progress total); None if unknown."""
        try:
            ends = await self.consumer.end_offsets(tps)
            starts = await self.consumer.beginning_offsets(tps)
            committed = [await self.consumer.committed(tp) for tp in tps]
        except KafkaError:
            return None
        left: int = sum(max(0, int(ends[tp]) - int(c if c is not None else starts[tp]))
                        for tp, c in zip(tps, committed, strict=True))  # fmt: skip
        return left if limit is None else min(left, limit)

    async def _commit(self, tp: TopicPartition, rec: Record) -> None:
        if not self.dry_run:
            await self.consumer.commit({tp: rec.offset + 1})

    def _report(self, into: list[_Outcome], outcome: _Outcome, verb: str) -> None:
        into.append(outcome)
        self.progress.advance()
        if self.text:
            counts = (f"deleted {outcome.deleted}, not held {outcome.not_held}, "
                      f"no answer {outcome.no_answer}")  # fmt: skip
            where = f"{outcome.dead_letter} from {outcome.source or '?'}"
            print(f"{verb} {outcome.id or '(no id)'} ({where}): {outcome.reason or counts}")


def _when(epoch_ms: int) -> str:
    return datetime.fromtimestamp(epoch_ms / 1000, UTC).isoformat(timespec="milliseconds")


def _ttl(ttl_ms: int) -> str:
    if ttl_ms == -2:
        return "absent"
    if ttl_ms == -1:
        return "no TTL"
    return f"{ttl_ms / 1000:.1f}s"
