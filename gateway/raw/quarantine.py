"""Quarantine that says what it means: a wrong `[dedup] id` is told from bad records.

An id that matches nothing (`id = "header:message-id"` on records that carry their id
in the JSON body) quarantines every record, and nothing else goes wrong: the data path
runs, offsets are committed, nothing is lost. `QuarantineWatch` makes that visible:

- the per-record warning (`quarantined REF: REASON: ...`) is rate-limited per reason:
  at most `LOG_BURST` lines per `LOG_EVERY_S`, then one line per reason saying how
  many more were not logged one by one (`... and K more quarantined as REASON`); the counter
  `dedup_gateway_records_quarantined_total` has every one;
- once a second (`tick`, from the readiness report of gateway/service/app.py) the
  share of the raw records consumed over `[dedup] quarantine_alarm_window` that were
  quarantined is computed from the counters (`dedup_gateway_quarantine_share`); above
  `[dedup] quarantine_alarm_share`, with at least `MIN_RECORDS` consumed in the
  window, the alarm is on (`dedup_gateway_quarantine_alarm` 1): one summary line
  naming the setting to check, and /readyz answers 200 with a body that starts with
  `degraded:` (the gateway works, as a member not answering leaves it working: the
  records are kept on the quarantine topic; alert DedupGatewayQuarantineShare).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from gateway.config import Settings, format_duration
from gateway.contract.records import Record, source_ref
from gateway.errors import BadRecord
from gateway.metrics import Metrics

logger = logging.getLogger(__name__)

LOG_BURST = 5  # per-record lines per reason per LOG_EVERY_S
LOG_EVERY_S = 10.0
# Fewer raw records than this in the window are too few to judge a share on.
MIN_RECORDS = 10


@dataclass
class _Reason:
    """One reason's per-record lines in the current period."""

    since: float
    logged: int = 0
    more: int = 0  # not logged one by one
    first: str = ""  # the first and last of those, `topic/partition/offset`
    last: str = ""


@dataclass
class _Sample:
    at: float
    consumed: int
    quarantined: dict[str, int] = field(default_factory=dict)


class QuarantineWatch:
    def __init__(
        self,
        settings: Settings,
        metrics: Metrics,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.id = settings.dedup.id
        self.threshold = settings.dedup.quarantine_alarm_share
        self.window = settings.dedup.quarantine_alarm_window
        self.metrics = metrics
        self.clock = clock
        self.reasons: dict[str, _Reason] = {}
        self.examples: dict[str, str] = {}  # reason -> the latest record's detail
        self.samples: deque[_Sample] = deque()
        self.alarm: str | None = None  # what /readyz says while the alarm is on

    def note(self, rec: Record, exc: BadRecord) -> None:
        """A raw record set aside: logged, unless its reason was logged `LOG_BURST`
        times in this period (then counted, and said in one line at its end)."""
        now = self.clock()
        where = source_ref(rec.topic, rec.partition, rec.offset)
        self.examples[exc.reason] = exc.detail
        state = self.reasons.get(exc.reason)
        if state is None or now - state.since >= LOG_EVERY_S:
            if state is not None:
                self._said_more(exc.reason, state)
            state = self.reasons[exc.reason] = _Reason(now)
        if state.logged < LOG_BURST:
            state.logged += 1
            logger.warning(
                "quarantined %s: %s", where, exc,
                extra={"topic": rec.topic, "partition": rec.partition, "offset": rec.offset},
            )  # fmt: skip
            return
        state.more += 1
        state.first = state.first or where
        state.last = where

    def _said_more(self, reason: str, state: _Reason) -> None:
        if state.more:
            logger.warning(
                "... and %d more quarantined as %s in %gs (%s .. %s), not logged one by one: "
                "dedup_gateway_records_quarantined_total counts every one",
                state.more, reason, LOG_EVERY_S, state.first, state.last,
            )  # fmt: skip

    def tick(self) -> None:
        """Say the counts of periods that ended; compute the share and the alarm."""
        now = self.clock()
        for reason, state in list(self.reasons.items()):
            if now - state.since >= LOG_EVERY_S:
                self._said_more(reason, state)
                del self.reasons[reason]
        quarantined = {
            sample.labels["reason"]: int(sample.value)
            for metric in self.metrics.quarantined.collect()
            for sample in metric.samples
            if sample.name.endswith("_total")
        }
        self.samples.append(_Sample(now, self.metrics.consumed(), quarantined))
        start = now - self.window.total_seconds()
        while len(self.samples) > 1 and self.samples[1].at <= start:
            self.samples.popleft()  # the oldest kept is the last at or before the start
        base, latest = self.samples[0], self.samples[-1]
        consumed = latest.consumed - base.consumed
        by_reason = {
            reason: count - base.quarantined.get(reason, 0)
            for reason, count in latest.quarantined.items()
            if count > base.quarantined.get(reason, 0)
        }
        count = sum(by_reason.values())
        share = min(1.0, count / consumed) if consumed >= MIN_RECORDS else 0.0
        self.metrics.quarantine_share.set(share)
        if share > self.threshold:
            self._alarm_on(share, count, consumed, by_reason)
        elif self.alarm is not None:
            self.alarm = None
            self.metrics.quarantine_alarm.set(0)
            logger.info(
                "quarantine share back to %.0f%% of raw records over the last %s (at most "
                "%.0f%%): /readyz no longer degraded",
                share * 100, format_duration(self.window), self.threshold * 100,
            )  # fmt: skip

    def _alarm_on(self, share: float, count: int, consumed: int, by_reason: dict[str, int]) -> None:
        reasons = ", ".join(
            f"{reason} {n} ({self.examples.get(reason, reason)})"
            for reason, n in sorted(by_reason.items(), key=lambda item: -item[1])
        )
        window, counts = format_duration(self.window), f"{count} of {consumed}: {reasons}"
        first = self.alarm is None
        self.alarm = (
            f"quarantined {share:.0%} of raw records over the last {window} ({counts}); "
            f"check [dedup] id = {self.id!r}"
        )
        self.metrics.quarantine_alarm.set(1)
        if first:
            logger.warning(
                "quarantined %.0f%% of raw records over the last %s (%s), more than "
                "[dedup] quarantine_alarm_share %s: check [dedup] id = %r first (does it "
                "name where these records carry their id?), then the producers; the "
                "records are kept on the quarantine topic, /readyz says degraded "
                "(docs/runbooks.md, DedupGatewayQuarantineShare)",
                share * 100, window, counts, self.threshold, self.id,
            )  # fmt: skip

    def degraded(self) -> str | None:
        """For /readyz: what the alarm says while it is on."""
        return self.alarm
