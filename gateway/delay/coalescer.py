"""Coalescing windows: of many versions of one entity within a window, only the latest
is forwarded, when the window closes (RMQ's range-merge type, crash-safe on Kafka).

After dedup by id (exact copies are dropped first), each decided-new record names
an entity with `[coalesce] key` (the `[dedup] id` syntax; a record without one
is quarantined as `no_coalesce_key` before it claims its id) and belongs to a window:

- `fixed`: the window of `window` that holds its timestamp, [start, start + window);
- `trailing`: the key's open window, which closes `window` after its newest
  update's timestamp and at most `max_window` after its start; an update past
  that opens the next window.

1. **Update** (raw path, before the raw offsets are committed): every member
   keeps, per window, the newest version seen (timestamp, then source
   coordinates: `version`) and the number of updates (`scripts.COALESCE_UPDATE`).
2. **Wait**: the record goes to a delay tier (gateway/delay/loop.py), due when its
   window closes as far as it knows (its end plus `[coalesce] grace`, by the
   gateway's clock), with `dedup-window: <start>/<end>`. An update taken after
   its window's close is counted as late (`late_by`).
3. **Close** (the delay loop, when the record is due): the members are read
   (`scripts.COALESCE_CLOSE`) and `at_close` decides: a counted member holds a
   newer version: dropped (merged); fewer than a majority answered: asked again
   later; no counted member holds this record's version: the window's state is
   gone (expired, or lost with members), quarantined (`window_expired`); the
   window was extended (trailing): wait again; else forwarded to the clean topic
   with `dedup-coalesced: <updates>` and the final `dedup-window`.

The wait is the gateway's to bound, not the producer's: a record stamped so far
ahead of the gateway's clock that its window could close more than `[delay]
max_delay` from now is windowed by the time the gateway took it (`window_stamp`);
its version (what "newest" compares) is still its own timestamp.

Why only the newest emits, once: an update reaches a majority before its raw
offset is committed, so of any two versions a majority saw, one member that
answers at close saw both, and the older one's record finds the newer there.
State and waiting records live in Redis and Kafka, so a SIGKILL loses no
window: a replayed move repeats the same `dedup-token` (the Spark job keeps one).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Protocol

from gateway.config import Settings
from gateway.contract.records import H_COALESCED, H_WINDOW, Headers, OutRow, Record, source_ref
from gateway.contract.tokens import mark_digest
from gateway.errors import BadRecord
from gateway.metrics import Metrics
from gateway.quorum.windows import Windows
from gateway.rules.ids import IdExtractor, build_extractor
from gateway.rules.windows import (
    Closing,
    Verdict,
    WindowShape,
    at_close,
    parse_window,
    place,
    source_of,
    version,
    window_header,
    window_stamp,
)

logger = logging.getLogger(__name__)


def now_ms() -> int:
    """The wall clock in epoch milliseconds (due times and windows are compared to it)."""
    return time.time_ns() // 1_000_000


UPDATE_TRIES = 5  # rounds of an update that a majority has not answered yet
UPDATE_RETRY_S = 0.2
_MS = timedelta(milliseconds=1)


class _Row:
    """A clean row seen as a record, for the key extractor (key, value, headers)."""

    __slots__ = ("headers", "key", "timestamp", "value")

    def __init__(self, key: bytes | None, value: bytes | None, headers: Headers) -> None:
        self.key, self.value, self.headers, self.timestamp = key, value, headers, None


class Counting(Protocol):
    """What the coalescer needs of the quorum: which members' answers count, and how
    many make a majority (`Quorum` is one)."""

    size: int
    majority: int

    def counted(self) -> list[bool]: ...


class Coalescer:
    """Both sides of coalescing: updates on the raw path, close decisions in the delay loop."""

    def __init__(
        self, settings: Settings, windows: Windows, counting: Counting, metrics: Metrics
    ) -> None:
        c = settings.coalesce
        self.key_of = build_extractor(c.key, settings.dedup.max_id_bytes)
        self.shape = WindowShape(c.mode, c.window // _MS, c.max_window // _MS)
        self.grace_ms = c.grace // _MS
        # A window stamp this far ahead of the gateway's clock may still close (end +
        # grace) within max_delay; config.py keeps it at 0 or more.
        self.ahead_ms = (settings.delay.max_delay - c.longest - c.grace) // _MS
        self.counting = counting  # who counts, and the majority
        self.windows = windows  # the calls on the windows' state
        self.metrics = metrics

    def checked(self, extract: IdExtractor) -> Callable[[Record], bytes]:
        """`extract`, also refusing a record without a usable coalesce key (BadRecord),
        so it is quarantined before it claims its id."""
        key_of = self.key_of

        def extract_checked(record: Record) -> bytes:
            message_id = extract(record)
            try:
                key_of(record)
            except BadRecord as exc:
                raise BadRecord("no_coalesce_key", str(exc)) from None
            return message_id

        return extract_checked

    def key_digest(self, key: bytes | None, value: bytes | None, headers: Headers) -> bytes:
        return mark_digest(self.key_of(_Row(key, value, headers)))

    async def update(self, rows: Sequence[OutRow]) -> list[tuple[OutRow, int]]:
        """Write each decided-new row's version into its window on every member; each
        row with `dedup-window` and when it is due to be looked at (its window's close,
        end + grace, as far as the members know). Counts the late updates."""
        if not rows:
            return []
        now = now_ms()
        digests, stamps, versions = [], [], []
        ahead: list[str] = []
        for key, value, timestamp, headers, _ in rows:
            topic, partition, offset = source_of(headers)
            ts = max(timestamp or 0, 0)
            digests.append(self.key_digest(key, value, headers))
            stamps.append(window_stamp(ts, now, self.ahead_ms))
            versions.append(version(ts, topic, partition, offset))
            if stamps[-1] != ts:
                ahead.append(source_ref(topic, partition, offset))
        if ahead:
            logger.warning(
                "coalesce: %d record(s) stamped more than %.0fs ahead of this clock, windowed "
                "by it instead, e.g. %s", len(ahead), self.ahead_ms / 1000, ahead[0],
            )  # fmt: skip
        answers = await self._update_on_a_majority(digests, stamps, versions)
        counted = self.counting.counted()
        out: list[tuple[OutRow, int]] = []
        opened = 0
        late = []
        for i, (row, ts) in enumerate(zip(rows, stamps, strict=True)):
            said = [a[i] for a, c in zip(answers, counted, strict=True) if a is not None and c]
            placed = place(self.shape, said, ts, now, self.grace_ms)
            opened += placed.opened
            if placed.lateness > 0:
                late.append(placed.lateness)
            key, value, timestamp, headers, partition = row
            header = window_header(placed.start, placed.close)
            copy = (key, value, timestamp, [*headers, header], partition)
            out.append((copy, placed.close + self.grace_ms))
        self.metrics.coalesce_updates.inc(len(rows))
        self.metrics.coalesce_windows_opened.inc(opened)
        self.metrics.coalesce_late.inc(len(late))
        for lateness in late:
            self.metrics.coalesce_update_lateness.observe(lateness / 1000)
        return out

    async def _update_on_a_majority(
        self, digests: list[bytes], stamps: list[int], versions: list[str]
    ) -> list[list[tuple[int, bool, int]] | None]:
        """The update, tried again (on the members that did not answer) until a
        majority of counted members took it, at most UPDATE_TRIES times."""
        answers: list[list[tuple[int, bool, int]] | None] = [None] * self.counting.size
        c = self.shape
        for attempt in range(UPDATE_TRIES):
            replies = await self.windows.coalesce_update(
                digests, stamps, versions, c.mode, c.window_ms, c.max_window_ms,
                on=[a is None for a in answers],  # again only where it was not taken
            )  # fmt: skip
            answers = [a if a is not None else r for a, r in zip(answers, replies, strict=True)]
            taken = sum(
                a is not None and ok for a, ok in zip(answers, self.counting.counted(), strict=True)
            )
            if taken >= self.counting.majority:
                break
            logger.warning(
                "coalesce update taken by %d of %d members (attempt %d)",
                taken, self.counting.size, attempt + 1,
            )  # fmt: skip
            await asyncio.sleep(UPDATE_RETRY_S)
        return answers

    async def close(self, waiting: Sequence[Record]) -> list[Closing]:
        """The close decision of each due record (`at_close`), read from every member;
        BAD for one whose headers were not written by a gateway (the others go on)."""
        closings: list[Closing | None] = [None] * len(waiting)
        asked, digests, starts, mine = [], [], [], []
        for n, rec in enumerate(waiting):
            try:
                window = parse_window(rec.headers)
                if window is None:
                    raise ValueError("no dedup-window header")
                topic, partition, offset = source_of(rec.headers)
                digest = self.key_digest(rec.key, rec.value, rec.headers)
            except ValueError as exc:  # a BadRecord (no key) too
                closings[n] = Closing(Verdict.BAD, problem=f"bad_tier_record: {exc}")
                continue
            asked.append(n)
            digests.append(digest)
            starts.append(window[0])
            mine.append(version(max(rec.timestamp or 0, 0), topic, partition, offset))
        answers = await self.windows.coalesce_close(digests, starts)
        counted = self.counting.counted()
        now = now_ms()
        for i, (n, start, v) in enumerate(zip(asked, starts, mine, strict=True)):
            said = [a[i] if a is not None and c else None
                    for a, c in zip(answers, counted, strict=True)]  # fmt: skip
            closings[n] = at_close(
                v, start, said, self.counting.majority, self.shape, now, self.grace_ms
            )
        return [c for c in closings if c is not None]

    def emitted(self, headers: Headers, closing: Closing) -> list[tuple[str, bytes]]:
        """A closed window's clean headers: the final `dedup-window`, `dedup-coalesced`."""
        start, _ = parse_window(headers) or (0, 0)
        kept = [(k, v) for k, v in headers if k not in (H_WINDOW, H_COALESCED)]
        return [
            *kept,
            window_header(start, closing.close_ms),
            (H_COALESCED, str(closing.updates).encode()),
        ]
