"""How calls reach a member: in chunks, pipelined, per key group; standalone or cluster.

A batch's digests go to each key group in chunks of `sizing.CHUNK_DIGESTS`, in
order (so the first copy of an id in a batch still wins: its copies share a
digest, so a group). A standalone member gets `sizing.CHUNKS_PER_TRIP` chunks
pipelined per round trip on one connection (`Transport`); a cluster member's
calls go to the master serving their group (by the client's slot map),
pipelined the same way on a connection to that node, the masters side by side,
and the cluster client takes over for a call a node did not run (slots moved,
failover) (`ClusterTransport`). A chunk that fails gives no answer (`None`) for
its digests only; after a timeout or a lost connection the group's chunks not
yet sent are not sent.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import (
    AskError,
    ClusterDownError,
    NoScriptError,
    ResponseError,
    SlotNotCoveredError,
    TryAgainError,
)

from gateway import sizing
from gateway.quorum import native
from gateway.quorum.link import MemberLink
from gateway.quorum.members import Group, node_client_for, split

Call = tuple[str, list[Any], list[Any]]  # a script's name, its keys and its arguments
# Calls for one group, each with the positions (in the caller's list) of the items it carries.
Planned = list[tuple[Call, Sequence[int]]]
# Whether a script's reply refused to write (another epoch, a pause): epochs.py decides.
Refused = Callable[[MemberLink, bytes], bool]
# Replies of a cluster node that did not run the call where it was sent: slots moving
# (MOVED, a subclass of ASK), a failover or resharding under way (TRYAGAIN,
# CLUSTERDOWN): sent again through the cluster client, which knows what to do.
_MISPLACED = (AskError, TryAgainError, ClusterDownError)


class Transport:
    """A standalone member's calls: chunks pipelined on its one connection."""

    def __init__(self, refused: Refused) -> None:
        self.refused = refused

    async def grouped(
        self, member: MemberLink, what: str, digests: Sequence[bytes],
        plan: Callable[[Group, Sequence[int]], Planned],
    ) -> list[tuple[Sequence[int], Any | None]]:  # fmt: skip
        """The calls `plan` makes for each group's items of `digests` (positions in
        order); per call, its item positions and its reply (None: no answer)."""
        planned = plan(member.groups[0], range(len(digests)))
        replies = await self.run(member, what, [call for call, _ in planned])
        return [(positions, r) for (_, positions), r in zip(planned, replies, strict=True)]

    async def in_chunks(
        self, member: MemberLink, script: str, digests: Sequence[bytes],
        args_of: Callable[[Sequence[int]], list[Any]], width: int,
    ) -> list[Any] | None:  # fmt: skip
        """`script` on `member` over the items of `digests` in chunks of
        `sizing.CHUNK_DIGESTS` per group, the arguments of items `k` being the
        group's layout and `args_of(k)`; per item its `width` replies, or None when a
        chunk got no answer."""

        def plan(group: Group, items: Sequence[int]) -> Planned:
            return [((script, [group.meta], [*group.layout, *args_of(chunk)]), chunk)
                    for chunk in chunks(items)]  # fmt: skip

        results = await self.grouped(member, script, digests, plan)
        out: list[Any] = [None] * len(digests)
        for positions, result in results:
            if result is None:
                return None
            for j, k in enumerate(positions):
                out[k] = result[j * width : (j + 1) * width]
        return out

    async def run(
        self, member: MemberLink, what: str, calls: Sequence[Call], group: int = 0
    ) -> list[Any | None]:
        """The calls on one group of `member`, in order, each round trip bounded by
        `[redis] timeout` (timed as `what`). The reply per call; None for a call that
        got no answer (after a timeout or a lost connection the calls not yet sent are
        not sent) or found another epoch or a pause. A standalone member gets
        `sizing.CHUNKS_PER_TRIP` calls per round trip on one connection; a cluster
        member one call at a time, routed by the client (MOVED, ASK, failovers)."""
        results: list[Any | None] = [None] * len(calls)
        per_trip = 1 if member.cluster else sizing.CHUNKS_PER_TRIP
        for start in range(0, len(calls), per_trip):
            trip = range(start, min(start + per_trip, len(calls)))
            if member.cluster:
                name, keys, args = calls[start]
                send = partial(self._one_call, member, name, keys, args)
            else:
                send = partial(self._pipelined, member, [calls[n] for n in trip])
            replies = await member.timed(what, send, group=group)
            if replies is None:
                return results
            for n, reply in zip(trip, replies, strict=True):
                if isinstance(reply, ResponseError):
                    member.failed("response", str(reply), group)
                elif isinstance(reply, bytes) and self.refused(member, reply):
                    return results
                else:
                    results[n] = reply
        return results

    async def run_script(
        self, member: MemberLink, name: str, args: list[Any], bound_s: float | None = None,
        group: int = 0,
    ) -> Any | None:  # fmt: skip
        """One call of script `name` on one group of `member`, bounded by `bound_s`
        (default: `[redis] timeout`); None for no answer (counted and logged like
        every other call). Its declared key: the group's epoch key for the epoch
        scripts, its slice meta for the others."""
        g = member.groups[group]
        keys = [g.epoch_key if name.startswith("epoch") or name == "pause" else g.meta]
        call = partial(self._script, member, name, keys, args)
        return await member.timed(name, call, bound_s, group)

    async def _one_call(
        self, member: MemberLink, name: str, keys: list[Any], args: list[Any]
    ) -> list[Any]:
        """A cluster member's call: the Script object loads the script where a node
        lacks it (a new or failed-over master)."""
        return [await self._script(member, name, keys, args)]

    async def _script(self, member: MemberLink, name: str, keys: list[Any], args: list[Any]) -> Any:
        """One EVALSHA (the script loaded where it is missing). A cluster member's
        calls are not queued behind each other: a bound on them let the calls to a
        dead master hold back the live masters' until they timed out too."""
        return await member.scripts[name](keys=keys, args=args)

    async def _pipelined(
        self, member: MemberLink, calls: list[Call], client: aioredis.Redis | None = None
    ) -> list[Any]:
        """EVALSHA per call in one pipeline on `client` (default: the member's own). A
        script the server does not have (it restarted) is loaded, and the calls it
        refused are sent once more."""
        on = client if client is not None else member.client
        replies = await self._send(member, calls, on)
        lost = [n for n, reply in enumerate(replies) if isinstance(reply, NoScriptError)]
        if lost:
            for name in {calls[n][0] for n in lost}:
                await on.script_load(member.scripts[name].script)
            again = await self._send(member, [calls[n] for n in lost], on)
            for n, reply in zip(lost, again, strict=True):
                replies[n] = reply
        return replies

    async def _send(
        self, member: MemberLink, calls: list[Call], client: aioredis.Redis | RedisCluster
    ) -> list[Any]:
        pipe = client.pipeline(transaction=False)
        for name, keys, args in calls:
            script = member.scripts[name]
            if getattr(script, "native", False):  # the module's command (gateway/quorum/native)
                pipe.execute_command(native.COMMAND, *keys, *args)
            else:
                pipe.evalsha(script.sha, len(keys), *keys, *args)
        replies: list[Any] = await pipe.execute(raise_on_error=False)
        return replies


class ClusterTransport(Transport):
    """A Redis Cluster member's calls: per key group, pipelined per master."""

    async def grouped(
        self, member: MemberLink, what: str, digests: Sequence[bytes],
        plan: Callable[[Group, Sequence[int]], Planned],
    ) -> list[tuple[Sequence[int], Any | None]]:  # fmt: skip
        calls = [(group, call, positions)
                 for group, items in split(digests, len(member.groups))
                 for call, positions in plan(member.groups[group], items)]  # fmt: skip
        replies = await self._on_masters(member, what, [(g, c, len(p)) for g, c, p in calls])
        return [(positions, r) for (_, _, positions), r in zip(calls, replies, strict=True)]

    async def _on_masters(
        self, member: MemberLink, what: str, calls: Sequence[tuple[int, Call, int]]
    ) -> list[Any | None]:
        """A cluster member's calls (group, call, digests it carries), pipelined per
        master: the calls of the groups a node serves (by the client's slot map) go
        on one connection of our own to it, in round trips of up to
        `CHUNK_DIGESTS * CHUNKS_PER_TRIP` digests, the masters side by side. A
        group's calls stay in order (one node, one connection, trips in turn). A call
        a trip could not place (MOVED, ASK, TRYAGAIN, CLUSTERDOWN: slots moving, a
        failover) or whose node refused the connection is sent again alone through
        the cluster client, which follows redirects and re-reads the slot map; a trip
        that timed out is not sent again (a hung node is not waited for twice). The
        reply per call, as `run` gives them.

        One call per group through the cluster client cost ~100 µs of the gateway's
        CPU each (a connection, a task and a timer per call): 3.3 µs per id for a
        batch over 64 groups, against 0.2 on a standalone member (bench/RESULTS.md).
        """
        results: list[Any | None] = [None] * len(calls)
        assert isinstance(member.client, RedisCluster)
        by_node: dict[str, list[int]] = {}
        alone: list[int] = []  # slots no node serves, as far as the client knows
        for n, (_, (_, keys, _), _) in enumerate(calls):
            try:
                node = member.client.get_node_from_key(keys[0])
            except SlotNotCoveredError:  # or no slot map yet: the cluster client reads one
                node = None
            if node is None:
                alone.append(n)
                continue
            if node.name not in member.nodes:
                assert member.url is not None
                member.nodes[node.name] = node_client_for(member.url, node.host, int(node.port),
                                                        member.timeout)  # fmt: skip
            by_node.setdefault(node.name, []).append(n)

        # A group whose call got no answer (or was refused) gets no more calls in this
        # batch: its chunks run in order, or not at all (as `run` does for a standalone
        # member). In a pipelined trip, a chunk whose script failed (ResponseError) stops
        # nothing, as there; a call sent again alone stops its group on any failure.
        stopped: set[int] = set()

        async def again(ns: Sequence[int]) -> None:
            for n in ns:
                group, call, _ = calls[n]
                if group not in stopped:
                    results[n] = (await self.run(member, what, [call], group))[0]
                    if results[n] is None:
                        stopped.add(group)

        async def on_node(name: str, ns: list[int]) -> None:
            for trip in trips(ns, [calls[n][2] for n in ns]):
                trip = [n for n in trip if calls[n][0] not in stopped]
                if not trip:
                    continue
                groups = sorted({calls[n][0] for n in trip})
                sent = [calls[n][1] for n in trip]
                send = partial(self._pipelined, member, sent, member.nodes[name])
                replies = await member.timed(what, send, group=groups)
                if replies is None:
                    if member.failure is not None and member.failure[0] == "connection":
                        await again(trip)
                    else:
                        stopped.update(groups)
                    continue
                misplaced = []
                for n, reply in zip(trip, replies, strict=True):
                    group = calls[n][0]
                    if group in stopped:  # an earlier chunk of its group got no answer here
                        continue
                    if isinstance(reply, _MISPLACED):
                        misplaced.append(n)
                    elif isinstance(reply, ResponseError):  # it ran and failed: its own only
                        member.failed("response", str(reply), group)
                    elif isinstance(reply, bytes) and self.refused(member, reply):
                        stopped.add(group)
                    else:
                        results[n] = reply
                await again(misplaced)

        await asyncio.gather(again(alone), *(on_node(name, ns) for name, ns in by_node.items()))
        return results


def trips(calls: list[int], sizes: Sequence[int]) -> list[list[int]]:
    """`calls` (with the digests each carries) in round trips of at most
    `CHUNK_DIGESTS * CHUNKS_PER_TRIP` digests, in order; a call alone may be one."""
    limit = sizing.CHUNK_DIGESTS * sizing.CHUNKS_PER_TRIP
    out: list[list[int]] = []
    size = limit
    for n, count in zip(calls, sizes, strict=True):
        if size + count > limit:
            out.append([])
            size = 0
        out[-1].append(n)
        size += count
    return out


def chunks(items: Sequence[int]) -> list[Sequence[int]]:
    """`items` in runs of `sizing.CHUNK_DIGESTS` (a range stays a range)."""
    size = sizing.CHUNK_DIGESTS
    return [items[a : a + size] for a in range(0, len(items), size)]


def place(out: list[Any], positions: Sequence[int], values: Sequence[Any]) -> None:
    """out[positions[j]] = values[j], as one slice assignment for a range."""
    if isinstance(positions, range):
        out[positions.start : positions.stop] = values
    else:
        for k, value in zip(positions, values, strict=True):
            out[k] = value
