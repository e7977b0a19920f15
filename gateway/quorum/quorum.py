"""The quorum: N members, queried concurrently, a few short script calls each per batch.

This is the only module the data path calls Redis through. `Quorum` is the
facade; what it keeps per member, and why, lives beside it:

- `link.py`: one member's client and state, and the accounting of every call
  (up, failures by kind, down key groups of a cluster member);
- `transport.py`: how calls reach a member (chunks, pipelining, cluster routing);
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
import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence
from functools import partial
from typing import Any, TypeVar

from redis.exceptions import RedisError

from gateway.config import RedisSettings
from gateway.errors import ConfigError, CredentialsRefused
from gateway.member_urls import is_cluster, member_name
from gateway.metrics import Metrics
from gateway.quorum import native, scripts
from gateway.quorum.admin import Admin
from gateway.quorum.behind import Behind
from gateway.quorum.calls import Calls
from gateway.quorum.catchup import CatchUp
from gateway.quorum.epochs import Epochs
from gateway.quorum.fills import Fills
from gateway.quorum.identity import describe, run_id_of, shared
from gateway.quorum.keys import handover_key
from gateway.quorum.link import Fill, MemberLink
from gateway.quorum.members import Group, client_for, groups_for
from gateway.quorum.transport import ClusterTransport, Planned, Transport, chunks, place
from gateway.quorum.windows import Windows
from gateway.rules.commands import Handover
from gateway.rules.vote import MINE, Reply
from gateway.waits import FallingReport, wait_or_stop

logger = logging.getLogger(__name__)
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
        self.claim_setting = settings.claim
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
        self.catch_up = CatchUp(self)
        # The parts that take values: callers hold the one they use (quorum.windows,
        # quorum.admin); gateway/quorum/copy.py still asks these three through here.
        self.calls = Calls(self.members, self._via, self.epochs, self.refresh_epochs)
        self.windows = Windows(self.calls)
        self.admin = Admin(self.calls)
        self.lookup = self.admin.lookup
        self.export = self.admin.export
        self.import_marks = self.admin.import_marks
        metrics.quorum_size.set(self.majority)

    def _via(self, inst: MemberLink) -> Transport:
        return self._cluster if inst.cluster else self._standalone

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
        return [inst.counted for inst in self.members]

    async def wait_for_majority(
        self, stop: asyncio.Event, retry_s: float = 1.0, report_max_s: float = 60.0
    ) -> None:
        """Return once a majority answers; read every epoch; name every member that
        does not answer.

        Tries every `retry_s` (a member that comes back is used at once), but says
        so in one WARNING line at a falling rate (`FallingReport`: at once, then
        after 2, 4, 8 ... seconds, at most every `report_max_s`). Raises
        `CredentialsRefused` when members refuse the URL's credentials and too few
        answer for a majority (with a majority answering, it serves, an ERROR per
        member refusing); `ConfigError` when members that answer are one
        redis-server (the same run_id).
        """
        report = FallingReport(retry_s, report_max_s)
        while not stop.is_set():
            await self.refresh_epochs(patient=True)
            # After the round, `failure` is set exactly on the members that did not answer.
            failed = {inst.name: inst.failure for inst in self.members if inst.failure}
            refused = [f"{name} ({detail})" for name, (kind, detail) in failed.items()
                       if kind == "auth"]  # fmt: skip
            answering = self.size - len(failed)
            if refused and answering < self.majority:
                raise CredentialsRefused(
                    "redis.nodes: credentials refused by "
                    + ", ".join(refused)
                    + "; check the user and password in these URLs"
                )
            down = [f"{name} ({kind}: {detail})" for name, (kind, detail) in failed.items()]
            names = {"redis": ", ".join(failed)}
            if answering >= self.majority:
                await self._refuse_one_server()
                await asyncio.gather(*(self.choose_claim(i, at_start=True)
                                       for i in self.members if i.up))  # fmt: skip
                for name, (kind, detail) in failed.items():
                    if kind == "auth":  # a password rotated on one member: serve, say so
                        logger.error("Redis member %s refuses the URL's credentials (%s): "
                                     "serving without it; fix its user and password",
                                     name, detail, extra={"redis": name})  # fmt: skip
                if down:
                    logger.warning("serving with Redis members unreachable: %s",
                                   ", ".join(down), extra=names)  # fmt: skip
                return
            if report.due():
                logger.warning(
                    "cannot reach a Redis majority (%d of %d needed, %d answer); unreachable: "
                    "%s; not ready, retrying every %gs (next report in %gs)",
                    self.majority, self.size, self.size - len(failed), ", ".join(down),
                    retry_s, report.every, extra=names,
                )  # fmt: skip
            await wait_or_stop(stop, retry_s)

    async def _refuse_one_server(self) -> None:
        """Raise ConfigError when members that answer are one redis-server
        (gateway/quorum/identity.py)."""

        async def info(inst: MemberLink) -> object:
            # Not `timed`: an ACL without INFO must not count the member as failing.
            try:
                return await asyncio.wait_for(inst.client.info("server"), self.timeout)
            except (TimeoutError, RedisError, OSError):
                return None  # cannot tell: not refused

        named = [i.name for i in self.members if i.up and not i.cluster]
        infos = await asyncio.gather(*(info(i) for i in self.members if i.name in named))
        groups = shared(dict(zip(named, map(run_id_of, infos), strict=True)))
        if groups:
            raise ConfigError(describe(groups))

    async def choose_claim(self, inst: MemberLink, at_start: bool = False) -> None:
        """Decide how `inst`'s claims run (`[redis] claim`), once, and say so in a log
        line: the native claim where the setting allows it and the member has the
        module at this gateway's version (gateway/quorum/native), else the Lua script.
        `module` on a member without it: ConfigError at start-up (`at_start`), an
        ERROR line and the Lua script later (a member that came back without it
        still dedups, with the same replies). A member that cannot be asked now
        (down) stays undecided: the Lua script, asked again at its next claim."""
        if inst.claim_path:
            return
        setting = f'[redis] claim = "{self.claim_setting}"'
        if self.claim_setting == "lua" or inst.cluster:
            why = setting if self.claim_setting == "lua" else "a Redis Cluster member"
            self._use_claim(inst, "lua", why)
            return
        try:
            has, why = await asyncio.wait_for(native.loaded(inst.client), self.timeout)
        except (TimeoutError, RedisError, OSError):
            return  # no answer: asked again at its next claim
        if has:
            self._use_claim(inst, "module", why)
            return
        if self.claim_setting == "module":
            message = (
                f"{setting}: Redis member {inst.name} has no native claim ({why}); load the "
                'module there (`loadmodule`, docs/operations.md, "The native claim") or set '
                'claim = "auto"'
            )
            if at_start:
                raise ConfigError(message)
            logger.error("%s; its claims run as the Lua script meanwhile", message,
                         extra={"redis": inst.name})  # fmt: skip
        self._use_claim(inst, "lua", f"{setting}: {why}")

    def _use_claim(self, inst: MemberLink, path: str, why: str) -> None:
        script = inst.scripts["claim"]
        lua = script.lua if isinstance(script, native.NativeClaim) else script
        inst.scripts["claim"] = native.NativeClaim(inst.client, lua) if path == "module" else lua
        inst.claim_path = path
        extra = {"redis": inst.name, "claim": path}
        if path == "lua":
            logger.info("Redis member %s: claims run as the Lua script (%s)", inst.name, why,
                        extra=extra)  # fmt: skip
        else:
            logger.info("Redis member %s: claims run as the native module command DD.CLAIM "
                        "(%s)", inst.name, why, extra=extra)  # fmt: skip

    def _lost_module(self, inst: MemberLink) -> None:
        """A member whose native claim was refused as an unknown command (it restarted
        without the module): the Lua script from its next claim, and decided again."""
        if inst.claim_path == "module" and inst.failure is not None:
            kind, detail = inst.failure
            if kind == "response" and "unknown command" in detail.lower():
                logger.warning("Redis member %s no longer has the native claim (%s): its "
                               "claims run as the Lua script until it is checked again",
                               inst.name, detail, extra={"redis": inst.name})  # fmt: skip
                self._use_claim(inst, "lua", "the module went away")
                inst.claim_path = ""

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
        await asyncio.gather(*(self._drain(inst) for inst in self.members if inst.up))
        await self.behind.note(self.behind.holding())  # a live run's notes never go stale
        self.catch_up.start()  # a member behind: gateway/quorum/catchup.py
        for inst, fill in zip(self.members, await self.slice_fill(), strict=True):
            if fill is not None and fill[1]:
                self.metrics.redis_marks_per_bucket.labels(inst.name).set(fill[0] / fill[1])

    async def slice_fill(self) -> list[tuple[int, int] | None]:
        """Per member, its current slice's (marks, buckets) (scripts.SLICE_FILL; a
        cluster member's first key group, whose share is any group's); None for no
        answer, (0, 0) before its first claim."""

        async def one(inst: MemberLink) -> tuple[int, int] | None:
            if not inst.up:
                return None
            got = await self.run_script(inst, "slice_fill", list(inst.groups[0].layout))
            return None if got is None else (int(got[0]), int(got[1]))

        return list(await asyncio.gather(*(one(i) for i in self.members)))

    async def _drain(self, inst: MemberLink) -> None:
        await self.fills.drain(inst)
        await self.behind.clear(inst)

    async def drain_at_stop(self, bound_s: float = 5.0) -> None:
        """At a graceful stop (the loops stopped): send every queued fill, trying
        for `bound_s` (and at most one `[redis] timeout` more), and clear this run's
        notes. What cannot be sent is counted and logged; the members that lack it
        stay noted as behind (not counted by the next gateway) until a rebuild
        completes them or the notes expire (gateway/quorum/behind.py)."""
        deadline = asyncio.get_running_loop().time() + bound_s
        await asyncio.gather(*(self._drain_until(inst, deadline) for inst in self.members))
        for inst in self.members:
            if inst.backlog:
                lost = len(inst.backlog)
                self.metrics.repairs_lost_at_stop.labels(inst.name).inc(lost)
                logger.warning(
                    "stopping with %d fill(s) for Redis member %s not sent within %gs: it stays "
                    "noted as behind (not counted by any gateway) until a gateway caught it up "
                    "(`dedup-gateway rebuild %s` does too)", lost, inst.name, bound_s, inst.name,
                    extra={"redis": inst.name},
                )  # fmt: skip

    async def _drain_until(self, inst: MemberLink, deadline: float) -> None:
        """Send the member's backlog until it is empty or `deadline` passed (each try
        is bounded by `[redis] timeout`), then clear this run's note if it is."""
        loop = asyncio.get_running_loop()
        while inst.backlog and loop.time() < deadline:
            if inst.epoch is None or inst.paused:
                await self.epochs.refresh()
            await self.fills.drain(inst)
            if inst.backlog:
                await asyncio.sleep(min(self.timeout, max(0.0, deadline - loop.time())))
        await self.behind.clear(inst)

    async def refresh_epochs(self, patient: bool = False) -> None:
        """Read every member's epoch and decide its trust (gateway/quorum/epochs.py)."""
        await self.epochs.refresh(patient)

    # -- the data path ----------------------------------------------------------

    async def claim(self, digests: Sequence[bytes], owners: Sequence[str]) -> list[list[Reply]]:
        """Per member, the reply for each digest: MINE, the owner that holds it, or
        None where the member gave no answer (down, timed out, its chunk failed, or
        its data was lost since we last looked, or it is paused). A member that is
        not trusted answers too: `counted()` says which answers the vote may count.

        Every digest must have the same length (they do: `keys.mark_digest`).
        """
        if not digests:
            return [[] for _ in self.members]
        if not self.epochs.read:
            await self.refresh_epochs()
        n, width = len(digests), len(digests[0])
        # What every standalone member gets the same of, built once per batch: a chunk's
        # digests and tokens, and the decoding of a chunk's replies another member
        # answered alike (the usual case).
        payloads: dict[tuple[int, int], tuple[bytes, str]] = {}
        decoded: dict[tuple[int, int], tuple[list[Any], list[Reply]]] = {}

        def payload(chunk: Sequence[int]) -> tuple[bytes, str]:
            if not isinstance(chunk, range):  # a cluster group's items: gathered
                return (b"".join([digests[k] for k in chunk]),
                        ",".join([owners[k] for k in chunk]) + ",")  # fmt: skip
            key = (chunk.start, chunk.stop)
            built = payloads.get(key)
            if built is None:  # the whole batch in order: slice, do not gather
                built = payloads[key] = (
                    b"".join(digests[chunk.start : chunk.stop]),
                    ",".join(owners[chunk.start : chunk.stop]) + ",",
                )
            return built

        def plan(epoch_id: str, group: Group, items: Sequence[int]) -> Planned:
            head = [*group.layout, epoch_id, width]
            planned: Planned = []
            for chunk in chunks(items):
                blob, tokens = payload(chunk)
                planned.append((("claim", [group.meta], [*head, blob, tokens]), chunk))
            return planned

        def readable(positions: Sequence[int], result: list[Any]) -> list[Reply]:
            """The chunk's replies with the other owners' tokens as text."""
            if result.count(MINE) == len(result):
                return result
            if not isinstance(positions, range):
                return [r if r == MINE else r.decode() for r in result]
            key = (positions.start, positions.stop)
            seen = decoded.get(key)
            if seen is not None and seen[0] == result:
                return seen[1]
            text: list[Reply] = [r if r == MINE else r.decode() for r in result]
            decoded[key] = (result, text)
            return text

        async def one(inst: MemberLink) -> list[Reply]:
            # A member that answers gets the claims of one vote after another, in the
            # order the votes began: the raw loop claims a batch while it finishes the one
            # before, and copies of an id in both, reaching two members in opposite
            # orders, split them 1:1, which no vote decides while a third member does
            # not answer (the partitions blocked until it did: test_repair_queue.py). A
            # member that does not answer gets no claim while an earlier vote's is in
            # flight (no answer, as a timeout): sent beside it, both could run when it
            # came back, in either order; waited for, a hung member would hold every
            # vote for a timeout each.
            if not inst.up and inst.claiming.locked():
                return [None] * n
            async with inst.claiming:
                return await claimed(inst)

        async def claimed(inst: MemberLink) -> list[Reply]:
            if inst.epoch is None or inst.paused:  # what it would answer could not be counted
                return [None] * n
            # The epoch these claims expect: the one known now (the fills' answer may
            # change what the gateway knows; the scripts then refuse).
            epoch_id = inst.epoch.id
            fills = self.fills.take(inst)
            if fills:  # first, so that this batch's claims see the completed marks
                sent = await self.fills.send(inst, fills)
                if sent:
                    await self.behind.clear(inst)
            if not inst.claim_path and inst.up:  # a member down is not waited for twice
                await self.choose_claim(inst)
            results = await self._via(inst).grouped(inst, "claim", digests, partial(plan, epoch_id))
            if any(result is None for _, result in results):
                self._lost_module(inst)
            replies: list[Reply] = [None] * n
            for positions, result in results:
                if result is not None:
                    place(replies, positions, readable(positions, result))
            return replies

        out = list(await asyncio.gather(*(one(inst) for inst in self.members)))
        if self.epochs.reread:
            await self.refresh_epochs()
        return out

    async def settle(
        self,
        repairs: Sequence[list[tuple[bytes, str, str]]],
        fills: Sequence[Iterable[Fill]],
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

    def queue_fills(self, per_instance: Sequence[Iterable[Fill]]) -> None:
        """Marks to complete later: per member, (digest, winner, token sent) for the
        votes it gave no answer to (see scripts.FILL)."""
        for inst, fills in zip(self.members, per_instance, strict=True):
            self.fills.queue(inst, fills)

    async def repair(self, per_instance: Sequence[list[tuple[bytes, str, str]]]) -> int:
        """Rewrite (digest, seen owner, winner) marks where they still hold what was seen.

        A chunk that gets no answer is queued as fills (digest, winner, seen): the
        fill writes the winner where the mark still holds `seen`, once the member
        answers. Dropped instead, a split left unrepaired would outlive the vote, and
        with another member recovering a later copy could win its tie.
        """

        async def one(inst: MemberLink, todo: list[tuple[bytes, str, str]]) -> int:
            if not todo:
                return 0

            def plan(group: Group, items: Sequence[int]) -> Planned:
                return [(("repair", [group.meta],
                          [*group.layout, *(v for k in chunk for v in todo[k])]), chunk)
                        for chunk in chunks(items)]  # fmt: skip

            results = await self._via(inst).grouped(inst, "repair", [d for d, _, _ in todo], plan)
            missed = [(todo[k][0], todo[k][2], todo[k][1])
                      for positions, result in results if result is None
                      for k in positions]  # fmt: skip
            if missed:
                self.fills.queue(inst, missed)
            return sum(int(result or 0) for _, result in results)

        results = await asyncio.gather(
            *(one(inst, todo) for inst, todo in zip(self.members, per_instance, strict=True))
        )
        repaired = sum(results)
        self.metrics.repairs.inc(repaired)
        return repaired

    async def release(
        self, digests: Sequence[bytes], tokens: Sequence[str]
    ) -> list[list[int | None]]:
        """Per member, per digest: 1 released now, 2 released from that token before
        (a repeated or redone command), 3 no live mark, 0 held by another owner; None
        for no answer (or a member that is not counted)."""

        def plan(group: Group, items: Sequence[int]) -> Planned:
            args = [*group.layout, *(v for k in items for v in (digests[k], tokens[k]))]
            return [(("release", [group.meta], args), items)]

        return await self.per_item_on_counted("release", digests, plan)

    async def handover(self, marks: Sequence[Handover]) -> list[list[int | None]]:
        """Per member, per command, HANDOVER's reply (`HANDED_OVER_NOW` ...
        `NOT_OURS`, above); None for no answer (or a member that is not counted)."""
        digests = [m.digest for m in marks]

        def plan(epoch_id: str, group: Group, items: Sequence[int]) -> Planned:
            keys = [group.meta, *(handover_key(group.prefix, digests[k]) for k in items)]
            args = [*group.layout, epoch_id, b"".join(digests[k] for k in items)]
            for m in (marks[k] for k in items):
                args += (m.failed, m.next, m.ref, *("".join(f"{t}," for t in ts)
                                                    for ts in (m.earlier, m.later)))  # fmt: skip
            return [(("handover", keys, args), items)]

        results = await self.per_item_on_counted("handover", digests, plan, needs_epoch=True)
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

    async def per_item_on_counted(
        self, what: str, digests: Sequence[bytes],
        plan: Callable[..., Planned], needs_epoch: bool = False,
    ) -> list[list[int | None]]:  # fmt: skip
        """Per member, per digest, the counted replies (gateway/quorum/calls.py)."""
        return await self.calls.per_item_on_counted(what, digests, plan, needs_epoch)

    # -- the parts' calls, as the callers know them ---------------------------------

    async def run_script(
        self, inst: MemberLink, name: str, args: list[Any], bound_s: float | None = None,
        group: int = 0,
    ) -> Any | None:  # fmt: skip
        return await self.calls.run_script(inst, name, args, bound_s, group)

    async def _timed(
        self, inst: MemberLink, script: str, call: Callable[[], Awaitable[T]]
    ) -> T | None:
        return await inst.timed(script, call)

    async def close(self) -> None:
        await self.catch_up.close()
        for inst in self.members:
            await inst.close()
