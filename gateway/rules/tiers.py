"""Delay tiers as pure rules: their names and topics, which tier a wait takes, due times,
and what a tier record's headers say (`read_tier_record`)."""

from __future__ import annotations

import re
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

from gateway.config import Settings, parse_duration
from gateway.contract.records import H_DELIVER_AT, H_TIER_AT, H_WINDOW, Headers
from gateway.errors import BadRecord

_EPOCH_MS = re.compile(rb"\d{1,15}")  # up to year 33658: larger is not a time


_MAX_DURATION_CHARS = 32


def millis(duration: timedelta) -> int:
    return duration // timedelta(milliseconds=1)


def tier_label(tier: timedelta) -> str:
    """The tier's name in its topic: the largest unit that divides it (`1s`, `16m`, `250ms`)."""
    ms = millis(tier)
    for unit, size in (("d", 86_400_000), ("h", 3_600_000), ("m", 60_000), ("s", 1000)):
        if ms % size == 0:
            return f"{ms // size}{unit}"
    return f"{ms}ms"


def tier_topic(clean_topic: str, tier: timedelta) -> str:
    return f"{clean_topic}.delay.{tier_label(tier)}"


def tier_topics(settings: Settings) -> list[str]:
    """The topics `[delay] tiers` needs, smallest tier first (they must exist)."""
    return [tier_topic(settings.kafka.clean_topic, t) for t in settings.delay.tiers]


def pick_tier(remaining_ms: int, tiers_ms: Sequence[int]) -> int | None:
    """Index of the largest tier not longer than `remaining_ms`; None when none is."""
    index = bisect_right(tiers_ms, remaining_ms) - 1
    return index if index >= 0 else None


def next_step_ms(tier_at_ms: int, tier_ms: int, due_ms: int) -> int:
    """When a tier record takes its next step: its tier's delay after entry, or due."""
    return min(tier_at_ms + tier_ms, due_ms)


def requested_due(
    headers: Headers, timestamp_ms: int, at_name: str, after_name: str, max_delay_ms: int
) -> int | None:
    """The due time (epoch ms) a raw record's headers ask for; None when they ask none.

    `deliver-at` is epoch milliseconds; `deliver-after` a duration with a unit
    (`parse_duration`) from `timestamp_ms`. Raises BadRecord (`bad_deliver_at`,
    `bad_deliver_after`, `conflicting_delay`, `delay_too_long`: due more than
    `max_delay_ms` after the timestamp). The first header of each name counts.
    """
    at = after = None
    for key, value in headers:
        if key == at_name and at is None:
            at = value or b""
        elif key == after_name and after is None:
            after = value or b""
    if at is None and after is None:
        return None
    if at is not None and after is not None:
        raise BadRecord("conflicting_delay", f"both {at_name!r} and {after_name!r} headers")
    if at is not None:
        if not _EPOCH_MS.fullmatch(at):
            raise BadRecord("bad_deliver_at", f"{at_name!r} is not epoch milliseconds: {at!r:.80}")
        due = int(at)
    else:
        assert after is not None
        try:
            if len(after) > _MAX_DURATION_CHARS:
                raise ValueError("too long")
            due = timestamp_ms + millis(parse_duration(after.decode("ascii")))
        except (ValueError, OverflowError) as exc:  # UnicodeDecodeError is a ValueError
            raise BadRecord(
                "bad_deliver_after", f"{after_name!r} is not a duration like '90s': {after!r:.80}"
            ) from exc
    if due - timestamp_ms > max_delay_ms:
        raise BadRecord(
            "delay_too_long",
            f"due {(due - timestamp_ms) / 1000:.0f}s after the record's timestamp; "
            f"[delay] max_delay is {max_delay_ms / 1000:.0f}s",
        )
    return due


@dataclass(frozen=True, slots=True)
class TierRecord:
    """What a tier record's headers say: when it is due, when it takes its next step,
    and whether it waits for its coalescing window's close."""

    due_ms: int
    step_ms: int
    window: bool


def read_tier_record(headers: Headers, tier_ms: int, now_ms: int, max_ahead_ms: int) -> TierRecord:
    """A tier record in a tier of `tier_ms`, read at `now_ms`. Raises ValueError when its
    headers were not written by a gateway, BadRecord (`delay_too_long`) when it is due
    more than `max_ahead_ms` from now (written under another `max_delay`, or by
    another writer: cycled through the largest tier, it would outlive its mark)."""
    due = epoch_ms_header(headers, H_DELIVER_AT)
    if due - now_ms > max_ahead_ms:
        raise BadRecord("delay_too_long", f"due {(due - now_ms) / 1000:.0f}s from now")
    step = next_step_ms(epoch_ms_header(headers, H_TIER_AT), tier_ms, due)
    return TierRecord(due, step, any(k == H_WINDOW for k, _ in headers))


def epoch_ms_header(headers: Headers, name: str) -> int:
    """The first `name` header as epoch milliseconds; ValueError when none or not that."""
    for key, value in headers:
        if key == name:
            if value is None or not _EPOCH_MS.fullmatch(value):
                raise ValueError(f"{name} is not epoch milliseconds: {value!r:.40}")
            return int(value)
    raise ValueError(f"no {name} header")


def replace_tier_at(headers: Headers, tier_at_ms: int | None) -> list[tuple[str, bytes]]:
    """`headers` without `dedup-tier-at`, plus a new one when `tier_at_ms` is given."""
    kept = [(k, v) for k, v in headers if k != H_TIER_AT]
    if tier_at_ms is not None:
        kept.append((H_TIER_AT, str(tier_at_ms).encode()))
    return kept


class Tiers:
    """The tier topics of one gateway: their names, delays and metric labels."""

    def __init__(self, settings: Settings) -> None:
        tiers = settings.delay.tiers
        self.ms = [millis(t) for t in tiers]
        self.labels = [tier_label(t) for t in tiers]
        self.topics = tier_topics(settings)
        self.by_topic = {topic: i for i, topic in enumerate(self.topics)}
