"""The quorum: N members, queried concurrently, a few short script calls each per batch.

This is the only module the data path calls Redis through. `Quorum` is the
facade; what it keeps per member, and why, lives beside it:

- `link.py`: one member's client and state, and the accounting of every call
  (up, failures by kind, down key groups of a cluster member);
- `transport.py`: how calls reach a member (chunks, pipelining, cluster routing);
- `startup.py`: the start-up wait for a majority (and members that are one server);
- `claims.py`: one vote's claims on every member, in order per member, and
  `claim_path.py`, whether a member's run as the native claim or the Lua script;
- `repairs.py`: what a vote leaves to do (repairs, fills, behind notes) and
  sending it, by the watch and at a graceful stop;
- `epochs.py`: whether a member still holds the marks it was given (its trust);
- `fills.py`: the winners' marks to complete on a member that gave no answer;
- `behind.py`: the notes on the other members that this run holds fills for one,
  so that a gateway stop leaves it not counted instead of silently incomplete;
- `catchup.py`: a member only behind, caught up from the counted members by the
  gateways themselves (`copy.py`, which `rebuild` uses too);
- `windows.py`: the coalescing windows' calls;
- `admin.py`: what operator commands, `rebuild` and tests ask of one member.

A paused member (`dedup-gateway pause`) has a flag in every group that makes the
writing scripts refuse (`paused:`): it is not counted and gets no claims, so its
slots can be migrated; `resume` clears it. The healthy gauge is set in one place
(`_publish_health`), whenever a member's up, trust or pause changes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence
from typing import Any, TypeVar

from gateway.config import RedisSettings
from gateway.member_urls import is_cluster, member_name
from gateway.metrics import Metrics
from gateway.quorum import scripts
from gateway.quorum.admin import Admin
from gateway.quorum.behind import Behind
from gateway.quorum.calls import Calls, ItemReply
from gateway.quorum.catchup import CatchUp
from gateway.quorum.claim_path import ClaimPaths
from gateway.quorum.claims import Claims
from gateway.quorum.epochs import Epochs
from gateway.quorum.fills import Fills
from gateway.quorum.keys import handover_key
from gateway.quorum.link import Fill, MemberLink
from gateway.quorum.members import Group, client_for, groups_for
from gateway.quorum.repairs import Repair, Repairs
from gateway.quorum.scripts import listed
from gateway.quorum.startup import MajorityWait
from gateway.quorum.transport import ClusterTransport, Planned, Transport
from gateway.quorum.windows import Windows
from gateway.rules.commands import Handover
from gateway.rules.vote import Reply
from gateway.waits import wait_or_stop

T = TypeVar("T")


class Quorum:
    """The members of `[redis] nodes` and the calls the gateway makes to them."""

    def __init__(
        self, settings: RedisSettings, metrics: Metrics, transport: type[Transport] = Transport,
        writes_epochs: bool = True,
    ) -> None:  # fmt: skip
        self.metrics = metrics
        self.timeout = settings.timeout.total_seconds()
        self.ping_interval = settings.ping_interval.total_seconds()
        self.ttl_ms = int(settings.ttl.total_seconds() * 1000)
        self.prefix = settings.key_prefix.encode()
        # What every mark script takes after the key prefix (gateway/quorum/scripts.py).
        tail = (self.ttl_ms, self.ttl_ms // scripts.SLICES_BACK, settings.buckets)
        self.layout: list[Any] = [self.prefix, *tail]  # a standalone member's
        self.size = len(settings.nodes)
        self.majority = self.size // 2 + 1
        self.members: list[MemberLink] = []
        for url in settings.nodes:
            count = settings.cluster_groups if is_cluster(url) else 1
            client = client_for(url, self.timeout, count)
            # `buckets` counts a member's buckets per slice: a cluster's groups share them.
            per_group = (*tail[:2], max(1, settings.buckets // count))
            self.members.append(
                MemberLink(
                    name=member_name(url),
                    client=client,
                    scripts={
                        name: client.register_script(getattr(scripts, name.upper()))
                        for name in scripts.NAMES
                    },
                    groups=groups_for(self.prefix, per_group, count),
                    metrics=metrics,
                    timeout=self.timeout,
                    on_health=self._publish_health,
                    url=url,
                )
            )
        # A mark lives at most ttl * (1 + 1/SLICES_BACK): after that long, a member
        # that lost its data has every mark it could have missed gone too.
        recovery_ms = self.ttl_ms + self.ttl_ms // scripts.SLICES_BACK
        self.behind = Behind(self.members, self._via, self.ttl_ms, self.ping_interval,
                             recovery_ms, metrics)  # fmt: skip
        self.epochs = Epochs(self.members, self._via, self.majority, self.timeout, recovery_ms,
                             self.behind, writes_epochs)  # fmt: skip
        self._standalone = transport(self.epochs.refused)
        self._cluster = ClusterTransport(self.epochs.refused)
        self.fills = Fills(self._via, settings.repair_backlog, metrics, self.behind.dropped,
                           self.epochs.lacks)  # fmt: skip
        self.claim_paths = ClaimPaths(settings.claim, self.timeout)
        self.claims = Claims(self.members, self._via, self.epochs, self.fills, self.behind,
                             self.claim_paths)  # fmt: skip
        self.repairs = Repairs(self.members, self._via, self.fills, self.behind, self.epochs,
                               metrics, self.timeout)  # fmt: skip
        self.start_up = MajorityWait(self.members, self.majority, self.timeout,
                                     self.refresh_epochs, self.claim_paths.choose)  # fmt: skip
        # The parts that take values: callers hold the one they use (quorum.windows,
        # quorum.admin).
        self.calls = Calls(self.members, self._via, self.epochs, self.refresh_epochs)
        self.windows = Windows(self.calls)
        self.admin = Admin(self.calls)
        self.catch_up = CatchUp(self.members, self.behind, self.admin, metrics,
                                self.refresh_epochs)  # fmt: skip
        metrics.quorum_size.set(self.majority)

    def _via(self, member: MemberLink) -> Transport:
        return self._cluster if member.cluster else self._standalone

    def _publish_health(self) -> None:
        self.metrics.quorum_healthy.set(1 if self.healthy else 0)

    # -- health ---------------------------------------------------------------

    @property
    def healthy(self) -> bool:
        """A majority of members answers and holds the marks it was given."""
        return sum(i.up and i.counted for i in self.members) >= self.majority

    def why_unhealthy(self) -> str:
        """For /readyz: which members keep the quorum from a trusted majority."""
        down = ", ".join(i.name for i in self.members if not i.up)
        paused = ", ".join(i.name for i in self.members if i.up and i.paused)
        recovering = ", ".join(
            i.name for i in self.members if i.up and not i.paused and not i.trusted
            and not i.lagging
        )  # fmt: skip
        behind = ", ".join(i.name for i in self.members if i.up and not i.paused and i.lagging)
        why = f"no Redis majority ({self.majority} of {self.size}) up and trusted"
        if down:
            why += f"; down: {down}"
        if paused:
            why += f"; paused: {paused}"
        if recovering:
            why += f"; recovering (lost their marks: `dedup-gateway rebuild`): {recovering}"
        if behind:
            why += f"; behind (missed some marks: the gateways catch them up): {behind}"
        return why

    def counted(self) -> list[bool]:
        """Per member, whether the vote may count its answers (trusted, not paused)."""
        return [member.counted for member in self.members]

    async def wait_for_majority(
        self, stop: asyncio.Event, retry_s: float = 1.0, report_max_s: float = 60.0
    ) -> None:
        """Return once a majority answers, every epoch read and every claim path
        decided (gateway/quorum/startup.py)."""
        await self.start_up.wait(stop, retry_s, report_max_s)

    def not_answering(self) -> str:
        """For /readyz while ready: the members that do not answer, and why."""
        out = [f"{i.name} ({i.failure[0]})" for i in self.members if not i.up and i.failure]
        return f"; not answering: {', '.join(out)}" if out else ""

    async def watch(self, stop: asyncio.Event) -> None:
        """Until `stop`: every `[redis] ping_interval`, `check` every member. Without
        it, up/down and trust would change only when a batch flows."""
        while not stop.is_set():
            await self.check()
            await wait_or_stop(stop, self.ping_interval)

    async def check(self) -> None:
        """Read every member's epoch (which pings it), then send queued fills to
        the members that answer, and read their current slice's fill (the metric)."""
        await self.refresh_epochs()
        await self.repairs.drain()
        await self.behind.note(self.behind.holding())  # a live run's notes never go stale
        self.catch_up.start()  # a member behind: gateway/quorum/catchup.py
        for member, fill in zip(self.members, await self.slice_fill(), strict=True):
            if fill is not None and fill[1]:
                self.metrics.redis_marks_per_bucket.labels(member.name).set(fill[0] / fill[1])

    async def slice_fill(self) -> list[tuple[int, int] | None]:
        """Per member, its current slice's (marks, buckets) (scripts.SLICE_FILL; a
        cluster member's first key group, whose share is any group's); None for no
        answer, (0, 0) before its first claim."""

        async def one(member: MemberLink) -> tuple[int, int] | None:
            if not member.up:
                return None
            got = await self.calls.run_script(member, "slice_fill", list(member.groups[0].layout))
            return None if got is None else (int(got[0]), int(got[1]))

        return list(await asyncio.gather(*(one(i) for i in self.members)))

    async def drain_at_stop(self, bound_s: float = 5.0) -> None:
        """At a graceful stop: send every queued fill within `bound_s`
        (gateway/quorum/repairs.py)."""
        await self.repairs.drain_at_stop(bound_s)

    async def refresh_epochs(self, patient: bool = False) -> None:
        """Read every member's epoch and decide its trust (gateway/quorum/epochs.py)."""
        await self.epochs.refresh(patient)

    # -- the data path ----------------------------------------------------------

    async def claim(self, digests: Sequence[bytes], owners: Sequence[str]) -> list[list[Reply]]:
        """Per member, the reply for each digest: MINE, the owner that holds it, or
        None where the member gave no answer (gateway/quorum/claims.py). A member that
        is not trusted answers too: `counted()` says which answers the vote may count."""
        return await self.claims.claim(digests, owners)

    async def settle(
        self, repairs: Sequence[list[Repair]], fills: Sequence[Iterable[Fill]]
    ) -> bool:
        """After a vote: repair, queue fills, note behind (gateway/quorum/repairs.py).
        False when the note did not stand: the batch must be tried again."""
        return await self.repairs.settle(repairs, fills)

    async def note_behind(self) -> bool:
        """Note every member this run holds fills for on the others; whether they stand."""
        return await self.repairs.note_behind()

    def queue_fills(self, per_member: Sequence[Iterable[Fill]]) -> None:
        """Per member, (digest, winner, token sent) to complete later."""
        self.repairs.queue_fills(per_member)

    async def repair(self, per_member: Sequence[list[Repair]]) -> int:
        """Rewrite (digest, seen owner, winner) marks where they still hold what was seen."""
        return await self.repairs.repair(per_member)

    async def release(
        self, digests: Sequence[bytes], tokens: Sequence[str]
    ) -> list[list[ItemReply | None]]:
        """Per member, per digest: 1 released now, 2 released from that token before
        (a repeated or redone command), 3 no live mark, 0 held by another owner; None
        for no answer (or a member that is not counted)."""

        def plan(group: Group, items: Sequence[int]) -> Planned:
            args = [*group.layout, *(v for k in items for v in (digests[k], tokens[k]))]
            return [(("release", [group.meta], args), items)]

        return await self.calls.per_item_on_counted("release", digests, plan)

    async def handover(self, marks: Sequence[Handover]) -> list[list[ItemReply | None]]:
        """Per member, per command, HANDOVER's reply (`HANDED_OVER_NOW` ...
        `NOT_OURS`, above); None for no answer (or a member that is not counted)."""
        digests = [m.digest for m in marks]

        def plan(epoch_id: str, group: Group, items: Sequence[int]) -> Planned:
            keys = [group.meta, *(handover_key(group.prefix, digests[k]) for k in items)]
            args = [*group.layout, epoch_id, b"".join(digests[k] for k in items)]
            for m in (marks[k] for k in items):
                args += (m.failed, m.next, m.ref, *(listed(ts)
                                                    for ts in (m.earlier, m.later)))  # fmt: skip
            return [(("handover", keys, args), items)]

        results = await self.calls.per_item_on_counted("handover", digests, plan, needs_epoch=True)
        if self.epochs.reread:
            await self.refresh_epochs()
        return results

    async def mark_done(self, digests: Sequence[bytes], refs: Sequence[str]) -> None:
        """Note that these commands' effects are acknowledged (see scripts.MARK_DONE)."""

        def plan(group: Group, items: Sequence[int]) -> Planned:
            keys = [handover_key(group.prefix, digests[k]) for k in items]
            return [(("mark_done", keys, [refs[k] for k in items]), items)]

        await asyncio.gather(*(self._via(i).grouped(i, "mark_done", digests, plan)
                               for i in self.members))  # fmt: skip

    async def close(self) -> None:
        await self.catch_up.close()
        for member in self.members:
            await member.close()
