"""Coalescing windows: of many versions of one entity within a window, only the latest
is forwarded, when the window closes (RMQ's range-merge type, crash-safe on Kafka).

After dedup by id (exact copies are dropped first), each decided-new record names
an entity with `[coalesce] key` (the `[dedup] id` syntax; a record without one
is quarantined as `no_coalesce_key` before it claims its id) and belongs to a window:

- `fixed`: the window of `window` that holds its timestamp, [start, start + window);
- `trailing`: the key's open window, which closes `window` after its newest
  update's timestamp and at most `max_window` after its start; an update past
  that opens the next window.

1. **Update** (raw path, before the raw offsets are committed): every instance
   keeps, per window, the newest version seen (timestamp, then source
   coordinates: `version`) and the number of updates (`scripts.COALESCE_UPDATE`).
2. **Wait**: the record goes to a delay tier (gateway/delay.py), due when its
   window closes as far as it knows, with `dedup-window: <start>/<close>`.
3. **Close** (the delay loop, when the record is due): the instances are read
   (`scripts.COALESCE_CLOSE`) and `at_close` decides: a counted instance holds a
   newer version: dropped (merged); the window was extended (trailing): wait
   again; fewer than a majority answered: asked again later; else forwarded to
   the clean topic with `dedup-coalesced: <updates>` and the final `dedup-window`.

Why only the newest emits, once: an update reaches a majority before its raw
offset is committed, so of any two versions a majority saw, one instance that
answers at close saw both, and the older one's record finds the newer there.
State and waiting records live in Redis and Kafka, so a SIGKILL loses no
window: a replayed move repeats the same `dedup-token` (the Spark job keeps one).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
import zlib
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta

from gateway.config import Settings
from gateway.errors import BadRecord
from gateway.ids import IdExtractor, build_extractor
from gateway.keys import mark_digest
from gateway.metrics import Metrics
from gateway.quorum import Quorum
from gateway.records import H_COALESCED, H_SOURCE, H_WINDOW, Headers, OutRow, Record

logger = logging.getLogger(__name__)


def now_ms() -> int:
    """The wall clock in epoch milliseconds (due times and windows are compared to it)."""
    return time.time_ns() // 1_000_000


UPDATE_TRIES = 5  # rounds of an update that a majority has not answered yet
UPDATE_RETRY_S = 0.2
ASK_AGAIN_MS = 1000  # a close that no majority answered is asked again after this
_MS = timedelta(milliseconds=1)


def version(timestamp_ms: int, topic: str, partition: int, offset: int) -> str:
    """A record's version as a fixed-width digit string: comparing two versions as
    strings (in Python and in Lua alike) compares timestamps, then source coordinates
    (the topic by its CRC-32: any fixed order will do for ties)."""
    return (
        f"{max(timestamp_ms, 0):015d}{zlib.crc32(topic.encode()):010d}{partition:010d}{offset:019d}"
    )


class Verdict(enum.Enum):
    EMIT = "emit"  # the newest version of a closed window: forward it
    DROP = "drop"  # a newer version exists: merged into it
    WAIT = "wait"  # the window closes later than this record thought
    ASK_AGAIN = "ask_again"  # fewer than a majority answered


@dataclass(frozen=True)
class Closing:
    verdict: Verdict
    close_ms: int = 0  # EMIT: the window's end; WAIT: when to look again
    updates: int = 0  # EMIT: updates the window took


@dataclass(frozen=True)
class WindowShape:
    mode: str  # "fixed" or "trailing"
    window_ms: int
    max_window_ms: int

    def close(self, start: int, newest: int) -> int:
        """When the window that began at `start` closes, its newest update at `newest`."""
        if self.mode == "fixed":
            return start + self.window_ms
        return min(max(newest, start) + self.window_ms, start + self.max_window_ms)


def at_close(
    mine: str,
    start: int,
    answers: Sequence[tuple[str, int, int] | None],
    majority: int,
    shape: WindowShape,
    now: int,
) -> Closing:
    """The close decision for one waiting record (pure): `answers` are the counted
    instances' (newest version, updates, newest timestamp), None for no answer."""
    counted = [a for a in answers if a is not None]
    if any(held > mine for held, _, _ in counted):
        return Closing(Verdict.DROP)
    if len(counted) < majority:
        return Closing(Verdict.ASK_AGAIN, now + ASK_AGAIN_MS)
    close = shape.close(start, max(newest for _, _, newest in counted))
    if close > now:
        return Closing(Verdict.WAIT, close)
    return Closing(Verdict.EMIT, close, max(1, *(n for _, n, _ in counted)))


def agreed_start(starts: Sequence[int]) -> int | None:
    """The window start most instances answered (ties: the earliest); None if none did."""
    if not starts:
        return None
    counts = Counter(starts)
    return min(counts, key=lambda s: (-counts[s], s))


def window_header(start: int, close: int) -> tuple[str, bytes]:
    return (H_WINDOW, f"{start}/{close}".encode())


def parse_window(headers: Headers) -> tuple[int, int] | None:
    """(start, close) of a waiting record's `dedup-window`; None when it has none.
    Raises ValueError when it is not two integers."""
    for name, value in headers:
        if name == H_WINDOW:
            start, _, close = (value or b"").partition(b"/")
            return int(start), int(close)
    return None


def source_of(headers: Headers) -> tuple[str, int, int]:
    """The raw record's coordinates from its `dedup-source` (the topic may hold '/')."""
    for name, value in reversed(headers):
        if name == H_SOURCE:
            topic, partition, offset = (value or b"").decode().rsplit("/", 2)
            return topic, int(partition), int(offset)
    raise ValueError("no dedup-source header")


class _Row:
    """A clean row seen as a record, for the key extractor (key, value, headers)."""

    __slots__ = ("headers", "key", "timestamp", "value")

    def __init__(self, key: bytes | None, value: bytes | None, headers: Headers) -> None:
        self.key, self.value, self.headers, self.timestamp = key, value, headers, None


class Coalescer:
    """Both sides of coalescing: updates on the raw path, close decisions in the delay loop."""

    def __init__(self, settings: Settings, quorum: Quorum, metrics: Metrics) -> None:
        c = settings.coalesce
        self.key_of = build_extractor(c.key, settings.dedup.max_id_bytes)
        self.shape = WindowShape(c.mode, c.window // _MS, c.max_window // _MS)
        self.quorum = quorum
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
        """Write each decided-new row's version into its window on every instance; each
        row with `dedup-window` and when it is due to be looked at (its window's close
        as far as the instances know)."""
        if not rows:
            return []
        digests, stamps, versions = [], [], []
        for key, value, timestamp, headers, _ in rows:
            topic, partition, offset = source_of(headers)
            ts = max(timestamp or 0, 0)
            digests.append(self.key_digest(key, value, headers))
            stamps.append(ts)
            versions.append(version(ts, topic, partition, offset))
        answers = await self._update_on_a_majority(digests, stamps, versions)
        counted = self.quorum.counted()
        out: list[tuple[OutRow, int]] = []
        opened = 0
        for i, (row, ts) in enumerate(zip(rows, stamps, strict=True)):
            said = [a[i] for a, c in zip(answers, counted, strict=True) if a is not None and c]
            start = agreed_start([s for s, _ in said])
            if start is None:  # no counted answer: the record's own window
                start = ts - ts % self.shape.window_ms if self.shape.mode == "fixed" else ts
            opened += sum(o for _, o in said) * 2 > len(said)
            close = self.shape.close(start, ts)
            key, value, timestamp, headers, partition = row
            out.append(
                ((key, value, timestamp, [*headers, window_header(start, close)], partition), close)
            )
        self.metrics.coalesce_updates.inc(len(rows))
        self.metrics.coalesce_windows_opened.inc(opened)
        return out

    async def _update_on_a_majority(
        self, digests: list[bytes], stamps: list[int], versions: list[str]
    ) -> list[list[tuple[int, bool]] | None]:
        """The update, tried again (on the instances that did not answer) until a
        majority of counted instances took it, at most UPDATE_TRIES times."""
        answers: list[list[tuple[int, bool]] | None] = [None] * self.quorum.size
        c = self.shape
        for attempt in range(UPDATE_TRIES):
            replies = await self.quorum.coalesce_update(
                digests, stamps, versions, c.mode, c.window_ms, c.max_window_ms,
                on=[a is None for a in answers],  # again only where it was not taken
            )  # fmt: skip
            answers = [a if a is not None else r for a, r in zip(answers, replies, strict=True)]
            taken = sum(
                a is not None and ok for a, ok in zip(answers, self.quorum.counted(), strict=True)
            )
            if taken >= self.quorum.majority:
                break
            logger.warning(
                "coalesce update taken by %d of %d instances (attempt %d)",
                taken, self.quorum.size, attempt + 1,
            )  # fmt: skip
            await asyncio.sleep(UPDATE_RETRY_S)
        return answers

    async def close(self, waiting: Sequence[Record]) -> list[Closing]:
        """The close decision of each due record (`at_close`), read from every instance."""
        digests, starts, mine = [], [], []
        for rec in waiting:
            window = parse_window(rec.headers)
            assert window is not None  # the delay loop sends only records with one
            topic, partition, offset = source_of(rec.headers)
            digests.append(self.key_digest(rec.key, rec.value, rec.headers))
            starts.append(window[0])
            mine.append(version(max(rec.timestamp or 0, 0), topic, partition, offset))
        answers = await self.quorum.coalesce_close(digests, starts)
        counted = self.quorum.counted()
        now = now_ms()
        closings = []
        for i, (start, v) in enumerate(zip(starts, mine, strict=True)):
            said = [a[i] if a is not None and c else None
                    for a, c in zip(answers, counted, strict=True)]  # fmt: skip
            closings.append(at_close(v, start, said, self.quorum.majority, self.shape, now))
        return closings

    def emitted(self, headers: Headers, closing: Closing) -> list[tuple[str, bytes]]:
        """A closed window's clean headers: the final `dedup-window`, `dedup-coalesced`."""
        start, _ = parse_window(headers) or (0, 0)
        kept = [(k, v) for k, v in headers if k not in (H_WINDOW, H_COALESCED)]
        return [
            *kept,
            window_header(start, closing.close_ms),
            (H_COALESCED, str(closing.updates).encode()),
        ]
