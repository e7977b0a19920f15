"""A tier record in memory until its next step (`Held`), and how the delay loop reads
one (`TierRecords`: its tier's delay, what its headers say, what to quarantine)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field

from gateway.contract.records import OutRecord, Record, quarantine_record, source_ref
from gateway.errors import BadRecord
from gateway.metrics import Metrics
from gateway.rules.tiers import Tiers, read_tier_record

logger = logging.getLogger("gateway.delay.loop")  # the delay loop's lines, as they were

# A tier record due further ahead than `max_delay` (+ this, for gateways' clocks that
# differ) was not written under the current settings: quarantined, not cycled through
# the largest tier past its mark's life (a lowered max_delay, or another writer).
CLOCK_SLACK_MS = 60_000


@dataclass(order=True, slots=True)
class Held:
    """A tier record in memory until its next step."""

    step_ms: int
    record: Record = field(compare=False)
    due_ms: int = field(compare=False)
    size: int = field(compare=False)
    problem: str | None = field(compare=False, default=None)  # unreadable: quarantine it
    reason: str = field(compare=False, default="bad_tier_record")  # the problem's metric label
    window: bool = field(compare=False, default=False)  # coalesced: its close is decided


class TierRecords:
    """How the delay loop reads tier records: `tiers` (and the left-over tier topics,
    topic -> delay ms), `[delay] max_delay`, and whether coalescing is on."""

    def __init__(
        self,
        tiers: Tiers,
        leftover: Mapping[str, int],
        max_delay_ms: int,
        coalescing: bool,
        metrics: Metrics,
        max_bytes: int,
    ) -> None:
        self.tiers = tiers
        self.leftover = leftover
        self.max_delay_ms = max_delay_ms
        self.coalescing = coalescing
        self.metrics = metrics
        self.max_bytes = max_bytes
        self._unclosed_logged = False

    def tier_ms(self, topic: str) -> int:
        index = self.tiers.by_topic.get(topic)
        return self.tiers.ms[index] if index is not None else self.leftover[topic]

    def label(self, topic: str) -> str:
        """A tier's metric label: its delay, or a left-over tier's topic."""
        index = self.tiers.by_topic.get(topic)
        return self.tiers.labels[index] if index is not None else topic

    def held(self, rec: Record, tier_ms: int, now: int) -> Held:
        size = size_of(rec)
        try:
            read = read_tier_record(rec.headers, tier_ms, now, self.max_delay_ms + CLOCK_SLACK_MS)
        except BadRecord as exc:  # not cycled through the largest tier past its mark's life
            problem = f"{exc}; [delay] max_delay is {self.max_delay_ms / 1000:.0f}s"
            return Held(0, rec, 0, size, problem, reason=exc.reason)
        except ValueError as exc:
            # Not written by a gateway: set it aside now rather than stop the tier.
            return Held(0, rec, 0, size, f"bad_tier_record: {exc}")
        window = read.window
        if window and not self.coalescing:
            # [coalesce] switched off while it waited: no window closes it, so it is
            # delivered when due (its window's close) as a plain delayed record.
            window = False
            self._log_unclosed(rec)
        return Held(read.step_ms, rec, read.due_ms, size, window=window)

    def _log_unclosed(self, rec: Record) -> None:
        if not self._unclosed_logged:
            self._unclosed_logged = True
            logger.warning(
                "coalesced tier records (first: %s) but [coalesce] is off: each is delivered "
                "at its window's close as a plain delayed record, every version",
                source_ref(rec.topic, rec.partition, rec.offset),
            )

    def quarantined(self, rec: Record, problem: str, reason: str = "bad_tier_record") -> OutRecord:
        self.metrics.quarantined.labels(reason).inc()
        logger.warning(
            "quarantined tier record %s: %s", source_ref(rec.topic, rec.partition, rec.offset),
            problem, extra={"topic": rec.topic, "partition": rec.partition, "offset": rec.offset},
        )  # fmt: skip
        return quarantine_record(rec, problem, self.max_bytes)


def size_of(rec: Record) -> int:
    return len(rec.key or b"") + len(rec.value or b"") + sum(len(v) for _, v in rec.headers)
