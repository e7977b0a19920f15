"""Coalescing windows as pure rules (gateway/delay/coalescer.py does the I/O): a
record's version, a window's shape and close, the close decision over the members'
answers, late updates, window stamps, and the `dedup-window` / `dedup-source` headers
waiting records carry."""

from __future__ import annotations

import enum
import zlib
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from gateway.contract.records import H_SOURCE, H_WINDOW, Headers

ASK_AGAIN_MS = 1000  # a close that no majority answered is asked again after this


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
    LOST = "lost"  # no counted member holds this record's version: its state is gone
    BAD = "bad"  # its headers were not written by a gateway (`problem` says why)


@dataclass(frozen=True)
class Closing:
    verdict: Verdict
    close_ms: int = 0  # EMIT: the window's end; WAIT: when to look again
    updates: int = 0  # EMIT: updates the window took
    closed_ms: int = 0  # EMIT: when the window closed (its end + grace)
    problem: str = ""  # BAD: why


# Why a waiting record whose window state is gone is set aside, not sent: it cannot
# tell whether a newer version of its window was sent before the state went.
WINDOW_EXPIRED = (
    "window_expired: no Redis member holds this window's state (it lives [redis] ttl "
    "after the window's last update, or went with restarted members)"
)


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
    grace_ms: int = 0,
) -> Closing:
    """The close decision for one waiting record (pure): `answers` are the counted
    members' (newest version, updates, newest timestamp), None for no answer.

    A window closes `grace_ms` after its end. The record's update reached a
    majority before it waited, so a counted majority holds its version or a newer
    one; when none holds either, the state is gone and emitting could send an
    older version after a newer one already sent: LOST."""
    counted = [a for a in answers if a is not None]
    if any(held > mine for held, _, _ in counted):
        return Closing(Verdict.DROP)
    if len(counted) < majority:
        return Closing(Verdict.ASK_AGAIN, now + ASK_AGAIN_MS)
    if not any(held == mine for held, _, _ in counted):
        return Closing(Verdict.LOST)
    close = shape.close(start, max(newest for _, _, newest in counted))
    if close + grace_ms > now:
        return Closing(Verdict.WAIT, close + grace_ms)
    updates = max(1, *(n for _, n, _ in counted))
    return Closing(Verdict.EMIT, close, updates, close + grace_ms)


def late_by(shape: WindowShape, start: int, prev_newest: int, now: int, grace_ms: int) -> int:
    """How long after its window's close (end + grace, as the window stood before the
    update: `prev_newest` is its newest timestamp then, 0 if the update opened it) an
    update was taken at `now`; 0 or less: in time (pure)."""
    return now - (shape.close(start, prev_newest) + grace_ms)


def window_stamp(timestamp_ms: int, now: int, ahead_ms: int) -> int:
    """The time that places a record in a window: its timestamp, or `now` (the gateway's
    clock) when the timestamp is more than `ahead_ms` ahead of it, so that no
    producer's clock stretches a wait past `[delay] max_delay` (pure)."""
    return now if timestamp_ms - now > ahead_ms else timestamp_ms


def agreed_start(starts: Sequence[int]) -> int | None:
    """The window start most members answered (ties: the earliest); None if none did."""
    if not starts:
        return None
    counts = Counter(starts)
    return min(counts, key=lambda s: (-counts[s], s))


@dataclass(frozen=True)
class Placement:
    """Where one decided-new row's update went: its window's start and close, whether
    a majority of the answers opened the window, and how late the update was taken
    (0 or less: in time)."""

    start: int
    close: int
    opened: bool
    lateness: int


def place(
    shape: WindowShape,
    said: Sequence[tuple[int, bool, int]],
    stamp: int,
    now: int,
    grace_ms: int,
) -> Placement:
    """A row's window from the counted members' answers to its update (pure): `said`
    holds each counted answer's (window start, opened, newest timestamp before the
    update). The start most of them answered; with no counted answer, the row's own
    window (`stamp` aligned to the window in fixed mode, `stamp` itself in trailing)."""
    start = agreed_start([s for s, _, _ in said])
    if start is None:
        start = stamp - stamp % shape.window_ms if shape.mode == "fixed" else stamp
    opened = sum(o for _, o, _ in said) * 2 > len(said)
    prev = max((p for s, _, p in said if s == start), default=0)
    return Placement(
        start=start,
        close=shape.close(start, max(stamp, prev)),
        opened=opened,
        lateness=late_by(shape, start, prev, now, grace_ms),
    )


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
