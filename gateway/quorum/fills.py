"""The fill backlog: winners' marks to complete on a member that gave no answer.

Per member, the marks of the votes it gave no answer to, bounded (the oldest
dropped, counted: the member is then not counted by this run until caught up,
gateway/quorum/catchup.py), sent before the next claim to it and by the quorum's
`watch`: a mark written on a bare majority does not stay that way.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence

from gateway import sizing
from gateway.metrics import Metrics
from gateway.quorum.link import Fill, MemberLink
from gateway.quorum.members import Group
from gateway.quorum.scripts import listed
from gateway.quorum.transport import Planned, Transport


class Fills:
    """Each member's backlog of fills (`MemberLink.backlog`) and how it is sent."""

    def __init__(
        self, via: Callable[[MemberLink], Transport], most: int, metrics: Metrics,
        dropped: dict[str, float], on_drop: Callable[[MemberLink], None],
    ) -> None:  # fmt: skip
        self._via = via
        self.most = most  # `[redis] repair_backlog`
        self.metrics = metrics
        # Members that lost fills here, and when last (behind.py keeps their notes; this
        # run counts them no more until caught up: `on_drop`).
        self.dropped = dropped
        self.on_drop = on_drop

    def queue(self, member: MemberLink, fills: Iterable[Fill], front: bool = False) -> None:
        if front:
            member.backlog.extendleft(reversed(list(fills)))
        else:
            member.backlog.extend(fills)
        dropped = len(member.backlog) - self.most
        if dropped > 0:
            for _ in range(dropped):
                member.backlog.popleft()  # the oldest first: the newest marks matter longest
            self.metrics.repairs_dropped.labels(member.name).inc(dropped)
            self.dropped[member.name] = time.monotonic()
            self.on_drop(member)
        self.metrics.repair_backlog.labels(member.name).set(len(member.backlog))

    def take(self, member: MemberLink) -> list[Fill]:
        """Up to one chunk of queued fills, when the member's epoch is known."""
        if not member.backlog or member.epoch is None or member.paused:
            return []
        taken = [
            member.backlog.popleft() for _ in range(min(len(member.backlog), sizing.CHUNK_DIGESTS))
        ]
        self.metrics.repair_backlog.labels(member.name).set(len(member.backlog))
        return taken

    async def send(self, member: MemberLink, fills: list[Fill]) -> bool:
        """Write queued fills (scripts.FILL), one call per group; those that got no
        answer go back to the front of the backlog. Whether every one was sent."""
        epoch_id, width = member.epoch.id if member.epoch else "", len(fills[0][0])

        def plan(group: Group, items: Sequence[int]) -> Planned:
            args = [*group.layout, epoch_id, width,
                    b"".join(fills[k][0] for k in items),
                    listed(fills[k][1] for k in items),
                    listed(fills[k][2] for k in items)]  # fmt: skip
            return [(("fill", [group.meta], args), items)]

        member.sending += 1  # until answered, the run's note that it is behind stays
        try:
            results = await self._via(member).grouped(member, "fill", [f[0] for f in fills], plan)
        finally:
            member.sending -= 1
        missed = [fills[k] for positions, result in results if result is None for k in positions]
        if missed:
            self.queue(member, missed, front=True)
        return not missed

    async def drain(self, member: MemberLink) -> None:
        """Send this member's queued fills, a chunk at a time, until the backlog seen at
        the start is sent or a call fails."""
        for _ in range(-(-len(member.backlog) // sizing.CHUNK_DIGESTS)):
            fills = self.take(member)
            if not fills or not await self.send(member, fills):
                return
