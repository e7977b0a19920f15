"""One batch through the data path: extract ids, vote, classify, forward.

The ordering rule that makes the gateway crash-safe: marks are claimed with
the source record's own owner token *before* forwarding, and offsets are
committed only *after* the broker acknowledged everything the batch forwarded
(gateway/checkpoint.py). A crash anywhere in between replays the batch; the
replayed records find marks they own, so they are forwarded again (a bounded
duplicate), never dropped.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import compress
from typing import Any, Literal, cast

from aiokafka import TopicPartition

from gateway.coalesce import Coalescer
from gateway.config import Settings
from gateway.delay import Router
from gateway.errors import BadRecord
from gateway.ids import build_extractor
from gateway.keys import mark_digest, owner_tokens
from gateway.lanes import lane_headers
from gateway.metrics import Metrics
from gateway.quorum import Quorum
from gateway.records import (
    H_UNCERTAIN,
    Headers,
    OutRecord,
    OutRow,
    Record,
    clean_rows,
    quarantine_record,
    source_ref,
)
from gateway.sink import Prepared, Sink
from gateway.vote import MINE, TOOK_OVER, Outcome, decide, holder

logger = logging.getLogger(__name__)

Policy = Literal["block", "forward", "drop"]


@dataclass(slots=True)
class PartitionBatch:
    """One partition's records of a batch as parallel lists: no object per record."""

    records: Sequence[Record]
    ids: list[bytes | BadRecord]  # per record: its id, or why it has none
    tokens: list[str]  # per record: its owner token
    bad: int  # records without an id
    outcomes: Sequence[Outcome | None] = ()  # per record, from the vote; None: no id
    extra: Headers = ()  # headers every clean copy gains (`dedup-lane`)
    to: str | None = None  # its lane's own clean topic; None: `[kafka] clean_topic`


@dataclass
class Decided:
    """A classified batch: what to forward, set aside, commit and block."""

    forward: list[OutRow] = field(default_factory=list)  # to `[kafka] clean_topic`
    forward_to: dict[str, list[OutRow]] = field(default_factory=dict)  # to a lane's own topic
    quarantine: list[tuple[Record, BadRecord]] = field(default_factory=list)
    commits: dict[TopicPartition, int] = field(default_factory=dict)  # next offset to read
    blocked: dict[TopicPartition, int] = field(default_factory=dict)  # rewind here, pause
    duplicates: int = 0
    undecided: dict[str, int] = field(default_factory=dict)  # by action taken
    # Without scheduled delivery, `forward` and `forward_to` are built into produce
    # batches as soon as the batch is decided (`Pipeline.end`), then emptied:
    prepared: list[Prepared] = field(default_factory=list)
    prepared_records: int = 0
    prepared_timestamps: list[int | None] = field(default_factory=list)  # for the latency


@dataclass
class Voting:
    """A batch whose ids are being claimed (`Pipeline.begin` to `Pipeline.end`)."""

    parts: dict[TopicPartition, PartitionBatch]
    outcomes: asyncio.Future[list[Outcome]]  # the vote, running
    started: float = field(default_factory=time.perf_counter)
    # Partitions rewound since the batch was fetched (a block in the batch before):
    # their records here are read again, so they are neither forwarded nor committed.
    dropped: set[TopicPartition] = field(default_factory=set)

    def fetched(self) -> list[TopicPartition]:
        """The partitions whose records this batch decides."""
        return [tp for tp in self.parts if tp not in self.dropped]


def classify(batch: Mapping[TopicPartition, PartitionBatch], policy: Policy) -> Decided:
    """What to do with each voted record (pure: no I/O).

    Records are taken in partition order; under `block`, a partition stops at
    its first undecided record, which is where it will be rewound, and nothing
    after it is forwarded or committed. Per partition the work is done on
    whole lists (counts, masks, one comprehension for the clean copies).
    """
    decided = Decided()
    forward, undecided = Outcome.FORWARD, Outcome.UNDECIDED
    for tp, part in batch.items():
        records, ids, tokens, outcomes = part.records, part.ids, part.tokens, part.outcomes
        stuck = undecided in outcomes
        if stuck and policy == "block":
            end = outcomes.index(undecided)
            decided.blocked[tp] = records[end].offset
            decided.undecided[policy] = decided.undecided.get(policy, 0) + 1
            records, ids, tokens, outcomes = records[:end], ids[:end], tokens[:end], outcomes[:end]
            stuck = False
        if not records:
            continue
        decided.commits[tp] = records[-1].offset + 1
        target = decided.forward if part.to is None else decided.forward_to.setdefault(part.to, [])
        decided.duplicates += outcomes.count(Outcome.DUPLICATE)
        if part.bad:
            decided.quarantine += [
                (rec, i) for rec, i in zip(records, ids, strict=True) if isinstance(i, BadRecord)
            ]
        if not stuck:
            keep = [o is forward for o in outcomes]
            kept_ids = cast(Iterable[bytes], compress(ids, keep))  # forwarded: they have ids
            target += clean_rows(
                list(compress(records, keep)), kept_ids, compress(tokens, keep), part.extra
            )
            continue
        decided.undecided[policy] = decided.undecided.get(policy, 0) + outcomes.count(undecided)
        # Rare (no majority, policy forward/drop): record by record, keeping their order.
        for rec, i, token, outcome in zip(records, ids, tokens, outcomes, strict=True):
            if not isinstance(i, BadRecord) and (
                outcome is forward or (outcome is undecided and policy == "forward")
            ):
                extra = [(H_UNCERTAIN, b"1")] if outcome is undecided else []
                target += clean_rows([rec], [i], [token], [*part.extra, *extra])
    return decided


class Pipeline:
    def __init__(self, settings: Settings, quorum: Quorum, sink: Sink, metrics: Metrics) -> None:
        self.settings = settings
        self.quorum = quorum
        self.sink = sink
        self.metrics = metrics
        self.extract: Callable[[Record], bytes]
        self.extract = build_extractor(
            settings.dedup.id, settings.dedup.max_id_bytes, settings.kafka.max_request_bytes
        )
        self.policy: Policy = settings.dedup.on_no_quorum
        # Priority lanes (gateway/lanes.py): per raw topic, its lane's header and clean topic.
        self.lane_extra = lane_headers(settings)
        self.clean_to = {
            topic: settings.clean_topic_of(topic)
            for topic in settings.kafka.raw_topics
            if settings.clean_topic_of(topic) != settings.kafka.clean_topic
        }
        # Scheduled delivery (gateway/delay.py): bad delay headers are bad input.
        self.delay = Router(settings, metrics) if settings.delay.enabled else None
        if self.delay is not None:
            self.extract = self.delay.checked(self.extract)
        # Coalescing windows (gateway/coalesce.py): a record without a key is bad input.
        self.coalesce = Coalescer(settings, quorum, metrics) if settings.coalesce.enabled else None
        if self.coalesce is not None:
            self.extract = self.coalesce.checked(self.extract)

    async def decide(self, batch: Mapping[TopicPartition, Sequence[Record]]) -> Decided:
        """Extract ids, claim and vote, classify. Forwards nothing yet (see `finish`)."""
        return await self.end(self.begin(batch))

    def begin(self, batch: Mapping[TopicPartition, Sequence[Record]]) -> Voting:
        """Extract ids and start claiming them; `end` waits for the vote. The claims
        run while the caller does other work (gateway/source.py: the previous batch's
        vote is finished meanwhile)."""
        parts: dict[TopicPartition, PartitionBatch] = {}
        claim_ids: list[bytes] = []
        owners: list[str] = []
        for tp, records in batch.items():
            self.metrics.records_in.labels(tp.topic).inc(len(records))
            ids, bad = self._ids(records)
            tokens = owner_tokens(tp.topic, tp.partition, [r.offset for r in records])
            parts[tp] = PartitionBatch(
                records, ids, tokens, bad, extra=self.lane_extra.get(tp.topic, ()),
                to=self.clean_to.get(tp.topic),
            )  # fmt: skip
            if not bad:
                claim_ids += cast(list[bytes], ids)  # every record has an id
                owners += tokens
            else:
                for i, token in zip(ids, tokens, strict=True):
                    if not isinstance(i, BadRecord):
                        claim_ids.append(i)
                        owners.append(token)
        return Voting(parts, asyncio.ensure_future(self.vote(claim_ids, owners)))

    async def end(self, voting: Voting) -> Decided:
        """The vote's outcomes, classified; the partitions in `voting.dropped` are left out."""
        waited = time.perf_counter()
        outcomes = await voting.outcomes
        self.metrics.vote_wait.inc(time.perf_counter() - waited)
        at = 0
        parts = voting.parts
        for part in parts.values():
            if not part.bad:
                part.outcomes = outcomes[at : at + len(part.ids)]
                at += len(part.ids)
                continue
            aligned: list[Outcome | None] = []
            for i in part.ids:
                if isinstance(i, BadRecord):
                    aligned.append(None)
                else:
                    aligned.append(outcomes[at])
                    at += 1
            part.outcomes = aligned
        if voting.dropped:
            parts = {tp: part for tp, part in parts.items() if tp not in voting.dropped}
        decided = classify(parts, self.policy)
        for action, count in decided.undecided.items():
            self.metrics.undecided.labels(action).inc(count)
        if self.delay is None:  # (coalescing needs it too) what to forward is known now
            await self._prepare(decided)
        return decided

    async def _prepare(self, decided: Decided) -> None:
        """Build the clean copies' produce batches now, while their records are in the
        CPU's cache, and let the copies go (gateway/sink.py, `Sink.prepare`); they are
        sent in `finish`, in fetch order as always."""
        targets = [(self.settings.kafka.clean_topic, decided.forward), *decided.forward_to.items()]
        for topic, rows in targets:
            if rows:
                decided.prepared.append(await self.sink.prepare(topic, rows))
                decided.prepared_records += len(rows)
                decided.prepared_timestamps += [r[2] for r in rows]
        decided.forward, decided.forward_to = [], {}

    def _ids(self, records: Sequence[Record]) -> tuple[list[bytes | BadRecord], int]:
        """Each record's id, or the BadRecord saying why it has none; and how many have none."""
        try:
            return list(map(self.extract, records)), 0
        except BadRecord:  # rare: again record by record, keeping the reasons
            ids: list[bytes | BadRecord] = []
            for rec in records:
                try:
                    ids.append(self.extract(rec))
                except BadRecord as exc:
                    ids.append(exc)
            return ids, sum(isinstance(i, BadRecord) for i in ids)

    async def finish(self, decided: Decided) -> dict[TopicPartition, int]:
        """Forward a decided batch, wait for the broker's acknowledgements; the offsets
        to commit."""
        # Records not yet due go to a delay tier instead (gateway/delay.py); with
        # coalescing, every one waits there for its window's close (gateway/coalesce.py).
        if self.coalesce is not None and self.delay is not None:
            updated = await self.coalesce.update(decided.forward)
            forward, delayed = self.delay.route(
                [row for row, _ in updated], [close for _, close in updated]
            )
        elif self.delay is not None:
            forward, delayed = self.delay.route(decided.forward)
        else:
            forward, delayed = decided.forward, {}
        await asyncio.gather(
            self.deliver(self.settings.kafka.clean_topic, forward),
            *(self.deliver(tier, records) for tier, records in delayed.items()),
            *(self.deliver(topic, records) for topic, records in decided.forward_to.items()),
            *(self._acknowledged(self.sink.ship(prepared)) for prepared in decided.prepared),
        )
        now_ms = time.time() * 1000
        self.metrics.observe_forward_latency(now_ms, decided.prepared_timestamps)
        self.metrics.observe_forward_latency(now_ms, [r[2] for r in forward])
        for records in decided.forward_to.values():
            self.metrics.observe_forward_latency(now_ms, [r[2] for r in records])
        quarantine = [self._quarantined(rec, exc) for rec, exc in decided.quarantine]
        await self.deliver(self.settings.kafka.quarantine_topic, quarantine)
        self.metrics.forwarded.inc(
            decided.prepared_records
            + len(decided.forward)
            + sum(map(len, decided.forward_to.values()))
        )
        self.metrics.duplicates.inc(decided.duplicates)
        return decided.commits

    async def vote(self, ids: Sequence[bytes], owners: Sequence[str]) -> list[Outcome]:
        """Claim every id's mark for its owner on every instance, decide on the trusted
        instances' answers, repair the marks that differ from the winner, queue the
        winner's mark for the instances that gave no answer (gateway/quorum.py)."""
        if not ids:
            return []
        if not self.settings.dedup.enabled:
            return [Outcome.FORWARD] * len(ids)
        digests = list(map(mark_digest, ids))
        replies = await self.quorum.claim(digests, owners)
        counted = self.quorum.counted()
        masked = not all(counted)  # a recovering instance answers, but its answers do not count
        quorum, trusted = self.quorum.majority, sum(counted)
        outcomes: list[Outcome] = []
        repairs: list[list[tuple[bytes, str, str]]] = [[] for _ in replies]
        fills: list[list[tuple[bytes, str, str]]] = [[] for _ in replies]
        size, all_mine = len(replies), (MINE,) * len(replies)
        for digest, owner, row in zip(digests, owners, zip(*replies, strict=True), strict=True):
            if not masked:  # the common cases need no counting, and leave nothing to repair
                if row == all_mine:
                    outcomes.append(Outcome.FORWARD)
                    continue
                held = row[0]
                if type(held) is str and held[0] != TOOK_OVER and row.count(held) == size:
                    outcomes.append(Outcome.DUPLICATE)  # one other owner (or tombstone)
                    continue
            votes = [r if c else None for r, c in zip(row, counted, strict=True)] if masked else row
            decision = decide(owner, votes, quorum, trusted)
            outcomes.append(decision.outcome)
            if decision.winner is None:
                continue
            for i, reply in enumerate(row):
                if reply is None:
                    fills[i].append((digest, decision.winner, owner))
                    continue
                seen = holder(owner, reply)
                if seen != decision.winner:
                    repairs[i].append((digest, seen, decision.winner))
        if any(repairs):
            await self.quorum.repair(repairs)
        if any(fills):
            self.quorum.queue_fills(fills)
        return outcomes

    async def deliver(self, topic: str, records: Sequence[OutRow]) -> None:
        """Produce and wait for the broker's acknowledgement of every record."""
        if records:
            await self._acknowledged(self.sink.send(topic, records))

    @staticmethod
    async def _acknowledged(sending: Awaitable[list[asyncio.Future[Any]]]) -> None:
        """Wait for the broker's acknowledgement of every batch `sending` queues."""
        await asyncio.gather(*await sending)

    def _quarantined(self, rec: Record, exc: BadRecord) -> OutRecord:
        self.metrics.quarantined.labels(exc.reason).inc()
        where = source_ref(rec.topic, rec.partition, rec.offset)
        logger.warning(
            "quarantined %s: %s", where, exc,
            extra={"topic": rec.topic, "partition": rec.partition, "offset": rec.offset},
        )  # fmt: skip
        return quarantine_record(rec, str(exc), self.settings.kafka.max_request_bytes)
