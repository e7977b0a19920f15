"""`dedup-gateway redrive`: send dead-lettered records back through the failure loop."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.errors import KafkaError

from gateway.config import Settings
from gateway.contract.records import H_ID, H_SOURCE, PREFIX, Record, parse_source_ref, source_ref
from gateway.contract.replies import RELEASED
from gateway.contract.tokens import dead_token, mark_digest
from gateway.errors import BrokerUnreachable
from gateway.kafka.admin import reaching_broker
from gateway.kafka.clients import build_consumer, build_producer, partitions_of
from gateway.ops.command_quorum import command_quorum
from gateway.ops.output import Output, id_fields, print_json
from gateway.ops.release import would_release
from gateway.progress import Progress
from gateway.quorum.quorum import Quorum


async def _close(quorum: Quorum, producer: AIOKafkaProducer, consumer: AIOKafkaConsumer) -> None:
    await quorum.close()
    await producer.stop()
    await consumer.stop()


@dataclass
class _Outcome:
    """What redrive did (or, dry, would do) with one dead letter."""

    id: str
    id_b64: str
    dead_letter: str  # its coordinates on the dead-letter topic
    source: str  # the raw record it came from
    deleted: int = 0  # members where the dead-letter mark was deleted (dry: held)
    not_held: int = 0  # members that answered without holding it
    no_answer: int = 0
    reason: str = ""  # why it was not redriven, or skipped


async def redrive(
    settings: Settings, limit: int | None, *, dry_run: bool = False, output: Output = "text",
    verbose: bool = False, progress: Progress | None = None,
) -> int:  # fmt: skip
    """Re-inject dead-lettered records into their raw topic, as new records.

    Each record's mark is deleted where it still holds the dead-letter token,
    then the original key, value and headers go back to the raw topic. A
    record is re-injected only when a majority of members answered (each
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
    quorum = command_quorum(settings.redis)
    run = _Redrive(settings, consumer, producer, quorum, dry_run, output == "text" and verbose)
    run.progress = progress or Progress("redrive")
    try:
        async with reaching_broker(kafka, verbose=verbose):
            await consumer.start()
            await producer.start()
    except BrokerUnreachable:  # nothing read: no progress report, the one line says why
        await _close(quorum, producer, consumer)
        raise
    try:
        await run.run(limit)
    finally:
        run.progress.finish()
        await _close(quorum, producer, consumer)
    failed = bool(run.stopped or run.skipped)
    if output == "json":
        print_json({"dry_run": dry_run, "redriven": [asdict(o) for o in run.redriven],
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
                # Every partition read to its end: the total, from offsets, also counted
                # the markers of the transactions dead letters are written in.
                self.progress.total = self.progress.done
                return
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
        shown = id_fields(message_id)
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
            views = await self.quorum.admin.inspect(digest)
            replies: list[int | str | None] = [
                None if v is None else would_release(v, token) for v in views
            ]
        else:
            replies = [r[0] for r in await self.quorum.release([digest], [token])]
        outcome.deleted = sum(1 for r in replies if r in RELEASED)
        outcome.no_answer = sum(1 for r in replies if r is None)
        outcome.not_held = len(replies) - outcome.deleted - outcome.no_answer
        # The members that answered no longer hold the dead-letter mark: with a
        # majority of them, the re-injected copy cannot be its duplicate.
        if len(replies) - outcome.no_answer < self.quorum.majority:
            outcome.reason = (
                f"{outcome.no_answer} of {self.quorum.size} members gave no answer; "
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
