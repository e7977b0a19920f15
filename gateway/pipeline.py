"""One batch through the data path: extract ids, vote, forward, decide commits.

The ordering rule that makes the gateway crash-safe: marks are claimed with
the source record's own owner token *before* forwarding, and offsets are
committed only *after* the broker acknowledged everything the batch forwarded.
A crash anywhere in between replays the batch; the replayed records find marks
they own, so they are forwarded again (a bounded duplicate), never dropped.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias

from aiokafka import ConsumerRecord, TopicPartition

from gateway.config import Settings
from gateway.ids import BadRecord, build_extractor
from gateway.keys import mark_digest, owner_token, source_ref
from gateway.metrics import Metrics
from gateway.quorum import Quorum
from gateway.sink import OutRecord, Sink
from gateway.vote import MINE, Outcome, Reply, decide

logger = logging.getLogger(__name__)

Record: TypeAlias = ConsumerRecord[bytes, bytes]
H_ID, H_SOURCE, H_TOKEN, H_ATTEMPT = "dedup-id", "dedup-source", "dedup-token", "dedup-attempt"
H_UNCERTAIN, H_ERROR = "dedup-uncertain", "dedup-error"


@dataclass(slots=True)
class Claim:
    record: Record
    message_id: bytes
    digest: bytes
    owner: str
    attempt: int = 1
    outcome: Outcome = Outcome.UNDECIDED


@dataclass
class BatchResult:
    """What the caller must do after a batch was forwarded and acknowledged."""

    commits: dict[TopicPartition, int] = field(default_factory=dict)  # next offset to read
    blocked: dict[TopicPartition, int] = field(default_factory=dict)  # rewind here, pause
    forwarded: int = 0
    duplicates: int = 0
    quarantined: int = 0


@dataclass
class Decided:
    """A voted batch, not yet forwarded."""

    result: BatchResult
    forward: list[OutRecord]
    quarantine: list[OutRecord]


def clean_headers(
    record: Record, message_id: bytes, token: str, extra: Sequence[tuple[str, bytes]] = ()
) -> list[tuple[str, bytes]]:
    """The raw headers (minus any stale dedup-*) plus this gateway's own."""
    headers = list(record.headers)
    if any(k.startswith("dedup-") for k, _ in headers):
        headers = [(k, v) for k, v in headers if not k.startswith("dedup-")]
    headers += [
        (H_ID, message_id),
        (H_SOURCE, source_ref(record.topic, record.partition, record.offset).encode()),
        (H_TOKEN, token.encode()),
        *extra,
    ]
    return headers


class Pipeline:
    def __init__(self, settings: Settings, quorum: Quorum, sink: Sink, metrics: Metrics) -> None:
        self.settings = settings
        self.quorum = quorum
        self.sink = sink
        self.metrics = metrics
        self.extract = build_extractor(settings.dedup.id, settings.dedup.max_id_bytes)
        self.policy = settings.dedup.on_no_quorum

    async def decide(self, batch: Mapping[TopicPartition, Sequence[Record]]) -> Decided:
        """Extract ids and vote: what to forward, set aside, commit and block.

        Claims the batch's marks; forwards nothing yet (see `finish`).
        """
        result = BatchResult()
        claims: list[Claim] = []
        judged: dict[TopicPartition, list[Claim | BadRecord]] = {}  # aligned with `batch`
        for tp, records in batch.items():
            self.metrics.records_in.labels(tp.topic).inc(len(records))
            verdicts: list[Claim | BadRecord] = []
            judged[tp] = verdicts
            for rec in records:
                try:
                    message_id = self.extract(rec)
                except BadRecord as exc:
                    verdicts.append(exc)
                    continue
                owner = owner_token(rec.topic, rec.partition, rec.offset)
                claim = Claim(rec, message_id, mark_digest(message_id), owner)
                claims.append(claim)
                verdicts.append(claim)

        for claim, outcome in zip(claims, await self.vote(claims), strict=True):
            claim.outcome = outcome
        forward: list[OutRecord] = []
        quarantine: list[OutRecord] = []
        for tp, records in batch.items():
            next_offset = None
            for rec, verdict in zip(records, judged[tp], strict=True):
                if isinstance(verdict, BadRecord):
                    quarantine.append(self._quarantined(rec, verdict))
                    result.quarantined += 1
                    next_offset = rec.offset + 1
                    continue
                claim, outcome = verdict, verdict.outcome
                if outcome is Outcome.FORWARD:
                    forward.append(self._clean(claim, uncertain=False))
                    result.forwarded += 1
                elif outcome is Outcome.DUPLICATE:
                    result.duplicates += 1
                elif self.policy == "block":
                    result.blocked[tp] = rec.offset
                    self.metrics.undecided.labels("block").inc()
                    break
                elif self.policy == "forward":
                    forward.append(self._clean(claim, uncertain=True))
                    result.forwarded += 1
                    self.metrics.undecided.labels("forward").inc()
                else:
                    self.metrics.undecided.labels("drop").inc()
                next_offset = rec.offset + 1
            if next_offset is not None:
                result.commits[tp] = next_offset

        return Decided(result, forward, quarantine)

    async def finish(self, decided: Decided) -> BatchResult:
        """Forward a decided batch and wait for the broker's acknowledgements."""
        await self.deliver(self.settings.kafka.clean_topic, decided.forward)
        self._observe_latency(decided.forward)
        await self.deliver(self.settings.kafka.quarantine_topic, decided.quarantine)
        self.metrics.forwarded.inc(decided.result.forwarded)
        self.metrics.duplicates.inc(decided.result.duplicates)
        return decided.result

    async def vote(self, claims: Sequence[Claim]) -> list[Outcome]:
        """Claim every mark on every instance (one call each), decide, repair minorities."""
        if not claims:
            return []
        if not self.settings.dedup.enabled:
            return [Outcome.FORWARD] * len(claims)
        replies = await self.quorum.claim([c.digest for c in claims], [c.owner for c in claims])
        quorum = self.quorum.majority
        outcomes: list[Outcome] = []
        repairs: list[list[tuple[bytes, str, str]]] = [[] for _ in replies]
        rows: list[tuple[Reply, ...]] = list(zip(*replies, strict=True))
        all_mine = (MINE,) * len(replies)
        for claim, row in zip(claims, rows, strict=True):
            if row == all_mine:  # the common case (new everywhere, or our replay): no counting
                outcomes.append(Outcome.FORWARD)
                continue
            decision = decide(claim.owner, row, quorum)
            outcomes.append(decision.outcome)
            if decision.winner is None:
                continue
            for i, reply in enumerate(row):
                seen = claim.owner if reply == MINE else reply
                if reply is not None and seen != decision.winner:
                    assert isinstance(seen, str)
                    repairs[i].append((claim.digest, seen, decision.winner))
        if any(repairs):
            await self.quorum.repair(repairs)
        return outcomes

    async def deliver(self, topic: str, records: Sequence[OutRecord]) -> None:
        """Produce and wait for the broker's acknowledgement of every record."""
        if records:
            futures: list[asyncio.Future[Any]] = await self.sink.send(topic, records)
            await asyncio.gather(*futures)

    def _observe_latency(self, acknowledged: Sequence[OutRecord]) -> None:
        """End-to-end age of each forwarded record (raw timestamp to clean ack)."""
        now_ms = time.time() * 1000
        observe = self.metrics.forward_latency.observe
        for rec in acknowledged:
            if rec.timestamp_ms is not None:
                observe((now_ms - rec.timestamp_ms) / 1000)

    def _clean(self, claim: Claim, uncertain: bool) -> OutRecord:
        rec = claim.record
        extra: list[tuple[str, bytes]] = []
        if claim.attempt > 1:
            extra.append((H_ATTEMPT, str(claim.attempt).encode()))
        if uncertain:
            extra.append((H_UNCERTAIN, b"1"))
        headers = clean_headers(rec, claim.message_id, claim.owner, extra)
        return OutRecord(rec.key, rec.value, rec.timestamp, headers, rec.partition)

    def _quarantined(self, rec: Record, exc: BadRecord) -> OutRecord:
        self.metrics.quarantined.labels(exc.reason).inc()
        logger.warning("quarantined %s: %s", source_ref(rec.topic, rec.partition, rec.offset), exc)
        headers = [
            *rec.headers,
            (H_ERROR, str(exc).encode()),
            (H_SOURCE, source_ref(rec.topic, rec.partition, rec.offset).encode()),
        ]
        return OutRecord(rec.key, rec.value, rec.timestamp, headers, rec.partition)
