"""Notes that a member is behind: fills survive a gateway stop.

The fill backlog (fills.py) lives in this process. So that a stop (SIGTERM,
SIGKILL, a deploy) cannot leave a member silently without marks it missed,
once fills are queued for a member this gateway run writes on the other
members that are up a note, `<prefix>behind` field `<member>|<run id>`
(lua/behind.lua), before the batch that queued them is committed
(`Quorum.note_behind`). The note lasts two ttl and is written again every
`every_s` (half ttl, at most `NOTE_REFRESH_S`) while the run holds fills for
the member, or dropped some: a note not written again for `STALE_AFTER`
times that is stale, its run stopped (`<prefix>behind-at` says when each
note was written).

A note is written after the fills are queued, and cleared only while the
member has none queued or in flight (`MemberLink.sending`), never while a
note is being written: a clear between a vote's claims and its queued fills
(the quorum's `watch` ran meanwhile) once deleted the note of a batch about
to be committed, and a gateway killed after that commit left the member
counted without its marks. A note that did not reach the other members that
are up keeps the batch uncommitted (it is tried again); a member that
answers the note with an error (it holds something else under the notes'
key) is left out, with an ERROR, as long as one other member holds the note:
else every batch was retried for as long as that member answered claims. A
clear goes to the members that are up, and one that did not reach every
member is tried again by the next (the quorum's watch clears every `[redis]
ping_interval`).

Every gateway reads the notes with the epochs (epochs.py): a member another
run noted is *behind* (not counted) until that run cleared its note (it sent
every fill it held: drained, or at a graceful stop), the member was caught up
(by a gateway, catchup.py, when the run's note is stale; or by `dedup-gateway
rebuild`), or the note expired. A catch-up makes the notes it covered void on
the member itself (`<prefix>caught-up`), so a member that missed the forget
(down or hung meanwhile) does not bring them back. A run's own notes do not
stop it from counting the member: its fills go out before its next claim to
it. A run that dropped fills for a member (a full backlog, `repair_backlog`)
does not count it either, until it caught it up or the marks it dropped have
expired, and keeps its note while it holds the drop.

No member lags, no call: the happy path costs nothing.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gateway.metrics import Metrics
from gateway.quorum.link import MemberLink
from gateway.quorum.scripts import listed
from gateway.quorum.transport import Transport

logger = logging.getLogger(__name__)

# In a member's void notes (`<prefix>caught-up`): every run's (a rebuild's).
ANY_RUN = "*"
# A lagging member's note is written again at least this often (seconds) while the
# run lives: a note not written again for STALE_AFTER of these is its stopped run's.
NOTE_REFRESH_S = 5.0
STALE_AFTER = 3


class ForgetError(Exception):
    """The caught-up member did not take the void: the notes about it still hold."""


@dataclass(frozen=True)
class Noted:
    """One note about a member, as one member holds it."""

    run: str  # the gateway run that wrote it
    written_ms: int  # when (the holding member's clock)
    stale: bool  # not written again for STALE_AFTER refreshes: its run stopped


class Behind:
    """This run's notes of the members it holds fills for."""

    def __init__(
        self, links: Sequence[MemberLink], via: Callable[[MemberLink], Transport],
        ttl_ms: int, ping_interval_s: float, keep_ms: int, metrics: Metrics,
    ) -> None:  # fmt: skip
        self.links = links
        self._via = via
        self.run_id = uuid.uuid4().hex[:16]
        self.life_ms = 2 * ttl_ms  # a mark missed before a note lives at most 2 x ttl after it
        # Written again this often while the member lags (also by the quorum's watch).
        self.every_s = min(ttl_ms / 2000, max(NOTE_REFRESH_S, 2 * ping_interval_s))
        self.stale_ms = int(STALE_AFTER * self.every_s * 1000)
        self.keep_ms = keep_ms  # a mark's longest life: a dropped one has expired after it
        self.metrics = metrics
        self.noted: dict[str, float] = {}  # member name -> when this run last noted it
        self.unsure: set[str] = set()  # members whose last note or clear some member missed
        self.dropped: dict[str, float] = {}  # member name -> when fills for it were last dropped
        self._one_at_a_time = asyncio.Lock()  # a clear never overtakes a note in flight
        self._void_seen: dict[str, int] = {}  # member -> the last void cut-off acted on

    def lacks(self, name: str) -> bool:
        """Whether this run dropped fills for member `name` whose marks may still live."""
        at = self.dropped.get(name)
        if at is not None and time.monotonic() - at > self.keep_ms / 1000:
            del self.dropped[name]
            at = None
        return at is not None

    def _due(self, member: MemberLink, now: float) -> bool:
        last = self.noted.get(member.name)
        return member.name in self.unsure or last is None or now - last >= self.every_s

    async def note(self, lagging: Sequence[MemberLink]) -> bool:
        """Note, on every other member that is up, that this run holds fills for each
        of `lagging` (again every `every_s` per member). Whether every note due got
        there: if not, the batch that queued the fills must not be committed."""
        if not any(self._due(m, time.monotonic()) for m in lagging):
            return True
        async with self._one_at_a_time:
            now = time.monotonic()
            due = [m for m in lagging if self._due(m, now)]
            calls = [(m, on) for m in due for on in self._holders(m)]
            answers = await asyncio.gather(*(
                self._call(on, ["note", m.name, self.run_id, self.life_ms, self.stale_ms])
                for m, on in calls
            ))  # fmt: skip
            # A member that answered with an error (it is up again by its next claim) holds
            # something else under the notes' key: left out while another holds the note.
            refusing = {on.name for (_, on), a in zip(calls, answers, strict=True)
                        if a is None and on.failure and on.failure[0] == "response"}  # fmt: skip
            held = {m.name for (m, _), a in zip(calls, answers, strict=True) if a is not None}
            written = all(
                a is not None or (on.name in refusing and m.name in held)
                for (m, on), a in zip(calls, answers, strict=True)
            )
            for name in sorted(refusing):
                logger.error(
                    "Redis member %s answers the note that another member is behind with an "
                    "error (does its key %r hold something else?): the note is kept on the "
                    "others only", name, "behind", extra={"redis": name},
                )  # fmt: skip
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

    def holding(self) -> list[MemberLink]:
        """The members this run holds fills for, or dropped some for: its notes about
        them are written again while it lives (the quorum's watch), so they never
        look stale."""
        return [m for m in self.links if m.backlog or m.sending or self.lacks(m.name)]

    def _clearable(self, member: MemberLink) -> bool:
        noted = member.name in self.noted or member.name in self.unsure
        idle = not member.backlog and not member.sending
        return noted and idle and not self.lacks(member.name)

    async def clear(self, member: MemberLink) -> None:
        """This run sent every fill it held for `member`: clear its note, unless
        some were dropped (the member lacks them until caught up, or they expire)."""
        if not self._clearable(member):
            return
        async with self._one_at_a_time:
            if not self._clearable(member):
                return
            self.noted.pop(member.name, None)
            args = ["clear", member.name, self.run_id, 0, 0]
            holders = self._holders(member)  # a member down is not waited for under the lock
            answers = await asyncio.gather(*(self._call(on, args) for on in holders))
            if None in answers or len(holders) < len(self.links) - 1:
                self.unsure.add(member.name)  # the next clear (or note) tries again
            else:
                self.unsure.discard(member.name)

    def voided(self, member: MemberLink, cut_off_ms: int) -> None:
        """A catch-up made this run's notes about `member` void up to `cut_off_ms`: the
        next note is due (once per cut-off)."""
        if self._void_seen.get(member.name) != cut_off_ms:
            self._void_seen[member.name] = cut_off_ms
            if member.name in self.noted:
                self.unsure.add(member.name)

    async def forget(self, member: MemberLink, runs: Sequence[str] | None, cut_off_ms: int) -> None:
        """`member` was caught up: the notes about it of `runs` (None: of every run,
        `ANY_RUN`) written up to `cut_off_ms` (its clock) are void on it, and forgotten
        on the members that answer."""
        names = list(runs) if runs is not None else [ANY_RUN]
        voided = await self._call(
            member, ["void", member.name, listed(names), cut_off_ms,
                     self.life_ms],
        )  # fmt: skip
        if voided is None:
            raise ForgetError(f"{member.name} did not answer")
        for run in runs if runs is not None else [""]:
            args = ["forget", member.name, run, 0, 0]
            await asyncio.gather(*(self._call(on, args) for on in self.links if on is not member))

    async def clock(self, member: MemberLink) -> int | None:
        """`member`'s clock (ms); None when it gave no answer."""
        got = await self._call(member, ["clock", member.name, self.run_id, 0, 0])
        return int(got) if isinstance(got, int) else None

    async def lease(self, member: MemberLink, ms: int) -> int:
        """Take or renew this run's lease on catching `member` up: its clock (ms), or 0
        when another run holds it or it gave no answer."""
        got = await self._call(member, ["lease", member.name, self.run_id, ms, 0])
        return int(got) if isinstance(got, int) else 0

    async def unlease(self, member: MemberLink) -> None:
        await self._call(member, ["unlease", member.name, self.run_id, 0, 0])

    async def _call(self, on: MemberLink, args: list[object]) -> object | None:
        """The script's reply; None when `on` gave no answer."""
        return await self._via(on).run_script(on, "behind", [on.groups[0].prefix, *args])


def noted_by_others(
    notes: Sequence[object], written: Sequence[object], now_ms: int, run_id: str,
    life_ms: int, stale_ms: int,
) -> dict[str, list[Noted]]:  # fmt: skip
    """From one member's `behind` and `behind-at` hashes (flat field/value lists):
    the notes of runs other than `run_id` about each member, live notes only. A
    note without its written time (an older gateway's) was written `life_ms`
    before it ends, and is stale after `stale_ms`."""
    at = {_text(written[k]): _text(written[k + 1]) for k in range(0, len(written) - 1, 2)}
    out: dict[str, list[Noted]] = {}
    for k in range(0, len(notes) - 1, 2):
        field, until = _text(notes[k]), _text(notes[k + 1])
        name, _, run = field.rpartition("|")
        if run == run_id or not until.isdigit() or int(until) <= now_ms:
            continue
        when, _, after = at.get(field, "").partition(":")
        written_ms = int(when) if when.isdigit() else int(until) - life_ms
        after_ms = int(after) if after.isdigit() else stale_ms
        out.setdefault(name, []).append(Noted(run, written_ms, now_ms - written_ms > after_ms))
    return out


def _text(value: object) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)
