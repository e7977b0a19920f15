"""One batch through the data path: extract ids, vote, classify, forward.

The ordering rule that makes the gateway crash-safe: marks are claimed with
the source record's own owner token *before* forwarding, and offsets are
committed only *after* the broker acknowledged everything the batch forwarded
(gateway/raw/checkpoint.py). A crash anywhere in between replays the batch; the
replayed records find marks they own, so they are forwarded again (a bounded
duplicate), never dropped.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, cast

from aiokafka import TopicPartition

from gateway.config import Settings
from gateway.contract.records import OutRecord, Record, quarantine_record
from gateway.contract.tokens import mark_digests, owner_tokens
from gateway.errors import BadRecord
from gateway.kafka.sink import Sink
from gateway.kafka.transactions import Member
from gateway.metrics import Metrics
from gateway.quorum.link import Fill
from gateway.quorum.repairs import Repair
from gateway.raw.quarantine import QuarantineWatch
from gateway.raw.routes import Direct, Routes, Send
from gateway.rules.classify import Decided, PartitionBatch, Policy, classify
from gateway.rules.ids import build_extractor
from gateway.rules.lanes import lane_headers
from gateway.rules.vote import Outcome, Reply, tally

logger = logging.getLogger(__name__)


class Voter(Protocol):
    """What the pipeline asks of the quorum (gateway/quorum/quorum.py, `Quorum`)."""

    majority: int  # how many members' answers decide

    def counted(self) -> list[bool]:
        """Per member, whether its answers count."""

    async def claim(self, digests: Sequence[bytes], owners: Sequence[str]) -> list[list[Reply]]:
        """Per member, its reply for each digest (None: no answer)."""

    async def settle(
        self, repairs: Sequence[list[Repair]], fills: Sequence[Iterable[Fill]]
    ) -> bool:
        """Repair and fill after a vote; False: the batch must be tried again."""


@dataclass
class Ready:
    """A decided batch and how its copies go out (`Routes.ready`)."""

    decided: Decided
    send: Send


@dataclass
class Voting:
    """A batch whose ids are being claimed (`Pipeline.begin` to `Pipeline.end`)."""

    parts: dict[TopicPartition, PartitionBatch]
    outcomes: asyncio.Future[list[Outcome]]  # the vote, running
    started: float = field(default_factory=time.perf_counter)
    # Partitions rewound since the batch was fetched (a block in the batch before):
    # their records here are read again, so they are neither forwarded nor committed.
    dropped: set[TopicPartition] = field(default_factory=set)
    # Who the raw consumer was in its group when the batch was fetched: the member its
    # offsets are committed as (gateway/kafka/transactions.py, `group_member`).
    member: Member = (-1, "", None)

    def fetched(self) -> list[TopicPartition]:
        """The partitions whose records this batch decides."""
        return [tp for tp in self.parts if tp not in self.dropped]


class Pipeline:
    """`routes`: where decided-new copies go (gateway/raw/routes.py; the composition
    root gives scheduled delivery's when `[delay]` is on), straight to the clean topics
    by default. `quarantine`: the gateway's watch over what is quarantined
    (gateway/raw/quarantine.py)."""

    def __init__(
        self,
        settings: Settings,
        quorum: Voter,
        sink: Sink,
        metrics: Metrics,
        *,
        routes: Routes | None = None,
        quarantine: QuarantineWatch | None = None,
    ) -> None:
        self.settings = settings
        self.quorum = quorum
        self.sink = sink
        self.metrics = metrics
        # Logs what is quarantined (rate-limited), and tells a wrong `[dedup] id`.
        self.quarantine = quarantine or QuarantineWatch(settings, metrics)
        self.routes = routes or Direct(sink, settings.kafka.clean_topic)
        # A record the route cannot carry (bad delay headers, no coalesce key) is bad input.
        self.extract: Callable[[Record], bytes] = self.routes.checked(
            build_extractor(
                settings.dedup.id, settings.dedup.max_id_bytes, settings.kafka.max_request_bytes
            )
        )
        self.policy: Policy = settings.dedup.on_no_quorum
        # Priority lanes (gateway/raw/lanes.py): per raw topic, its lane's header and clean topic.
        self.lane_extra = lane_headers(settings)
        self.clean_to = {
            topic: settings.clean_topic_of(topic)
            for topic in settings.kafka.raw_topics
            if settings.clean_topic_of(topic) != settings.kafka.clean_topic
        }

    async def decide(self, batch: Mapping[TopicPartition, Sequence[Record]]) -> Ready:
        """Extract ids, claim and vote, classify. Forwards nothing yet (see `finish`)."""
        return await self.end(self.begin(batch))

    def begin(self, batch: Mapping[TopicPartition, Sequence[Record]]) -> Voting:
        """Extract ids and start claiming them; `end` waits for the vote. The claims
        run while the caller does other work (gateway/raw/source.py: the previous batch's
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

    async def end(self, voting: Voting) -> Ready:
        """The vote's outcomes, classified; the partitions in `voting.dropped` are left out."""
        waited = time.perf_counter()
        outcomes = await voting.outcomes
        self.metrics.vote_wait.inc(time.perf_counter() - waited)
        retry = bool(outcomes) and outcomes[0] is Outcome.RETRY  # all are: tried again
        if retry:
            outcomes = [Outcome.UNDECIDED] * len(outcomes)
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
        decided = classify(parts, "block" if retry else self.policy)
        if not retry:  # a retry is not the vote's doing: behind.py logged why
            for action, count in decided.undecided.items():
                self.metrics.undecided.labels(action).inc(count)
        return Ready(decided, await self.routes.ready(decided.forward, decided.forward_to))

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

    async def finish(self, ready: Ready) -> dict[TopicPartition, int]:
        """Forward a decided batch (its route, `Routes.ready`), then quarantine what it
        sets aside, waiting for the broker's acknowledgements; the offsets to commit."""
        decided = ready.decided
        reached = await ready.send()
        self.metrics.observe_forward_latency(time.time() * 1000, reached)
        quarantine = [self._quarantined(rec, exc) for rec, exc in decided.quarantine]
        await self.sink.deliver(self.settings.kafka.quarantine_topic, quarantine)
        self.metrics.forwarded.inc(
            len(decided.forward) + sum(map(len, decided.forward_to.values()))
        )
        self.metrics.duplicates.inc(decided.duplicates)
        return decided.commits

    async def vote(self, ids: Sequence[bytes], owners: Sequence[str]) -> list[Outcome]:
        """Claim every id's mark for its owner on every member, decide on the trusted
        members' answers, repair the marks that differ from the winner, queue the
        winner's mark for the members that gave no answer (gateway/quorum/repairs.py) and
        note them behind; every outcome RETRY when that note did not stand."""
        if not ids:
            return []
        if not self.settings.dedup.enabled:
            return [Outcome.FORWARD] * len(ids)
        digests = mark_digests(ids)
        replies = await self.quorum.claim(digests, owners)
        voted = tally(digests, owners, replies, self.quorum.counted(), self.quorum.majority)
        if not await self.quorum.settle(voted.repairs, voted.fills):
            return [Outcome.RETRY] * len(ids)  # a stop would leave no trace of the fills
        return voted.outcomes

    def _quarantined(self, rec: Record, exc: BadRecord) -> OutRecord:
        self.metrics.quarantined.labels(exc.reason).inc()
        self.quarantine.note(rec, exc)  # logged, at most a few lines per reason a period
        return quarantine_record(rec, str(exc), self.settings.kafka.max_request_bytes)
