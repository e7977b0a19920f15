"""Notes that a member is behind: fills survive a gateway stop.

The fill backlog (fills.py) lives in this process. So that a stop (SIGTERM,
SIGKILL, a deploy) cannot leave a member silently without marks it missed,
the first time fills are queued for a member this gateway run writes on the
members that answered a note, `<prefix>behind` field `<member>|<run id>`
(lua/behind.lua), before the batch that missed it is committed. The note
lasts two ttl and is written again every half ttl while the member keeps
missing votes, so it outlives every mark the member missed (1.5 x ttl).

Every gateway reads the notes with the epochs (epochs.py): a member another
run noted is *recovering* (not counted) until that run cleared its note
(it sent every fill it held: drained, or at a graceful stop), `dedup-gateway
rebuild` completed the member (which forgets every note about it), or the
note expired. A run's own notes do not stop it from counting the member: its
fills go out before its next claim to it. A note is not cleared while fills
for the member were dropped (a full backlog, or a stop that could not send
them): the member then really lacks marks until they expire.

No member lags, no call: the happy path costs nothing.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable, Sequence

from gateway.metrics import Metrics
from gateway.quorum.link import MemberLink
from gateway.quorum.transport import Transport

logger = logging.getLogger(__name__)


class Behind:
    """This run's notes of the members it holds fills for."""

    def __init__(
        self, links: Sequence[MemberLink], via: Callable[[MemberLink], Transport],
        ttl_ms: int, metrics: Metrics,
    ) -> None:  # fmt: skip
        self.links = links
        self._via = via
        self.run_id = uuid.uuid4().hex[:16]
        self.life_ms = 2 * ttl_ms  # outlives a missed mark (1.5 x ttl) between two notes
        self.every_s = ttl_ms / 2000  # written again this often while the member lags
        self.metrics = metrics
        self.noted: dict[str, float] = {}  # member name -> when this run last noted it
        self.dropped: set[str] = set()  # members whose fills were dropped since noted

    async def note(self, lagging: Sequence[MemberLink]) -> None:
        """Note, on every other member that answers, that this run holds fills for
        each of `lagging` (at most every half ttl per member)."""
        now = time.monotonic()
        due = [m for m in lagging if now - self.noted.get(m.name, -self.every_s) >= self.every_s]
        if not due:
            return
        calls = []
        for member in due:
            if now - self.noted.get(member.name, now) > self.life_ms / 1000:
                self.dropped.discard(member.name)  # the last note expired, and what it stood for
            self.noted[member.name] = now
            args = ["note", member.name, self.run_id, self.life_ms]
            calls += [self._call(on, args) for on in self.links if on is not member and on.up]
        await asyncio.gather(*calls)

    async def clear(self, member: MemberLink) -> None:
        """This run sent every fill it held for `member`: clear its note, unless
        some were dropped (the member lacks them until they expire)."""
        if member.name not in self.noted or member.backlog or member.name in self.dropped:
            return
        del self.noted[member.name]
        args = ["clear", member.name, self.run_id, 0]
        await asyncio.gather(*(self._call(on, args) for on in self.links if on is not member))

    async def forget(self, member: MemberLink) -> None:
        """Every run's notes about `member` (a rebuild completed it)."""
        args = ["forget", member.name, "", 0]
        await asyncio.gather(*(self._call(on, args) for on in self.links if on is not member))

    async def _call(self, on: MemberLink, args: list[object]) -> None:
        await self._via(on).run_script(on, "behind", [on.groups[0].prefix, *args])


def noted_by_others(notes: Sequence[object], now_ms: int, run_id: str) -> dict[str, set[str]]:
    """From one member's `behind` hash (a flat field/value list): the members that
    runs other than `run_id` noted as behind, with those runs, live notes only."""
    out: dict[str, set[str]] = {}
    for k in range(0, len(notes) - 1, 2):
        field, until = notes[k], notes[k + 1]
        name, _, run = _text(field).rpartition("|")
        if run != run_id and _text(until).isdigit() and int(_text(until)) > now_ms:
            out.setdefault(name, set()).add(run)
    return out


def _text(value: object) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)
