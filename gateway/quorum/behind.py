"""Notes that a member is behind: fills survive a gateway stop.

The fill backlog (fills.py) lives in this process. So that a stop (SIGTERM,
SIGKILL, a deploy) cannot leave a member silently without marks it missed,
once fills are queued for a member this gateway run writes on the other
members that are up a note, `<prefix>behind` field `<member>|<run id>`
(lua/behind.lua), before the batch that queued them is committed
(`Quorum.note_behind`). The note lasts two ttl and is written again every
half ttl while the run holds fills for the member, so it outlives every mark
the member missed (1.5 x ttl).

A note is written after the fills are queued, and cleared only while the
member has none queued or in flight (`MemberLink.sending`), never while a
note is being written: a clear between a vote's claims and its queued fills
(the quorum's `watch` ran meanwhile) once deleted the note of a batch about
to be committed, and a gateway killed after that commit left the member
counted without its marks. A note that did not reach every other member that
is up keeps the batch uncommitted (it is tried again); a clear goes to the
members that are up, and one that did not reach every member is tried again
by the next (the quorum's watch clears every `[redis] ping_interval`).

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
        self.unsure: set[str] = set()  # members whose last note or clear some member missed
        self.dropped: set[str] = set()  # members whose fills were dropped since noted
        self._one_at_a_time = asyncio.Lock()  # a clear never overtakes a note in flight

    def _due(self, member: MemberLink, now: float) -> bool:
        last = self.noted.get(member.name)
        return member.name in self.unsure or last is None or now - last >= self.every_s

    async def note(self, lagging: Sequence[MemberLink]) -> bool:
        """Note, on every other member that is up, that this run holds fills for each
        of `lagging` (again every half ttl per member). Whether every note due got
        there: if not, the batch that queued the fills must not be committed."""
        if not any(self._due(m, time.monotonic()) for m in lagging):
            return True
        async with self._one_at_a_time:
            now = time.monotonic()
            due = [m for m in lagging if self._due(m, now)]
            calls = []
            for member in due:
                if now - self.noted.get(member.name, now) > self.life_ms / 1000:
                    self.dropped.discard(member.name)  # the last note expired, and its reason
                args = ["note", member.name, self.run_id, self.life_ms]
                calls += [self._call(on, args) for on in self._holders(member)]
            written = None not in await asyncio.gather(*calls)
            for member in due:
                if written:
                    self.noted[member.name] = now
                    self.unsure.discard(member.name)
                else:
                    self.unsure.add(member.name)
            if not written:
                logger.warning(
                    "the note that Redis member(s) %s lack marks this gateway run holds did "
                    "not reach every other member: the batch is not committed, and is tried "
                    "again", ", ".join(m.name for m in due),
                    extra={"redis": ", ".join(m.name for m in due)},
                )  # fmt: skip
            return written

    def _holders(self, member: MemberLink) -> list[MemberLink]:
        """The members a note about `member` must reach: the others that answer. A
        cluster member's notes live in its group 0 (read with its epoch, without
        which no gateway counts it): with that group down, it is not one."""
        return [on for on in self.links
                if on is not member and on.up and 0 not in on.down_groups]  # fmt: skip

    def _clearable(self, member: MemberLink) -> bool:
        noted = member.name in self.noted or member.name in self.unsure
        idle = not member.backlog and not member.sending
        return noted and idle and member.name not in self.dropped

    async def clear(self, member: MemberLink) -> None:
        """This run sent every fill it held for `member`: clear its note, unless
        some were dropped (the member lacks them until they expire)."""
        if not self._clearable(member):
            return
        async with self._one_at_a_time:
            if not self._clearable(member):
                return
            self.noted.pop(member.name, None)
            args = ["clear", member.name, self.run_id, 0]
            holders = self._holders(member)  # a member down is not waited for under the lock
            answers = await asyncio.gather(*(self._call(on, args) for on in holders))
            if None in answers or len(holders) < len(self.links) - 1:
                self.unsure.add(member.name)  # the next clear (or note) tries again
            else:
                self.unsure.discard(member.name)

    async def forget(self, member: MemberLink) -> None:
        """Every run's notes about `member` (a rebuild completed it)."""
        args = ["forget", member.name, "", 0]
        await asyncio.gather(*(self._call(on, args) for on in self.links if on is not member))

    async def _call(self, on: MemberLink, args: list[object]) -> object | None:
        """The script's reply (1); None when `on` gave no answer."""
        return await self._via(on).run_script(on, "behind", [on.groups[0].prefix, *args])


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
