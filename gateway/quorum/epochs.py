"""Epochs and trust: whether each member still holds the marks it was given.

Every claim names the epoch it expects and writes nothing where another one is
found (gateway/quorum/keys.py, "Epochs"); a member whose data was lost is
*recovering*: its answers are returned but not counted in votes, until
`dedup-gateway rebuild` copied the marks into it or a whole mark lifetime
(2 x ttl) has passed since its data began. So is a member another gateway
run noted as behind (it stopped holding fills for it, gateway/quorum/behind.py),
until that note is cleared. A cluster member's epoch lives in
group 0 and is copied to every group: a group that loses it (its node restarted
empty) makes the whole member recovering. A member's trust is one `Trust`
state (gateway/quorum/link.py), set here only.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from gateway.quorum.behind import ANY_RUN, Behind, Noted, noted_by_others
from gateway.quorum.keys import EPOCH_RECOVERING, EPOCH_TRUSTED, Epoch
from gateway.quorum.link import MemberLink, Trust
from gateway.quorum.transport import Transport
from gateway.rules.trust import decide_trust, epoch_served

logger = logging.getLogger(__name__)

# How long the first epoch reads at start may take (connect, load the script).
FIRST_CONTACT_S = 2.0


@dataclass(frozen=True)
class EpochRead:
    """What a member said about its data (scripts.EPOCH_READ, all groups together)."""

    epoch: Epoch | None
    now_ms: int
    has_marks: bool
    paused: bool
    behind: dict[str, list[Noted]]  # members other gateway runs noted here as behind
    void: dict[str, int]  # of the notes about this member: run -> cut-off (a catch-up's)


class Epochs:
    """Reads the members' epochs and decides their trust."""

    def __init__(
        self,
        links: Sequence[MemberLink],
        via: Callable[[MemberLink], Transport],
        majority: int,
        timeout: float,
        recovery_ms: int,
        behind: Behind,
        writes: bool = True,
    ) -> None:
        self.links = links
        self._via = via
        self.majority = majority
        self.timeout = timeout
        self.recovery_ms = recovery_ms
        self.behind = behind  # this run's notes (behind.py): its own do not count
        # False for an operator command's quorum: it reads epochs and writes none (no
        # epoch given by the fresh-deployment rule, none spread nor promoted).
        self.writes = writes
        self.read = False  # read at least once
        self.reread = False  # a script met another epoch: read them all again

    async def refresh(self, patient: bool = False) -> None:
        """Read every member's epoch, give one to a member that has none, and decide
        which members are trusted (gateway/quorum/keys.py, "Epochs"). `patient` (at start):
        allow FIRST_CONTACT_S for the reads, which then connect and load the script:
        a member missed at the first start joins as recovering."""
        self.read, self.reread = True, False
        timeout = max(self.timeout, FIRST_CONTACT_S) if patient else self.timeout
        reads = await asyncio.gather(*(self._read_member(i, timeout) for i in self.links))
        seen = {n: read for n, read in enumerate(reads) if read is not None}
        todo = {
            n: state
            for n, read in seen.items()
            if read.epoch is None and (state := self._state_for_missing(n, seen))
        }
        if not self.writes:
            # An operator command's view only: a fresh deployment's members count as
            # trusted here, under no epoch id (a script that names one refuses); the
            # gateways write the epochs.
            for n, state in todo.items():
                if state == EPOCH_TRUSTED:
                    seen[n] = replace(seen[n], epoch=Epoch("", seen[n].now_ms, state))
            todo = {}
        made = await asyncio.gather(
            *(self._create_epoch(self.links[n], state) for n, state in todo.items())
        )
        for n, epoch in zip(todo, made, strict=True):
            if epoch is not None:
                seen[n] = replace(seen[n], epoch=epoch)
        for n, read in seen.items():
            member = self.links[n]
            cut_off = max(read.void.get(self.behind.run_id, -1), read.void.get(ANY_RUN, -1))
            if cut_off >= 0:
                self.behind.voided(member, cut_off)
            # Per run that noted it, whether its note is stale everywhere (its run stopped);
            # a note a catch-up made void (written up to its cut-off) does not count.
            runs: dict[str, bool] = {}
            for holder in seen.values():
                for note in holder.behind.get(member.name, []):
                    if note.written_ms > max(
                        read.void.get(note.run, -1), read.void.get(ANY_RUN, -1)
                    ):
                        runs[note.run] = runs.get(note.run, True) and note.stale
            member.stale = {run for run, stale in runs.items() if stale}
            await self._adopt(member, read, set(runs))

    async def _read_member(self, member: MemberLink, bound_s: float) -> EpochRead | None:
        """The member's epoch read; None for no answer. A cluster member's epoch is
        group 0's, copied to every group (`_spread`)."""
        if not member.cluster:
            got = await self._read_group(member, 0, bound_s)
            return None if got is None else got[0]
        # Group 0 first, alone: its call sets up the cluster client (the slot map), which
        # calls started side by side before that would each race to do.
        head = await self._read_group(member, 0, bound_s)
        if head is None:
            return None
        reads = [head, *await asyncio.gather(
            *(self._read_group(member, g, bound_s) for g in range(1, len(member.groups)))
        )]  # fmt: skip
        member.failure = None
        first, spread_id = head
        answered = [got[0] for got in reads if got is not None]
        has_marks = any(read.has_marks for read in answered)
        paused = any(read.paused for read in answered)
        epoch = first.epoch
        if epoch is None and any(read.epoch is not None for read in answered):
            if not self.writes:
                return None
            # Group 0 lost its data (its node restarted empty) while others kept theirs.
            epoch = await self._create_epoch(member, EPOCH_RECOVERING)
            if epoch is None:
                return None
        elif epoch is not None and self.writes:
            epoch = await self._spread(
                member, epoch, [None if g is None else g[0] for g in reads], spread_id
            )
            if epoch is None:
                return None
        return EpochRead(epoch, first.now_ms, has_marks, paused, first.behind, first.void)

    async def _read_group(
        self, member: MemberLink, group: int, bound_s: float
    ) -> tuple[EpochRead, str | None] | None:
        """One group's epoch read and, on group 0, the epoch id spread to every group."""
        prefix = member.groups[group].prefix
        got = await self._via(member).run_script(member, "epoch_read", [prefix], bound_s, group)
        if got is None:
            return None
        raw, now_ms, has_marks, paused, spread, notes, written, void = got
        epoch = Epoch.parse(raw.decode(errors="replace")) if raw else None
        behind = noted_by_others(
            notes or [],
            written or [],
            int(now_ms),
            self.behind.run_id,
            self.behind.life_ms,
            self.behind.stale_ms,
        )
        voids = {
            _text(void[k]): int(void[k + 1])
            for k in range(0, len(void or []) - 1, 2)
            if _text(void[k + 1]).isdigit()
        }
        read = EpochRead(epoch, int(now_ms), bool(has_marks), bool(paused), behind, voids)
        return read, spread.decode(errors="replace") if spread else None

    async def _create_epoch(self, member: MemberLink, state: str) -> Epoch | None:
        """Give the member an epoch (the first gateway's wins) and, on a cluster,
        copy it to every group."""
        raw = await self._via(member).run_script(
            member, "epoch_create", [uuid.uuid4().hex[:16], state]
        )
        epoch = Epoch.parse(raw.decode(errors="replace")) if raw else None
        if epoch is not None and member.cluster:
            return await self._spread(member, epoch, None, None)
        return epoch

    async def _spread(
        self,
        member: MemberLink,
        epoch: Epoch,
        reads: list[EpochRead | None] | None,
        spread_id: str | None,
    ) -> Epoch | None:
        """Make every group of a cluster member hold its epoch (group 0's); the epoch,
        or None when another gateway changed it meanwhile (read again).

        Claims check their own group's copy, so a group without it takes no marks.
        Once every group had it (`epoch-spread` names the id on group 0), a group
        without it lost its data: the whole member is given a new, recovering
        epoch. Before that, a group without it was just not reached yet.
        `reads`: the groups' reads (None: copy to every group)."""
        count = len(member.groups)
        if reads is None:
            stale = list(range(1, count))
        else:
            stale = [
                g
                for g in range(1, count)
                if (read := reads[g]) is not None
                and (read.epoch is None or read.epoch.id != epoch.id)
            ]
        if stale and spread_id == epoch.id and reads is not None and (first := reads[0]):
            fresh = Epoch(uuid.uuid4().hex[:16], first.now_ms, EPOCH_RECOVERING)
            logger.warning(
                "Redis member %s: key groups %s lost the member's epoch %s (a node restarted "
                "empty?): the member is recovering, as epoch %s",
                member.name,
                ", ".join(member.groups[g].prefix.decode(errors="replace") for g in stale),
                epoch.id,
                fresh.id,
                extra={"redis": member.name},
            )
            if await self._via(member).run_script(member, "epoch_set", [epoch.raw, fresh.raw]) != 1:
                self.reread = True
                return None
            epoch, stale = fresh, list(range(1, count))
        if not stale and spread_id == epoch.id:
            return epoch
        copies = await asyncio.gather(
            *(
                self._via(member).run_script(member, "epoch_copy", [epoch.raw], None, g)
                for g in stale
            )
        )
        if all(c is not None for c in copies) and (reads is None or None not in reads):
            prefix = member.groups[0].prefix
            await self._via(member).run_script(member, "epoch_spread", [prefix, epoch.raw])
        return epoch

    def _state_for_missing(self, n: int, seen: dict[int, EpochRead]) -> str | None:
        """The state to give member `n`, which answered without an epoch; None: wait.

        Only the scripts that check the epoch open a slice, so a member with
        marks but no epoch kept data written before epochs existed: trusted. One
        without marks lost its data if this gateway knew it by an epoch, or if
        another member holds marks: recovering. If no member that answers
        holds marks, nothing was claimed yet (a fresh deployment): trusted, once a
        majority answers.
        """
        if seen[n].has_marks:
            return EPOCH_TRUSTED
        if self.links[n].known_id is not None or any(r.has_marks for r in seen.values()):
            return EPOCH_RECOVERING
        return EPOCH_TRUSTED if len(seen) >= self.majority else None

    async def _adopt(self, member: MemberLink, read: EpochRead, behind: set[str]) -> None:
        """Take the member's epoch as read, decide its trust, log and count changes.
        `behind`: the other gateway runs that noted it lacks marks they held."""
        epoch, now_ms = read.epoch, read.now_ms
        if read.paused != member.paused:
            say_paused(member, read.paused)
            member.set_paused(read.paused)
        served = epoch is not None and epoch_served(
            epoch.state == EPOCH_TRUSTED, epoch.since_ms, now_ms, self.recovery_ms
        )
        if epoch is not None and served and epoch.state != EPOCH_TRUSTED and self.writes:
            epoch = await self._promote(member, epoch)
        lost = epoch is not None and member.known_id is not None and member.known_id != epoch.id
        missed = bool(behind) or self.behind.lacks(member.name)
        marked = epoch is not None and epoch.state == EPOCH_TRUSTED
        decided = decide_trust(epoch is not None, served, missed, marked)
        trust = decided.trust
        if served:
            say_behind(member, behind, missed)
        member.behind = behind
        member.set_behind(decided.lagging)
        say_trust(member, epoch, trust, served, lost, self.recovery_ms)
        member.epoch, member.reported = epoch, trust
        if epoch is not None:
            member.known_id = epoch.id
        member.set_trust(trust)

    async def _promote(self, member: MemberLink, epoch: Epoch) -> Epoch:
        """A whole mark lifetime has passed: say so on the member, for every gateway."""
        promoted = epoch.with_state(EPOCH_TRUSTED)
        moved = await self._via(member).run_script(member, "epoch_set", [epoch.raw, promoted.raw])
        return promoted if moved == 1 else epoch

    def lacks(self, member: MemberLink) -> None:
        """This run dropped fills for `member` (its backlog was full): it lacks marks this
        run no longer holds, so it is not counted (here too) until caught up."""
        if member.trust is Trust.TRUSTED:
            logger.warning(
                "Redis member %s: fills for it were dropped (its repair backlog is full): "
                "its answers are not counted until a gateway caught it up",
                member.name,
                extra={"redis": member.name},
            )
            member.reported = Trust.RECOVERING
            member.set_behind(True)
            member.set_trust(Trust.RECOVERING)

    def refused(self, member: MemberLink, reply: bytes) -> bool:
        """Whether a script refused to write: another epoch ('epoch:<held>': the member
        lost its data since we read it) or a pause ('paused:')."""
        if reply.startswith(b"epoch:"):
            self._epoch_differs(member, reply[len(b"epoch:") :].decode())
            return True
        if reply.startswith(b"paused:"):
            if not member.paused:
                say_paused(member, True)
            member.set_paused(True)
            return True
        return False

    def _epoch_differs(self, member: MemberLink, held: str) -> None:
        """A claim found another epoch: the member lost its data since we read it."""
        logger.warning(
            "Redis member %s holds epoch %r, not %r: nothing was written; re-reading epochs",
            member.name,
            held,
            member.epoch.raw if member.epoch else None,
            extra={"redis": member.name},
        )
        member.epoch = None
        self.reread = True
        member.set_trust(Trust.UNKNOWN)


def say_paused(member: MemberLink, paused: bool) -> None:
    logger.warning(
        "Redis member %s is %s",
        member.name,
        "paused: not counted, no claims sent" if paused else "resumed",
        extra={"redis": member.name},
    )


def say_behind(member: MemberLink, behind: set[str], missed: bool) -> None:
    """Log a served member's marks missed by other runs, once, or that none are now."""
    if missed and behind and member.behind != behind:
        logger.warning(
            "Redis member %s missed marks that gateway run(s) %s held as fills and "
            "did not send (stopped, or still sending): its answers are not counted "
            "until they are sent or a gateway caught it up (once a stopped run's note "
            "is stale), `dedup-gateway rebuild %s`, or 2 x ttl after the last note",
            member.name,
            ", ".join(sorted(behind)),
            member.name,
            extra={"redis": member.name},
        )
    elif not missed and member.behind and not behind:
        logger.info(
            "Redis member %s: no gateway run holds fills for it any more",
            member.name,
            extra={"redis": member.name},
        )


def say_trust(
    member: MemberLink,
    epoch: Epoch | None,
    trust: Trust,
    served: bool,
    lost: bool,
    recovery_ms: int,
) -> None:
    """Log a member's trust when it changed from the one last logged (or it lost its
    data again)."""
    if epoch is None and trust != member.reported:
        logger.warning(
            "Redis member %s holds no epoch, and whether it lost its data cannot be "
            "decided while fewer than a majority answer: its answers are not counted",
            member.name,
            extra={"redis": member.name},
        )
    elif epoch is not None and not served and (lost or trust != member.reported):
        logger.warning(
            "Redis member %s %s (epoch %s, its data began %s): its answers are not "
            "counted until `dedup-gateway rebuild %s` or %s",
            member.name,
            "lost its data" if lost else "is recovering",
            epoch.id,
            when(epoch.since_ms),
            member.name,
            when(epoch.since_ms + recovery_ms),
            extra={"redis": member.name},
        )
    elif trust is Trust.TRUSTED and member.reported not in (Trust.NEW, Trust.TRUSTED):
        logger.info("Redis member %s is trusted again", member.name, extra={"redis": member.name})


def _text(value: object) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def when(epoch_ms: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(epoch_ms / 1000))
