"""The raw path's side of scheduled delivery: a decided-new record due later goes to a tier."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence

from gateway.config import Settings
from gateway.contract.records import (
    H_DELIVER_AT,
    H_TIER_AT,
    Headers,
    OutRow,
    Record,
)
from gateway.delay.coalescer import now_ms
from gateway.errors import BadRecord
from gateway.metrics import Metrics
from gateway.rules.ids import IdExtractor
from gateway.rules.tiers import (
    Tiers,
    millis,
    pick_tier,
    requested_due,
)


class Router:
    """The raw path's side: refuse bad delay headers, send what is not yet due to a tier."""

    def __init__(self, settings: Settings, metrics: Metrics) -> None:
        delay = settings.delay
        self.at_name = delay.deliver_at_header
        self.after_name = delay.deliver_after_header
        self.max_delay_ms = millis(delay.max_delay)
        self.tiers = Tiers(settings)
        self.metrics = metrics

        for label in self.tiers.labels:  # every tier's series exists from the start
            metrics.delayed.labels(label)
            metrics.delay_backlog.labels(label).set(0)

    def due(self, headers: Headers, timestamp_ms: int | None) -> int | None:
        now = now_ms()
        base = timestamp_ms if timestamp_ms is not None and timestamp_ms >= 0 else now
        due = requested_due(headers, base, self.at_name, self.after_name, self.max_delay_ms)
        # A timestamp in the future (a producer's clock) must not stretch the wait past
        # the mark's life: the mark is written now. A replay is later, so it agrees.
        if due is not None and due - now > self.max_delay_ms:
            raise BadRecord(
                "delay_too_long",
                f"due {(due - now) / 1000:.0f}s from now (the record's timestamp is ahead of "
                f"this clock); [delay] max_delay is {self.max_delay_ms / 1000:.0f}s",
            )
        return due

    def checked(self, extract: IdExtractor) -> Callable[[Record], bytes]:
        """`extract`, also refusing (BadRecord) a record whose delay headers are bad, so it
        is quarantined before it claims its id."""

        def extract_checked(record: Record) -> bytes:
            message_id = extract(record)
            self.due(record.headers, record.timestamp)
            return message_id

        return extract_checked

    def route(
        self, records: Sequence[OutRow], closes: Sequence[int] | None = None
    ) -> tuple[list[OutRow], dict[str, list[OutRow]]]:
        """Split decided-new records: (due now, for the clean topic; per tier topic, the rest).

        Records that asked for a delay gain `dedup-deliver-at`; tier copies also
        `dedup-tier-at`. The headers were checked on the way in (`checked`).
        With `closes` (coalescing, gateway/delay/coalescer.py), every record waits in a
        tier until its window's close at least: its close is decided there.
        """
        now = now_ms()
        clean: list[OutRow] = []
        delayed: dict[str, list[OutRow]] = defaultdict(list)
        for i, rec in enumerate(records):
            key, value, timestamp_ms, rec_headers, source_partition = rec
            # Checked at extraction (`checked`); not again against this clock, which may
            # have stepped back since (that raised here, past the vote, and took the
            # gateway down): the wait it gives is the one checked, in real time.
            base = timestamp_ms if timestamp_ms is not None and timestamp_ms >= 0 else now
            due = requested_due(rec_headers, base, self.at_name, self.after_name,
                                self.max_delay_ms)  # fmt: skip
            if closes is not None:
                due = max(due or 0, closes[i])
            if due is None:
                clean.append(rec)
                continue
            headers = [*rec_headers, (H_DELIVER_AT, str(due).encode())]
            if due <= now and closes is None:
                clean.append((key, value, timestamp_ms, headers, source_partition))
                continue
            tier = pick_tier(due - now, self.tiers.ms) or 0  # shorter than all: the smallest
            headers.append((H_TIER_AT, str(now).encode()))
            delayed[self.tiers.topics[tier]].append(
                (key, value, timestamp_ms, headers, source_partition)
            )
        for topic, moved in delayed.items():
            self.metrics.delayed.labels(self.tiers.labels[self.tiers.by_topic[topic]]).inc(
                len(moved)
            )
        return clean, delayed
