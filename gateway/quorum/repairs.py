"""What a vote leaves to do on the members, and doing it.

After a vote (`rules.vote.tally`): the marks that differ from the winner are
repaired, the winner's marks are queued as fills for the members that gave no
answer (gateway/quorum/fills.py), and those members are noted behind on the others
(gateway/quorum/behind.py). The quorum's watch sends the queued fills to members
that answer; a graceful stop sends what it can within a bound and says what it
could not."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from gateway.metrics import Metrics
from gateway.quorum.behind import Behind
from gateway.quorum.epochs import Epochs
from gateway.quorum.fills import Fills
from gateway.quorum.link import Fill, MemberLink
from gateway.quorum.members import Group
from gateway.quorum.transport import Planned, Transport, chunks

logger = logging.getLogger(__name__)

# A mark to rewrite: (digest, the owner seen, the winner).
Repair = tuple[bytes, str, str]


@dataclass
class Repairs:
    """The repairs, fills and behind notes of one quorum's members."""

    members: Sequence[MemberLink]
    via: Callable[[MemberLink], Transport]  # standalone or Redis Cluster
    fills: Fills
    behind: Behind
    epochs: Epochs
    metrics: Metrics
    timeout: float  # `[redis] timeout`, seconds

    async def settle(
        self, repairs: Sequence[list[Repair]], fills: Sequence[Iterable[Fill]]
    ) -> bool:
        """After a vote (`rules.vote.tally`): repair the marks that differ from the
        winner, queue the winner's marks for the members that gave no answer, and note
        them behind. False when that note did not stand: the batch must be tried again."""
        repairing, filling = any(repairs), any(fills)
        if repairing:
            await self.repair(repairs)  # what gets no answer is queued as fills
        if filling:
            self.queue_fills(fills)
        return not (repairing or filling) or await self.note_behind()

    async def note_behind(self) -> bool:
        """Note, on the other members, every member this run holds fills for
        (gateway/quorum/behind.py), after the vote queued them and before its batch is
        committed. Whether the notes stand: if not, the batch must not be committed."""
        return await self.behind.note([i for i in self.members if i.backlog or i.sending])

    def queue_fills(self, per_member: Sequence[Iterable[Fill]]) -> None:
        """Marks to complete later: per member, (digest, winner, token sent) for the
        votes it gave no answer to (see scripts.FILL)."""
        for member, fills in zip(self.members, per_member, strict=True):
            self.fills.queue(member, fills)

    async def repair(self, per_member: Sequence[list[Repair]]) -> int:
        """Rewrite (digest, seen owner, winner) marks where they still hold what was seen.

        A chunk that gets no answer is queued as fills (digest, winner, seen): the
        fill writes the winner where the mark still holds `seen`, once the member
        answers. Dropped instead, a split left unrepaired would outlive the vote, and
        with another member recovering a later copy could win its tie.
        """

        async def one(member: MemberLink, todo: list[Repair]) -> int:
            if not todo:
                return 0

            def plan(group: Group, items: Sequence[int]) -> Planned:
                return [(("repair", [group.meta],
                          [*group.layout, *(v for k in chunk for v in todo[k])]), chunk)
                        for chunk in chunks(items)]  # fmt: skip

            results = await self.via(member).grouped(
                member, "repair", [d for d, _, _ in todo], plan
            )
            missed = [(todo[k][0], todo[k][2], todo[k][1])
                      for positions, result in results if result is None
                      for k in positions]  # fmt: skip
            if missed:
                self.fills.queue(member, missed)
            return sum(int(result or 0) for _, result in results)

        results = await asyncio.gather(
            *(one(member, todo) for member, todo in zip(self.members, per_member, strict=True))
        )
        repaired = sum(results)
        self.metrics.repairs.inc(repaired)
        return repaired

    async def drain(self) -> None:
        """Send the queued fills to the members that answer (the quorum's watch)."""
        await asyncio.gather(*(self._drain(member) for member in self.members if member.up))

    async def _drain(self, member: MemberLink) -> None:
        await self.fills.drain(member)
        await self.behind.clear(member)

    async def drain_at_stop(self, bound_s: float) -> None:
        """At a graceful stop (the loops stopped): send every queued fill, trying
        for `bound_s` (and at most one `[redis] timeout` more), and clear this run's
        notes. What cannot be sent is counted and logged; the members that lack it
        stay noted as behind (not counted by the next gateway) until a rebuild
        completes them or the notes expire (gateway/quorum/behind.py)."""
        deadline = asyncio.get_running_loop().time() + bound_s
        await asyncio.gather(*(self._drain_until(member, deadline) for member in self.members))
        for member in self.members:
            if member.backlog:
                lost = len(member.backlog)
                self.metrics.repairs_lost_at_stop.labels(member.name).inc(lost)
                logger.warning(
                    "stopping with %d fill(s) for Redis member %s not sent within %gs: it stays "
                    "noted as behind (not counted by any gateway) until a gateway caught it up "
                    "(`dedup-gateway rebuild %s` does too)", lost, member.name, bound_s,
                    member.name,
                    extra={"redis": member.name},
                )  # fmt: skip

    async def _drain_until(self, member: MemberLink, deadline: float) -> None:
        """Send the member's backlog until it is empty or `deadline` passed (each try
        is bounded by `[redis] timeout`), then clear this run's note if it is."""
        loop = asyncio.get_running_loop()
        while member.backlog and loop.time() < deadline:
            if member.epoch is None or member.paused:
                await self.epochs.refresh()
            await self.fills.drain(member)
            if member.backlog:
                await asyncio.sleep(min(self.timeout, max(0.0, deadline - loop.time())))
        await self.behind.clear(member)
