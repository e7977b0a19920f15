"""The coalescing windows' close in the delay loop: each due coalesced record's window
decided (gateway/delay/coalescer.py), and where the record goes from there."""

from __future__ import annotations

from gateway.contract.records import H_DELIVER_AT, OutRecord
from gateway.delay.coalescer import Coalescer as Closer
from gateway.delay.held import Held, TierRecords
from gateway.kafka.due import DueQueue
from gateway.metrics import Metrics
from gateway.rules.tiers import Tiers, pick_tier, replace_tier_at
from gateway.rules.windows import WINDOW_EXPIRED, Verdict


class WindowCloses:
    """Decides the windows of the delay loop's due coalesced records."""

    def __init__(
        self,
        closer: Closer,
        records: TierRecords,
        tiers: Tiers,
        held: DueQueue[Held],
        metrics: Metrics,
        clean_topic: str,
        quarantine_topic: str,
    ) -> None:
        self.closer = closer
        self.records = records
        self.tiers = tiers
        self.held = held  # the loop's held records: one that waits here goes back there
        self.metrics = metrics
        self.clean_topic = clean_topic
        self.quarantine_topic = quarantine_topic

    async def decide(
        self,
        closing: list[Held],
        now: int,
        moves: dict[str, list[OutRecord]],
        stepped: list[Held],
    ) -> list[int]:
        """Decide the windows of due coalesced records (gateway/delay/coalescer.py): the newest
        goes to the clean topic, the superseded are dropped, the rest wait again; one
        that cannot be decided (bad headers, its window's state gone) goes to
        quarantine alone. Returns the emitted windows' close times."""
        closings = await self.closer.close([h.record for h in closing])
        emitted = []
        for held, decided in zip(closing, closings, strict=True):
            rec = held.record
            if decided.verdict is Verdict.BAD:
                moves[self.quarantine_topic].append(self.records.quarantined(rec, decided.problem))
            elif decided.verdict is Verdict.LOST:
                moves[self.quarantine_topic].append(
                    self.records.quarantined(rec, WINDOW_EXPIRED, "window_expired")
                )
            elif decided.verdict is Verdict.EMIT:
                headers = self.closer.emitted(replace_tier_at(rec.headers, None), decided)
                moves[self.clean_topic].append(
                    OutRecord(rec.key, rec.value, rec.timestamp, headers, rec.partition)
                )
                emitted.append(decided.closed_ms)
                self.metrics.coalesce_emitted.inc()
            elif decided.verdict is Verdict.DROP:
                self.metrics.coalesce_merged.inc()
            elif (
                decided.verdict is Verdict.WAIT
                and (tier := pick_tier(decided.close_ms - now, self.tiers.ms)) is not None
            ):  # extended by a later update: back to a tier until then
                headers = [(k, v) for k, v in rec.headers if k != H_DELIVER_AT]
                headers.append((H_DELIVER_AT, str(decided.close_ms).encode()))
                moves[self.tiers.topics[tier]].append(
                    OutRecord(rec.key, rec.value, rec.timestamp,
                              replace_tier_at(headers, now), rec.partition)
                )  # fmt: skip
            else:  # soon, or no majority answered: held here until then
                held.due_ms = held.step_ms = decided.close_ms
                self.held.push(held.step_ms, held)
                continue
            stepped.append(held)
        return emitted
