"""The N quorum members, queried concurrently, a few short script calls each per batch.

This is the only module that talks to Redis on the data path. A member is a
redis-server or a Redis Cluster (gateway/members.py); its keys are in one
group (standalone) or `[redis] cluster_groups` hash-tag groups (cluster),
and every call goes to one group. What it keeps per member, and why:

- **Chunks.** A batch's digests go to each group in chunks of
  `scripts.CHUNK_DIGESTS`, in order (so the first copy of an id in a batch
  still wins: its copies share a digest, so a group). A standalone member
  gets `scripts.CHUNKS_PER_TRIP` chunks pipelined per round trip on one
  connection; a cluster member's calls go to the master serving their
  group (by the client's slot map), pipelined the same way on a connection
  to that node, the masters side by side; the cluster client takes over for
  a call a node did not run (slots moved, failover). A chunk costs Redis a few milliseconds
  at most, so no call holds an instance long enough to starve other gateways,
  and a round trip is bounded by `[redis] timeout` whatever
  `max_batch_records` is. A chunk that fails gives no answer (`None`) for its
  digests only; after a timeout or a lost connection the group's chunks not
  yet sent are not sent.
- **Up.** Whether the member answered its last call (a cluster member: while
  any of its groups does; `redis_groups_down` counts the others). `watch`
  reads every member's epoch every `[redis] ping_interval`, so an idle
  gateway notices a member that died or came back.
- **Epoch and trust.** Whether the member still holds the marks it was
  given (gateway/keys.py, "Epochs"). Every claim names the epoch it expects
  and writes nothing where another one is found; a member whose data was
  lost is *recovering*: its answers are returned but `counted()` says the
  vote must not count them, until `dedup-gateway rebuild` copied the marks
  into it or a whole mark lifetime (1.5 x ttl) has passed since its data began.
  A cluster member's epoch lives in group 0 and is copied to every group: a
  group that loses it (its node restarted empty) makes the whole member
  recovering.
- **Paused.** `dedup-gateway member pause` sets a flag in every group that
  makes the writing scripts refuse (`paused:`): the member is not counted
  and gets no claims, so its slots can be migrated; `resume` clears it.
- **Fill backlog.** Winners' marks for votes the member gave no answer to,
  bounded (oldest dropped, counted), sent before the next claim to it and by
  `watch`: a mark written on a bare majority does not stay that way.

Connection, timeout and response errors are told apart in the metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, TypeVar

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import (
    AskError,
    AuthenticationError,
    ClusterDownError,
    NoScriptError,
    RedisError,
    ResponseError,
    SlotNotCoveredError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from gateway import scripts
from gateway.config import RedisSettings
from gateway.errors import CredentialsRefused
from gateway.keys import EPOCH_RECOVERING, EPOCH_TRUSTED, Epoch, handover_key
from gateway.members import (
    Group,
    MemberUrl,
    client_for,
    group_of,
    groups_for,
    is_cluster,
    member_name,
    node_client_for,
    split,
)
from gateway.metrics import Metrics
from gateway.startup_wait import FallingReport
from gateway.vote import MINE, Reply

logger = logging.getLogger(__name__)
_CLOSED_TRANSPORT = "unable to perform operation on"  # uvloop: the handle is closed
T = TypeVar("T")

# A mark to complete on one member: (digest, winner token, token of the claim it
# gave no answer to: that claim may still have run, late).
Fill = tuple[bytes, str, str]
# How long the first epoch reads at start may take (connect, load the script).
FIRST_CONTACT_S = 2.0
Call = tuple[str, list[Any], list[Any]]  # a script's name, its keys and its arguments
# A mark a rebuild writes: digest, owner, remaining ms, handover note ('-': none, '?': keep
# the member's), its remaining ms.
Imported = tuple[bytes, str, int, str, int]
# Calls for one group, each with the positions (in the caller's list) of the items it carries.
Planned = list[tuple[Call, Sequence[int]]]
# Replies of a cluster node that did not run the call where it was sent: slots moving
# (MOVED, a subclass of ASK), a failover or resharding under way (TRYAGAIN,
# CLUSTERDOWN): sent again through the cluster client, which knows what to do.
_MISPLACED = (AskError, TryAgainError, ClusterDownError)


# RELEASE's reply per mark (scripts.RELEASE); `RELEASED` count towards a release.
HELD_BY_ANOTHER, RELEASED_NOW, RELEASED_BEFORE, NO_LIVE_MARK = 0, 1, 2, 3
RELEASED = (RELEASED_NOW, RELEASED_BEFORE)
# HANDOVER's reply per mark (scripts.HANDOVER); `MOVED` count as this command's move.
(NOT_OURS, HANDED_OVER_NOW, HANDED_OVER_BEFORE, HANDED_OVER_BY_ANOTHER_COPY, EFFECT_DONE,
 HELD_BY_LATER_ATTEMPT) = range(6)  # fmt: skip
MOVED = (HANDED_OVER_NOW, HANDED_OVER_BEFORE)


@dataclass(frozen=True)
class Handover:
    """One failure command's handover of a mark (scripts.HANDOVER)."""

    digest: bytes
    failed: str  # the token the failed attempt held
    next: str  # the next attempt's token, or the dead-letter token
    ref: str  # the command delivery's coordinates, noted with the handover
    # The same source record's earlier attempts' tokens: a member still holding one
    # missed a handover the majority made, and is handed over too.
    earlier: Sequence[str] = ()
    # Its later attempts' tokens and the dead letter's: a member holding one shows
    # that the command is stale.
    later: Sequence[str] = ()


@dataclass(frozen=True)
class MarkView:
    """One member's view of one id, for the operator."""

    owner: str | None  # None: no live mark
    ttl_ms: int  # of the bucket holding it; -2 when absent
    encoding: str | None  # "listpack" while the bucket is compact
    handed_over_by: str | None  # the failure command that last handed it over


@dataclass(frozen=True)
class EpochRead:
    """What a member said about its data (scripts.EPOCH_READ, all groups together)."""

    epoch: Epoch | None
    now_ms: int
    has_marks: bool
    paused: bool


@dataclass
class Instance:
    name: str  # host:port/db or cluster:host:port, never the password
    client: aioredis.Redis | RedisCluster
    scripts: dict[str, Any]  # redis-py Script objects by name: EVALSHA, reloaded on NOSCRIPT
    groups: list[Group]  # one for a standalone member
    up: bool = False
    failure: tuple[str, str] | None = None  # (kind, detail) of the last call, if it failed
    epoch: Epoch | None = None  # as last read; None: not known (no claims are sent)
    known_id: str | None = None  # the last epoch id this gateway knew it by
    trusted: bool = False  # its answers count in votes
    trust: str = ""  # "trusted", "recovering" or "unknown", as last logged
    paused: bool = False  # `dedup-gateway member pause`: no claims, not counted
    down_groups: set[int] = field(default_factory=set)  # groups whose last call failed
    backlog: deque[Fill] = field(default_factory=deque)
    url: MemberUrl | None = None  # a cluster member's, for `nodes`
    nodes: dict[str, aioredis.Redis] = field(default_factory=dict)  # by node name: pipelines

    @property
    def cluster(self) -> bool:
        return len(self.groups) > 1


class Quorum:
    """The instances of `[redis] nodes` and the calls the gateway makes to them."""

    def __init__(self, settings: RedisSettings, metrics: Metrics) -> None:
        self.metrics = metrics
        self.timeout = settings.timeout.total_seconds()
        self.ping_interval = settings.ping_interval.total_seconds()
        self.backlog_max = settings.repair_backlog
        self.ttl_ms = int(settings.ttl.total_seconds() * 1000)
        # A mark lives at most ttl * (1 + 1/SLICES_BACK): after that long, an
        # instance that lost its data has every mark it could have missed gone too.
        self.recovery_ms = self.ttl_ms + self.ttl_ms // scripts.SLICES_BACK
        self.prefix = settings.key_prefix.encode()
        # What every mark script takes after the key prefix (gateway/scripts.py).
        tail = (self.ttl_ms, self.ttl_ms // scripts.SLICES_BACK, settings.buckets)
        self.layout: list[Any] = [self.prefix, *tail]  # a standalone member's
        self.size = len(settings.nodes)
        self.majority = self.size // 2 + 1
        self._epochs_read = False
        self._reread = False  # a claim met another epoch: read them all again
        self.instances: list[Instance] = []
        for url in settings.nodes:
            count = settings.cluster_groups if is_cluster(url) else 1
            client = client_for(url, self.timeout, count)
            # `buckets` counts a member's buckets per slice: a cluster's groups share them.
            per_group = (*tail[:2], max(1, settings.buckets // count))
            self.instances.append(
                Instance(
                    name=member_name(url),
                    client=client,
                    scripts={
                        name: client.register_script(getattr(scripts, name.upper()))
                        for name in scripts.NAMES
                    },
                    groups=groups_for(self.prefix, per_group, count),
                    url=url,
                )
            )
        metrics.quorum_size.set(self.majority)

    # -- health ---------------------------------------------------------------

    @property
    def healthy(self) -> bool:
        """A majority of instances answers and holds the marks it was given."""
        return sum(i.up and i.trusted and not i.paused for i in self.instances) >= self.majority

    def why_unhealthy(self) -> str:
        """For /readyz: which instances keep the quorum from a trusted majority."""
        down = ", ".join(i.name for i in self.instances if not i.up)
        paused = ", ".join(i.name for i in self.instances if i.up and i.paused)
        recovering = ", ".join(
            i.name for i in self.instances if i.up and not i.paused and not i.trusted
        )
        why = f"no Redis majority ({self.majority} of {self.size}) up and trusted"
        if down:
            why += f"; down: {down}"
        if paused:
            why += f"; paused: {paused}"
        if recovering:
            why += f"; recovering (lost their marks): {recovering}"
        return why

    def counted(self) -> list[bool]:
        """Per member, whether the vote may count its answers (trusted, not paused)."""
        return [inst.trusted and not inst.paused for inst in self.instances]

    async def wait_for_majority(
        self, stop: asyncio.Event, retry_s: float = 1.0, report_max_s: float = 60.0
    ) -> None:
        """Return once a majority answers; read every epoch; name every instance that
        does not answer.

        Tries every `retry_s` (a member that comes back is used at once), but says
        so in one WARNING line at a falling rate (`FallingReport`: at once, then
        after 2, 4, 8 ... seconds, at most every `report_max_s`). Raises
        `CredentialsRefused` when any instance refuses the URL's credentials.
        """
        report = FallingReport(retry_s, report_max_s)
        while not stop.is_set():
            await self.refresh_epochs(patient=True)
            # After the round, `failure` is set exactly on the instances that did not answer.
            failed = {inst.name: inst.failure for inst in self.instances if inst.failure}
            refused = [f"{name} ({detail})" for name, (kind, detail) in failed.items()
                       if kind == "auth"]  # fmt: skip
            if refused:
                raise CredentialsRefused(
                    "redis.nodes: credentials refused by "
                    + ", ".join(refused)
                    + "; check the user and password in these URLs"
                )
            down = [f"{name} ({kind}: {detail})" for name, (kind, detail) in failed.items()]
            names = {"redis": ", ".join(failed)}
            if self.size - len(failed) >= self.majority:
                if down:
                    logger.warning("serving with Redis instances unreachable: %s",
                                   ", ".join(down), extra=names)  # fmt: skip
                return
            if report.due():
                logger.warning(
                    "cannot reach a Redis majority (%d of %d needed, %d answer); unreachable: "
                    "%s; not ready, retrying every %gs (next report in %gs)",
                    self.majority, self.size, self.size - len(failed), ", ".join(down),
                    retry_s, report.every, extra=names,
                )  # fmt: skip
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), retry_s)

    async def watch(self, stop: asyncio.Event) -> None:
        """Until `stop`: every `[redis] ping_interval`, `check` every instance. Without
        it, up/down and trust would change only when a batch flows."""
        while not stop.is_set():
            await self.check()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.ping_interval)

    async def check(self) -> None:
        """Read every instance's epoch (which pings it), then send queued fills to
        the instances that answer."""
        await self.refresh_epochs()
        await asyncio.gather(*(self._drain(inst) for inst in self.instances if inst.up))

    # -- epochs ---------------------------------------------------------------

    async def refresh_epochs(self, patient: bool = False) -> None:
        """Read every member's epoch, give one to a member that has none, and decide
        which members are trusted (gateway/keys.py, "Epochs"). `patient` (at start):
        allow FIRST_CONTACT_S for the reads, which then connect and load the script:
        a member missed at the first start joins as recovering."""
        self._epochs_read, self._reread = True, False
        timeout = max(self.timeout, FIRST_CONTACT_S) if patient else self.timeout
        reads = await asyncio.gather(*(self._read_member(i, timeout) for i in self.instances))
        seen = {n: read for n, read in enumerate(reads) if read is not None}
        todo = {
            n: state
            for n, read in seen.items()
            if read.epoch is None and (state := self._state_for_missing(n, seen))
        }
        made = await asyncio.gather(
            *(self._create_epoch(self.instances[n], state) for n, state in todo.items())
        )
        for n, epoch in zip(todo, made, strict=True):
            if epoch is not None:
                seen[n] = replace(seen[n], epoch=epoch)
        for n, read in seen.items():
            await self._adopt(self.instances[n], read)

    async def _read_member(self, inst: Instance, bound_s: float) -> EpochRead | None:
        """The member's epoch read; None for no answer. A cluster member's epoch is
        group 0's, copied to every group (`_spread`)."""
        if not inst.cluster:
            got = await self._read_group(inst, 0, bound_s)
            return None if got is None else got[0]
        # Group 0 first, alone: its call sets up the cluster client (the slot map), which
        # calls started side by side before that would each race to do.
        head = await self._read_group(inst, 0, bound_s)
        if head is None:
            return None
        reads = [head, *await asyncio.gather(
            *(self._read_group(inst, g, bound_s) for g in range(1, len(inst.groups)))
        )]  # fmt: skip
        inst.failure = None
        first, spread_id = head
        answered = [got[0] for got in reads if got is not None]
        has_marks = any(read.has_marks for read in answered)
        paused = any(read.paused for read in answered)
        epoch = first.epoch
        if epoch is None and any(read.epoch is not None for read in answered):
            # Group 0 lost its data (its node restarted empty) while others kept theirs.
            epoch = await self._create_epoch(inst, EPOCH_RECOVERING)
            if epoch is None:
                return None
        elif epoch is not None:
            epoch = await self._spread(inst, epoch, [None if g is None else g[0] for g in reads],
                                       spread_id)  # fmt: skip
            if epoch is None:
                return None
        return EpochRead(epoch, first.now_ms, has_marks, paused)

    async def _read_group(
        self, inst: Instance, group: int, bound_s: float
    ) -> tuple[EpochRead, str | None] | None:
        """One group's epoch read and, on group 0, the epoch id spread to every group."""
        prefix = inst.groups[group].prefix
        got = await self.run_script(inst, "epoch_read", [prefix], bound_s, group)
        if got is None:
            return None
        raw, now_ms, has_marks, paused, spread = got
        epoch = Epoch.parse(raw.decode(errors="replace")) if raw else None
        read = EpochRead(epoch, int(now_ms), bool(has_marks), bool(paused))
        return read, spread.decode(errors="replace") if spread else None

    async def _create_epoch(self, inst: Instance, state: str) -> Epoch | None:
        """Give the member an epoch (the first gateway's wins) and, on a cluster,
        copy it to every group."""
        raw = await self.run_script(inst, "epoch_create", [uuid.uuid4().hex[:16], state])
        epoch = Epoch.parse(raw.decode(errors="replace")) if raw else None
        if epoch is not None and inst.cluster:
            return await self._spread(inst, epoch, None, None)
        return epoch

    async def _spread(
        self, inst: Instance, epoch: Epoch, reads: list[EpochRead | None] | None,
        spread_id: str | None,
    ) -> Epoch | None:  # fmt: skip
        """Make every group of a cluster member hold its epoch (group 0's); the epoch,
        or None when another gateway changed it meanwhile (read again).

        Claims check their own group's copy, so a group without it takes no marks.
        Once every group had it (`epoch-spread` names the id on group 0), a group
        without it lost its data: the whole member is given a new, recovering
        epoch. Before that, a group without it was just not reached yet.
        `reads`: the groups' reads (None: copy to every group)."""
        count = len(inst.groups)
        if reads is None:
            stale = list(range(1, count))
        else:
            stale = [g for g in range(1, count) if (read := reads[g]) is not None
                     and (read.epoch is None or read.epoch.id != epoch.id)]  # fmt: skip
        if stale and spread_id == epoch.id and reads is not None and (first := reads[0]):
            fresh = Epoch(uuid.uuid4().hex[:16], first.now_ms, EPOCH_RECOVERING)
            logger.warning(
                "Redis member %s: key groups %s lost the member's epoch %s (a node restarted "
                "empty?): the member is recovering, as epoch %s",
                inst.name, ", ".join(inst.groups[g].prefix.decode(errors="replace") for g in stale),
                epoch.id, fresh.id, extra={"redis": inst.name},
            )  # fmt: skip
            if await self.run_script(inst, "epoch_set", [epoch.raw, fresh.raw]) != 1:
                self._reread = True
                return None
            epoch, stale = fresh, list(range(1, count))
        if not stale and spread_id == epoch.id:
            return epoch
        copies = await asyncio.gather(
            *(self.run_script(inst, "epoch_copy", [epoch.raw], None, g) for g in stale)
        )
        if all(c is not None for c in copies) and (reads is None or None not in reads):
            prefix = inst.groups[0].prefix
            await self.run_script(inst, "epoch_spread", [prefix, epoch.raw])
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
        if self.instances[n].known_id is not None or any(r.has_marks for r in seen.values()):
            return EPOCH_RECOVERING
        return EPOCH_TRUSTED if len(seen) >= self.majority else None

    async def _adopt(self, inst: Instance, read: EpochRead) -> None:
        """Take the member's epoch as read, decide its trust, log and count changes."""
        epoch, now_ms = read.epoch, read.now_ms
        if read.paused != inst.paused:
            logger.warning(
                "Redis member %s is %s", inst.name,
                "paused: not counted, no claims sent" if read.paused else "resumed",
                extra={"redis": inst.name},
            )  # fmt: skip
            inst.paused = read.paused
            self.metrics.redis_paused.labels(inst.name).set(1 if read.paused else 0)
        trusted = epoch is not None and (
            epoch.state == EPOCH_TRUSTED or now_ms - epoch.since_ms >= self.recovery_ms
        )
        if epoch is not None and trusted and epoch.state != EPOCH_TRUSTED:
            # A whole mark lifetime has passed: say so on the instance, for every gateway.
            promoted = epoch.with_state(EPOCH_TRUSTED)
            if await self.run_script(inst, "epoch_set", [epoch.raw, promoted.raw]) == 1:
                epoch = promoted
        lost = epoch is not None and inst.known_id is not None and inst.known_id != epoch.id
        trust = "unknown" if epoch is None else "trusted" if trusted else "recovering"
        if epoch is None and trust != inst.trust:
            logger.warning(
                "Redis member %s holds no epoch, and whether it lost its data cannot be "
                "decided while fewer than a majority answer: its answers are not counted",
                inst.name, extra={"redis": inst.name},
            )  # fmt: skip
        elif epoch is not None and not trusted and (lost or trust != inst.trust):
            logger.warning(
                "Redis member %s %s (epoch %s, its data began %s): its answers are not "
                "counted until `dedup-gateway rebuild %s` or %s",
                inst.name, "lost its data" if lost else "is recovering", epoch.id,
                _when(epoch.since_ms), inst.name, _when(epoch.since_ms + self.recovery_ms),
                extra={"redis": inst.name},
            )  # fmt: skip
        elif trusted and inst.trust not in ("", "trusted"):
            logger.info("Redis member %s is trusted again", inst.name, extra={"redis": inst.name})
        inst.epoch, inst.trusted, inst.trust = epoch, trusted, trust
        if epoch is not None:
            inst.known_id = epoch.id
        self.metrics.redis_recovering.labels(inst.name).set(0 if trusted else 1)
        self.metrics.quorum_healthy.set(1 if self.healthy else 0)

    # -- the data path ----------------------------------------------------------

    async def claim(self, digests: Sequence[bytes], owners: Sequence[str]) -> list[list[Reply]]:
        """Per member, the reply for each digest: MINE, the owner that holds it, or
        None where the member gave no answer (down, timed out, its chunk failed, or
        its data was lost since we last looked, or it is paused). A member that is
        not trusted answers too: `counted()` says which answers the vote may count.

        Every digest must have the same length (they do: `keys.mark_digest`).
        """
        if not digests:
            return [[] for _ in self.instances]
        if not self._epochs_read:
            await self.refresh_epochs()
        n, width = len(digests), len(digests[0])

        def plan(epoch_id: str, group: Group, items: Sequence[int]) -> Planned:
            head = [*group.layout, epoch_id, width]
            planned: Planned = []
            for chunk in _chunks(items):
                if isinstance(chunk, range):  # the whole batch in order: slice, do not gather
                    blob = b"".join(digests[chunk.start : chunk.stop])
                    tokens = ",".join(owners[chunk.start : chunk.stop])
                else:
                    blob = b"".join([digests[k] for k in chunk])
                    tokens = ",".join([owners[k] for k in chunk])
                planned.append((("claim", [group.meta], [*head, blob, tokens + ","]), chunk))
            return planned

        async def one(inst: Instance) -> list[Reply]:
            if inst.epoch is None or inst.paused:  # what it would answer could not be counted
                return [None] * n
            # The epoch these claims expect: the one known now (the fills' answer may
            # change what the gateway knows; the scripts then refuse).
            epoch_id = inst.epoch.id
            fills = self._take_fills(inst)
            if fills:  # first, so that this batch's claims see the completed marks
                await self._send_fills(inst, fills)
            results = await self._grouped(inst, "claim", digests, partial(plan, epoch_id))
            replies: list[Reply] = [None] * n
            for positions, result in results:
                if result is None:
                    continue
                if result.count(MINE) != len(result):  # some held by others: decode those
                    result = [r if r == MINE else r.decode() for r in result]
                _place(replies, positions, result)
            return replies

        out = list(await asyncio.gather(*(one(inst) for inst in self.instances)))
        if self._reread:
            await self.refresh_epochs()
        return out

    def queue_fills(self, per_instance: Sequence[Iterable[Fill]]) -> None:
        """Marks to complete later: per member, (digest, winner, token sent) for the
        votes it gave no answer to (see scripts.FILL)."""
        for inst, fills in zip(self.instances, per_instance, strict=True):
            self._queue(inst, fills)

    async def repair(self, per_instance: Sequence[list[tuple[bytes, str, str]]]) -> int:
        """Rewrite (digest, seen owner, winner) marks where they still hold what was seen.

        A chunk that gets no answer is queued as fills (digest, winner, seen): the
        fill writes the winner where the mark still holds `seen`, once the member
        answers. Dropped instead, a split left unrepaired would outlive the vote, and
        with another member recovering a later copy could win its tie.
        """

        async def one(inst: Instance, todo: list[tuple[bytes, str, str]]) -> int:
            if not todo:
                return 0

            def plan(group: Group, items: Sequence[int]) -> Planned:
                return [(("repair", [group.meta],
                          [*group.layout, *(v for k in chunk for v in todo[k])]), chunk)
                        for chunk in _chunks(items)]  # fmt: skip

            results = await self._grouped(inst, "repair", [d for d, _, _ in todo], plan)
            missed = [(todo[k][0], todo[k][2], todo[k][1])
                      for positions, result in results if result is None
                      for k in positions]  # fmt: skip
            if missed:
                self._queue(inst, missed)
            return sum(int(result or 0) for _, result in results)

        results = await asyncio.gather(
            *(one(inst, todo) for inst, todo in zip(self.instances, per_instance, strict=True))
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

        return await self._per_item_on_counted("release", digests, plan)

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

        results = await self._per_item_on_counted("handover", digests, plan, needs_epoch=True)
        if self._reread:
            await self.refresh_epochs()
        return results

    async def mark_done(self, digests: Sequence[bytes], refs: Sequence[str]) -> None:
        """Note that these commands' effects are acknowledged (see scripts.MARK_DONE)."""

        def plan(group: Group, items: Sequence[int]) -> Planned:
            keys = [handover_key(group.prefix, digests[k]) for k in items]
            return [(("mark_done", keys, [refs[k] for k in items]), items)]

        await asyncio.gather(*(self._grouped(i, "mark_done", digests, plan)
                               for i in self.instances))  # fmt: skip

    # -- coalescing windows (gateway/coalesce.py, scripts.COALESCE_*) -------------

    async def coalesce_update(
        self, digests: Sequence[bytes], stamps: Sequence[int], versions: Sequence[str],
        mode: str, window_ms: int, max_window_ms: int, on: Sequence[bool] | None = None,
    ) -> list[list[tuple[int, bool, int]] | None]:  # fmt: skip
        """Per member, per update: (its window's start, whether it opened the window, the
        window's newest timestamp before it, 0 if none); None where the member gave no
        answer (or had another epoch), or is not `on`."""
        if not digests:
            return [[] for _ in self.instances]
        if not self._epochs_read:
            await self.refresh_epochs()
        width = len(digests[0])

        async def one(inst: Instance, asked: bool) -> list[tuple[int, bool, int]] | None:
            if inst.epoch is None or inst.paused or not asked:
                return None
            head = [inst.epoch.id, mode, window_ms, max_window_ms, width]
            flat = await self._in_chunks(
                inst, "coalesce_update", digests,
                lambda items: [*head, b"".join(digests[k] for k in items),
                               "".join(f"{stamps[k]}," for k in items),
                               "".join(f"{versions[k]}," for k in items)],
                width=3,
            )  # fmt: skip
            if flat is None:
                return None
            return [(int(start), int(opened) == 1, int(prev)) for start, opened, prev in flat]

        asked = on if on is not None else [True] * self.size
        out = list(
            await asyncio.gather(
                *(one(inst, a) for inst, a in zip(self.instances, asked, strict=True))
            )
        )
        if self._reread:
            await self.refresh_epochs()
        return out

    async def coalesce_close(
        self, digests: Sequence[bytes], starts: Sequence[int]
    ) -> list[list[tuple[str, int, int]] | None]:
        """Per member, per window: (newest version or '', updates, newest timestamp);
        None where the member gave no answer."""
        if not digests:
            return [[] for _ in self.instances]
        width = len(digests[0])

        async def one(inst: Instance) -> list[tuple[str, int, int]] | None:
            flat = await self._in_chunks(
                inst, "coalesce_close", digests,
                lambda items: [width, b"".join(digests[k] for k in items),
                               "".join(f"{starts[k]}," for k in items)],
                width=3,
            )  # fmt: skip
            if flat is None:
                return None
            return [(v.decode(), int(n), int(last)) for v, n, last in flat]

        return list(await asyncio.gather(*(one(inst) for inst in self.instances)))

    async def _in_chunks(
        self, inst: Instance, script: str, digests: Sequence[bytes],
        args_of: Callable[[Sequence[int]], list[Any]], width: int,
    ) -> list[Any] | None:  # fmt: skip
        """`script` on `inst` over the items of `digests` in chunks of
        `scripts.CHUNK_DIGESTS` per group, the arguments of items `k` being the
        group's layout and `args_of(k)`; per item its `width` replies, or None when a
        chunk got no answer."""

        def plan(group: Group, items: Sequence[int]) -> Planned:
            return [((script, [group.meta], [*group.layout, *args_of(chunk)]), chunk)
                    for chunk in _chunks(items)]  # fmt: skip

        results = await self._grouped(inst, script, digests, plan)
        out: list[Any] = [None] * len(digests)
        for positions, result in results:
            if result is None:
                return None
            for j, k in enumerate(positions):
                out[k] = result[j * width : (j + 1) * width]
        return out

    async def delete(self, digest: bytes) -> list[int | None]:
        """Release the mark whoever holds it (operator release; a tombstone, gateway/keys.py);
        per member 1 released, 0 absent or released already, None for no answer (or a
        member that is not counted)."""

        def plan(group: Group, items: Sequence[int]) -> Planned:
            return [(("delete", [group.meta], [*group.layout, digest]), items)]

        results = await self._per_item_on_counted("delete", [digest], plan)
        return [r[0] for r in results]

    async def inspect(self, digest: bytes) -> list[MarkView | None]:
        """Per member, the mark and its bucket (owner None when absent); None if down."""

        async def one(inst: Instance) -> MarkView | None:
            n = self.group_index(inst, digest)
            group = inst.groups[n]
            found = await self.run_script(inst, "inspect", [*group.layout, digest], group=n)
            if found is None:
                return None
            key = handover_key(group.prefix, digest)
            handed = await self._timed(inst, "inspect", partial(inst.client.get, key), group=n)
            by = handed.decode() if isinstance(handed, bytes) else None
            if not found:
                return MarkView(None, -2, None, by)
            owner, ttl, encoding = found
            return MarkView(owner.decode(), int(ttl), encoding.decode(), by)

        return list(await asyncio.gather(*(one(inst) for inst in self.instances)))

    # -- a member's marks, whole (gateway/rebuild.py) ----------------------------

    async def lookup(self, inst: Instance, digests: Sequence[bytes]) -> list[Any] | None:
        """Per digest, [owner or b'', its bucket's remaining ms (-2: absent)] on `inst`;
        None when a call got no answer."""
        if not digests:
            return []
        width = len(digests[0])
        return await self._in_chunks(
            inst, "lookup", digests,
            lambda items: [width, b"".join(digests[k] for k in items)], width=2,
        )  # fmt: skip

    async def export(self, inst: Instance, group: int, cursor: list[Any], budget: int) -> Any:
        """One call of scripts.EXPORT on one group of `inst`; None for no answer."""
        layout = inst.groups[group].layout
        return await self.run_script(inst, "export", [*layout, *cursor, budget], group=group)

    async def import_marks(
        self, inst: Instance, epoch_id: str, marks: Sequence[Imported]
    ) -> list[int] | str | None:
        """Write (digest, owner, remaining ms, handover note, its remaining ms) marks
        into `inst` (scripts.IMPORT; note '-': none, '?': keep the member's): per mark
        0 there already, 1 written, 2
        rewritten; 'epoch' when its epoch changed (it lost its data again); None for no
        answer."""
        digests = [mark[0] for mark in marks]
        width = len(digests[0])
        flat = await self._in_chunks(
            inst, "import", digests,
            lambda items: [epoch_id, width, b"".join(digests[k] for k in items),
                           "".join(f"{marks[k][1]}," for k in items),
                           "".join(f"{marks[k][2]}," for k in items),
                           "".join(f"{marks[k][3]}," for k in items),
                           "".join(f"{marks[k][4]}," for k in items)],
            width=1,
        )  # fmt: skip
        if flat is None:
            return "epoch" if inst.epoch is None else None
        return [int(result[0]) for result in flat]

    async def pause(self, inst: Instance, paused: bool) -> bool:
        """Set or clear `inst`'s pause flag on every group; whether every group answered."""
        done = await asyncio.gather(
            *(self.run_script(inst, "pause", [g.prefix, "1" if paused else "0"], group=n)
              for n, g in enumerate(inst.groups))
        )  # fmt: skip
        return all(d is not None for d in done)

    def group_index(self, inst: Instance, digest: bytes) -> int:
        return 0 if not inst.cluster else group_of(digest, len(inst.groups))

    # -- fills ------------------------------------------------------------------

    def _queue(self, inst: Instance, fills: Iterable[Fill], front: bool = False) -> None:
        if front:
            inst.backlog.extendleft(reversed(list(fills)))
        else:
            inst.backlog.extend(fills)
        dropped = len(inst.backlog) - self.backlog_max
        if dropped > 0:
            for _ in range(dropped):
                inst.backlog.popleft()  # the oldest first: the newest marks matter longest
            self.metrics.repairs_dropped.labels(inst.name).inc(dropped)
        self.metrics.repair_backlog.labels(inst.name).set(len(inst.backlog))

    def _take_fills(self, inst: Instance) -> list[Fill]:
        """Up to one chunk of queued fills, when the member's epoch is known."""
        if not inst.backlog or inst.epoch is None or inst.paused:
            return []
        taken = [
            inst.backlog.popleft() for _ in range(min(len(inst.backlog), scripts.CHUNK_DIGESTS))
        ]
        self.metrics.repair_backlog.labels(inst.name).set(len(inst.backlog))
        return taken

    async def _send_fills(self, inst: Instance, fills: list[Fill]) -> bool:
        """Write queued fills (scripts.FILL), one call per group; those that got no
        answer go back to the front of the backlog. Whether every one was sent."""
        epoch_id, width = inst.epoch.id if inst.epoch else "", len(fills[0][0])

        def plan(group: Group, items: Sequence[int]) -> Planned:
            args = [*group.layout, epoch_id, width,
                    b"".join(fills[k][0] for k in items),
                    "".join(f"{fills[k][1]}," for k in items),
                    "".join(f"{fills[k][2]}," for k in items)]  # fmt: skip
            return [(("fill", [group.meta], args), items)]

        results = await self._grouped(inst, "fill", [f[0] for f in fills], plan)
        missed = [fills[k] for positions, result in results if result is None for k in positions]
        if missed:
            self._queue(inst, missed, front=True)
        return not missed

    async def _drain(self, inst: Instance) -> None:
        """Send this member's queued fills, a chunk at a time, until the backlog seen at
        the start is sent or a call fails."""
        for _ in range(-(-len(inst.backlog) // scripts.CHUNK_DIGESTS)):
            fills = self._take_fills(inst)
            if not fills or not await self._send_fills(inst, fills):
                return

    # -- calls ------------------------------------------------------------------

    async def _grouped(
        self, inst: Instance, what: str, digests: Sequence[bytes],
        plan: Callable[[Group, Sequence[int]], Planned],
    ) -> list[tuple[Sequence[int], Any | None]]:  # fmt: skip
        """The calls `plan` makes for each group's items of `digests` (positions in
        order); per call, its item positions and its reply (None: no answer)."""
        if not inst.cluster:
            planned = plan(inst.groups[0], range(len(digests)))
            replies = await self._run(inst, what, [call for call, _ in planned])
            return [(positions, r) for (_, positions), r in zip(planned, replies, strict=True)]
        calls = [(group, call, positions)
                 for group, items in split(digests, len(inst.groups))
                 for call, positions in plan(inst.groups[group], items)]  # fmt: skip
        replies = await self._on_masters(inst, what, [(g, c, len(p)) for g, c, p in calls])
        return [(positions, r) for (_, _, positions), r in zip(calls, replies, strict=True)]

    async def _on_masters(
        self, inst: Instance, what: str, calls: Sequence[tuple[int, Call, int]]
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
        reply per call, as `_run` gives them.

        One call per group through the cluster client cost ~100 µs of the gateway's
        CPU each (a connection, a task and a timer per call): 3.3 µs per id for a
        batch over 64 groups, against 0.2 on a standalone member (bench/RESULTS.md).
        """
        results: list[Any | None] = [None] * len(calls)
        assert isinstance(inst.client, RedisCluster)
        by_node: dict[str, list[int]] = {}
        alone: list[int] = []  # slots no node serves, as far as the client knows
        for n, (_, (_, keys, _), _) in enumerate(calls):
            try:
                node = inst.client.get_node_from_key(keys[0])
            except SlotNotCoveredError:  # or no slot map yet: the cluster client reads one
                node = None
            if node is None:
                alone.append(n)
                continue
            if node.name not in inst.nodes:
                assert inst.url is not None
                inst.nodes[node.name] = node_client_for(inst.url, node.host, int(node.port),
                                                        self.timeout)  # fmt: skip
            by_node.setdefault(node.name, []).append(n)

        # A group whose call got no answer (or was refused) gets no more calls in this
        # batch: its chunks run in order, or not at all (as `_run` does for a standalone
        # member). In a pipelined trip, a chunk whose script failed (ResponseError) stops
        # nothing, as there; a call sent again alone stops its group on any failure.
        stopped: set[int] = set()

        async def again(ns: Sequence[int]) -> None:
            for n in ns:
                group, call, _ = calls[n]
                if group not in stopped:
                    results[n] = (await self._run(inst, what, [call], group))[0]
                    if results[n] is None:
                        stopped.add(group)

        async def on_node(name: str, ns: list[int]) -> None:
            for trip in _trips(ns, [calls[n][2] for n in ns]):
                trip = [n for n in trip if calls[n][0] not in stopped]
                if not trip:
                    continue
                groups = sorted({calls[n][0] for n in trip})
                sent = [calls[n][1] for n in trip]
                send = partial(self._pipelined, inst, sent, inst.nodes[name])
                replies = await self._timed(inst, what, send, group=groups)
                if replies is None:
                    if inst.failure is not None and inst.failure[0] == "connection":
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
                        self._failed(inst, "response", str(reply), group)
                    elif isinstance(reply, bytes) and self._refused(inst, reply):
                        stopped.add(group)
                    else:
                        results[n] = reply
                await again(misplaced)

        await asyncio.gather(again(alone), *(on_node(name, ns) for name, ns in by_node.items()))
        return results

    async def _run(
        self, inst: Instance, what: str, calls: Sequence[Call], group: int = 0
    ) -> list[Any | None]:
        """The calls on one group of `inst`, in order, each round trip bounded by
        `[redis] timeout` (timed as `what`). The reply per call; None for a call that
        got no answer (after a timeout or a lost connection the calls not yet sent are
        not sent) or found another epoch or a pause. A standalone member gets
        `scripts.CHUNKS_PER_TRIP` calls per round trip on one connection; a cluster
        member one call at a time, routed by the client (MOVED, ASK, failovers)."""
        results: list[Any | None] = [None] * len(calls)
        per_trip = 1 if inst.cluster else scripts.CHUNKS_PER_TRIP
        for start in range(0, len(calls), per_trip):
            trip = range(start, min(start + per_trip, len(calls)))
            if inst.cluster:
                name, keys, args = calls[start]
                send = partial(self._one_call, inst, name, keys, args)
            else:
                send = partial(self._pipelined, inst, [calls[n] for n in trip])
            replies = await self._timed(inst, what, send, group=group)
            if replies is None:
                return results
            for n, reply in zip(trip, replies, strict=True):
                if isinstance(reply, ResponseError):
                    self._failed(inst, "response", str(reply), group)
                elif isinstance(reply, bytes) and self._refused(inst, reply):
                    return results
                else:
                    results[n] = reply
        return results

    async def _one_call(
        self, inst: Instance, name: str, keys: list[Any], args: list[Any]
    ) -> list[Any]:
        """A cluster member's call: the Script object loads the script where a node
        lacks it (a new or failed-over master)."""
        return [await self._script(inst, name, keys, args)]

    async def _script(self, inst: Instance, name: str, keys: list[Any], args: list[Any]) -> Any:
        """One EVALSHA (the script loaded where it is missing). A cluster member's
        calls are not queued behind each other: a bound on them let the calls to a
        dead master hold back the live masters' until they timed out too."""
        return await inst.scripts[name](keys=keys, args=args)

    async def _pipelined(
        self, inst: Instance, calls: list[Call], client: aioredis.Redis | None = None
    ) -> list[Any]:
        """EVALSHA per call in one pipeline on `client` (default: the member's own). A
        script the server does not have (it restarted) is loaded, and the calls it
        refused are sent once more."""
        on = client if client is not None else inst.client
        replies = await self._send(inst, calls, on)
        lost = [n for n, reply in enumerate(replies) if isinstance(reply, NoScriptError)]
        if lost:
            for name in {calls[n][0] for n in lost}:
                await on.script_load(inst.scripts[name].script)
            again = await self._send(inst, [calls[n] for n in lost], on)
            for n, reply in zip(lost, again, strict=True):
                replies[n] = reply
        return replies

    async def _send(
        self, inst: Instance, calls: list[Call], client: aioredis.Redis | RedisCluster
    ) -> list[Any]:
        pipe = client.pipeline(transaction=False)
        for name, keys, args in calls:
            pipe.evalsha(inst.scripts[name].sha, len(keys), *keys, *args)
        replies: list[Any] = await pipe.execute(raise_on_error=False)
        return replies

    def _refused(self, inst: Instance, reply: bytes) -> bool:
        """Whether a script refused to write: another epoch ('epoch:<held>': the member
        lost its data since we read it) or a pause ('paused:')."""
        if reply.startswith(b"epoch:"):
            self._epoch_differs(inst, reply[len(b"epoch:") :].decode())
            return True
        if reply.startswith(b"paused:"):
            if not inst.paused:
                logger.warning("Redis member %s is paused: not counted, no claims sent",
                               inst.name, extra={"redis": inst.name})  # fmt: skip
            inst.paused = True
            self.metrics.redis_paused.labels(inst.name).set(1)
            self.metrics.quorum_healthy.set(1 if self.healthy else 0)
            return True
        return False

    def _epoch_differs(self, inst: Instance, held: str) -> None:
        """A claim found another epoch: the member lost its data since we read it."""
        logger.warning(
            "Redis member %s holds epoch %r, not %r: nothing was written; re-reading epochs",
            inst.name, held, inst.epoch.raw if inst.epoch else None, extra={"redis": inst.name},
        )  # fmt: skip
        inst.epoch, inst.trusted = None, False
        self._reread = True
        self.metrics.redis_recovering.labels(inst.name).set(1)
        self.metrics.quorum_healthy.set(1 if self.healthy else 0)

    async def _per_item_on_counted(
        self, what: str, digests: Sequence[bytes],
        plan: Callable[..., Planned], needs_epoch: bool = False,
    ) -> list[list[int | None]]:  # fmt: skip
        """Per member, per digest, the reply of the calls `plan` makes (one reply per
        item); None where it gave no answer, or where the vote must not count it (not
        trusted, or paused). With `needs_epoch` the plan takes the member's epoch id first,
        and a member whose epoch is not known is not called (a script that writes needs it)."""
        if not self._epochs_read:
            await self.refresh_epochs()

        async def one(inst: Instance) -> list[int | None]:
            out: list[int | None] = [None] * len(digests)
            if needs_epoch and (inst.epoch is None or inst.paused):
                return out
            planner = partial(plan, inst.epoch.id) if needs_epoch and inst.epoch else plan
            for positions, result in await self._grouped(inst, what, digests, planner):
                if result is not None:
                    _place(out, positions, [int(x) for x in result] if isinstance(result, list)
                           else [int(result)])  # fmt: skip
            if not inst.trusted or inst.paused:
                return [None] * len(digests)
            return out

        return list(await asyncio.gather(*(one(inst) for inst in self.instances)))

    async def run_script(
        self, inst: Instance, name: str, args: list[Any], bound_s: float | None = None,
        group: int = 0,
    ) -> Any | None:  # fmt: skip
        """One call of script `name` on one group of `inst`, bounded by `bound_s`
        (default: `[redis] timeout`); None for no answer (counted and logged like
        every other call). Its declared key: the group's epoch key for the epoch
        scripts, its slice meta for the others."""
        g = inst.groups[group]
        keys = [g.epoch_key if name.startswith("epoch") or name == "pause" else g.meta]
        call = partial(self._script, inst, name, keys, args)
        return await self._timed(inst, name, call, bound_s, group)

    async def _timed(
        self, inst: Instance, script: str, call: Callable[[], Awaitable[T]],
        bound_s: float | None = None, group: int | Sequence[int] = 0,
    ) -> T | None:  # fmt: skip
        """`call`'s result within `bound_s`; None for no answer, counted and logged
        against its key group(s) (`group`: one, or those a pipelined trip served)."""
        started = time.perf_counter()
        timeout = bound_s or self.timeout
        try:
            result = await asyncio.wait_for(call(), timeout)
        except (TimeoutError, RedisTimeoutError):
            self._failed(inst, "timeout", f"no answer within {timeout}s", group)
            return None
        except AuthenticationError as exc:  # before its base class, ConnectionError
            self._failed(inst, "auth", str(exc), group)
            return None
        except RedisConnectionError as exc:  # some say nothing (MaxConnectionsError)
            self._failed(inst, "connection", str(exc) or type(exc).__name__, group)
            return None
        except ResponseError as exc:  # e.g. OOM under noeviction, or a script error
            self._failed(inst, "response", str(exc), group)
            return None
        except RedisError as exc:  # a cluster's own errors (no node serves the slot) too
            self._failed(inst, "other", str(exc), group)
            return None
        except RuntimeError as exc:
            # uvloop's error for a write to a connection the server just closed (seen
            # on the handshake of a reconnect to a restarting member); redis-py passes
            # it on untranslated, after dropping the connection.
            if _CLOSED_TRANSPORT not in str(exc):
                raise
            self._failed(inst, "connection", str(exc), group)
            return None
        except AttributeError as exc:
            # redis-py's cluster client can hand a call a connection that a concurrent
            # refresh of the slot map has just closed ('NoneType' object has no
            # attribute 'writelines'): that call got no answer; the next one reconnects.
            if not inst.cluster:
                raise
            detail = f"connection closed under the call by a slot map refresh ({exc})"
            self._failed(inst, "connection", detail, group)
            return None
        self.metrics.redis_call_seconds.labels(inst.name, script).observe(
            time.perf_counter() - started
        )
        answered = inst.down_groups.intersection(_groups(group))
        if answered:
            inst.down_groups -= answered
            self.metrics.redis_groups_down.labels(inst.name).set(len(inst.down_groups))
            if not inst.down_groups and inst.up:
                logger.info("Redis member %s: every key group answers again", inst.name,
                            extra={"redis": inst.name})  # fmt: skip
        if not inst.up:
            logger.info("Redis member %s answers", inst.name, extra={"redis": inst.name})
        if not inst.cluster:  # a cluster member's is cleared by its epoch read
            inst.failure = None
        self._set_up(inst, True)
        return result

    def _failed(
        self, inst: Instance, kind: str, detail: str, group: int | Sequence[int] = 0
    ) -> None:
        """Count and log a call that got no answer. A cluster member is down when
        every key group is; while some answer, only the groups that do not are."""
        self.metrics.redis_errors.labels(inst.name, kind).inc()
        inst.failure = (kind, detail)
        failed = [g for g in _groups(group) if g not in inst.down_groups]
        if inst.cluster and failed:
            first = not inst.down_groups
            inst.down_groups.update(failed)
            self.metrics.redis_groups_down.labels(inst.name).set(len(inst.down_groups))
            if first and inst.up:
                logger.warning(
                    "Redis member %s: key group %s failed (%s): %s; its records get no "
                    "answer from this member", inst.name, _named(inst, failed), kind, detail,
                    extra={"redis": inst.name, "kind": kind},
                )  # fmt: skip
        if inst.cluster and len(inst.down_groups) < len(inst.groups):
            return
        if inst.up:
            logger.warning(
                "Redis member %s failed (%s): %s", inst.name, kind, detail,
                extra={"redis": inst.name, "kind": kind},
            )  # fmt: skip
        self._set_up(inst, False)

    def _set_up(self, inst: Instance, up: bool) -> None:
        inst.up = up
        self.metrics.redis_up.labels(inst.name).set(1 if up else 0)
        self.metrics.quorum_healthy.set(1 if self.healthy else 0)

    async def close(self) -> None:
        for inst in self.instances:
            await inst.client.aclose()
            for node in inst.nodes.values():
                await node.aclose()


def _named(inst: Instance, groups: Sequence[int]) -> str:
    """Key groups as a log names them: the first three prefixes, and how many more."""
    names = ", ".join(inst.groups[g].prefix.decode(errors="replace") for g in groups[:3])
    return names + (f" and {len(groups) - 3} more" if len(groups) > 3 else "")


def _groups(group: int | Sequence[int]) -> Sequence[int]:
    return (group,) if isinstance(group, int) else group


def _trips(calls: list[int], sizes: Sequence[int]) -> list[list[int]]:
    """`calls` (with the digests each carries) in round trips of at most
    `CHUNK_DIGESTS * CHUNKS_PER_TRIP` digests, in order; a call alone may be one."""
    limit = scripts.CHUNK_DIGESTS * scripts.CHUNKS_PER_TRIP
    trips: list[list[int]] = []
    size = limit
    for n, count in zip(calls, sizes, strict=True):
        if size + count > limit:
            trips.append([])
            size = 0
        trips[-1].append(n)
        size += count
    return trips


def _chunks(items: Sequence[int]) -> list[Sequence[int]]:
    """`items` in runs of `scripts.CHUNK_DIGESTS` (a range stays a range)."""
    size = scripts.CHUNK_DIGESTS
    return [items[a : a + size] for a in range(0, len(items), size)]


def _place(out: list[Any], positions: Sequence[int], values: Sequence[Any]) -> None:
    """out[positions[j]] = values[j], as one slice assignment for a range."""
    if isinstance(positions, range):
        out[positions.start : positions.stop] = values
    else:
        for k, value in zip(positions, values, strict=True):
            out[k] = value


def _when(epoch_ms: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(epoch_ms / 1000))
