"""The N Redis instances, queried concurrently, a few short script calls each per batch.

This is the only module that talks to Redis on the data path. What it keeps
per instance, and why:

- **Chunks.** A batch's digests go to each instance in chunks of
  `scripts.CHUNK_DIGESTS`, `scripts.CHUNKS_PER_TRIP` chunks pipelined per
  round trip, in order on one connection (so the first copy of an id in a
  batch still wins). A chunk costs Redis a few milliseconds at most, so no call holds
  an instance long enough to starve other gateways, and a round trip is
  bounded by `[redis] timeout` whatever `max_batch_records` is. A chunk that
  fails gives no answer (`None`) for its digests only; after a timeout or a
  lost connection the chunks not yet sent are not sent (the instance is down).
- **Up.** Whether the instance answered its last call. `watch` reads every
  instance's epoch every `[redis] ping_interval`, so an idle gateway notices
  an instance that died or came back.
- **Epoch and trust.** Whether the instance still holds the marks it was
  given (gateway/keys.py, "Epochs"). Every claim names the epoch it expects
  and writes nothing where another one is found; an instance whose data was
  lost is *recovering*: its answers are returned but `counted()` says the
  vote must not count them, until `dedup-gateway rebuild` copied the marks
  into it or a whole mark lifetime (1.5 x ttl) has passed since its data began.
- **Fill backlog.** Winners' marks for votes the instance gave no answer to,
  bounded (oldest dropped, counted), sent with the next claim to it and by
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
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar

import redis.asyncio as aioredis
from redis.backoff import NoBackoff
from redis.exceptions import (
    AuthenticationError,
    NoScriptError,
    RedisError,
    ResponseError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from gateway import scripts
from gateway.config import RedisSettings, redacted
from gateway.errors import CredentialsRefused
from gateway.keys import EPOCH_RECOVERING, EPOCH_TRUSTED, Epoch, handover_key
from gateway.metrics import Metrics
from gateway.vote import MINE, Reply

logger = logging.getLogger(__name__)
_CLOSED_TRANSPORT = "unable to perform operation on"  # uvloop: the handle is closed
T = TypeVar("T")

# A mark to complete on one instance: (digest, winner token, token of the claim it
# gave no answer to: that claim may still have run, late).
Fill = tuple[bytes, str, str]
# How long the first epoch reads at start may take (connect, load the script).
FIRST_CONTACT_S = 2.0
Call = tuple[str, list[Any]]  # a script's name and its arguments


@dataclass(frozen=True)
class MarkView:
    """One instance's view of one id, for the operator."""

    owner: str | None  # None: no live mark
    ttl_ms: int  # of the bucket holding it; -2 when absent
    encoding: str | None  # "listpack" while the bucket is compact
    handed_over_by: str | None  # the failure command that last handed it over


@dataclass
class Instance:
    name: str  # host:port/db, never the password
    client: aioredis.Redis
    scripts: dict[str, Any]  # redis-py Script objects by name: EVALSHA, reloaded on NOSCRIPT
    up: bool = False
    failure: tuple[str, str] | None = None  # (kind, detail) of the last call, if it failed
    epoch: Epoch | None = None  # as last read; None: not known (no claims are sent)
    known_id: str | None = None  # the last epoch id this gateway knew it by
    trusted: bool = False  # its answers count in votes
    trust: str = ""  # "trusted", "recovering" or "unknown", as last logged
    backlog: deque[Fill] = field(default_factory=deque)


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
        # What every mark script takes first (gateway/scripts.py).
        self.layout: list[Any] = [
            self.prefix,
            self.ttl_ms,
            self.ttl_ms // scripts.SLICES_BACK,
            settings.buckets,
        ]
        self.size = len(settings.nodes)
        self.majority = self.size // 2 + 1
        self._epochs_read = False
        self._reread = False  # a claim met another epoch: read them all again
        self.instances: list[Instance] = []
        for url in settings.nodes:
            client = aioredis.Redis.from_url(
                str(url),
                socket_timeout=self.timeout,
                socket_connect_timeout=self.timeout,
                # Our own timeout and the vote handle failure; no hidden retries.
                retry=Retry(NoBackoff(), 0),
                health_check_interval=0,
            )
            self.instances.append(
                Instance(
                    name=redacted(url),
                    client=client,
                    scripts={
                        name: client.register_script(getattr(scripts, name.upper()))
                        for name in scripts.NAMES
                    },
                )
            )
        metrics.quorum_size.set(self.majority)

    # -- health ---------------------------------------------------------------

    @property
    def healthy(self) -> bool:
        """A majority of instances answers and holds the marks it was given."""
        return sum(i.up and i.trusted for i in self.instances) >= self.majority

    def why_unhealthy(self) -> str:
        """For /readyz: which instances keep the quorum from a trusted majority."""
        down = ", ".join(i.name for i in self.instances if not i.up)
        recovering = ", ".join(i.name for i in self.instances if i.up and not i.trusted)
        why = f"no Redis majority ({self.majority} of {self.size}) up and trusted"
        if down:
            why += f"; down: {down}"
        if recovering:
            why += f"; recovering (lost their marks): {recovering}"
        return why

    def counted(self) -> list[bool]:
        """Per instance, whether the vote may count its answers (it is trusted)."""
        return [inst.trusted for inst in self.instances]

    async def wait_for_majority(self, stop: asyncio.Event, retry_s: float = 1.0) -> None:
        """Return once a majority answers; read every epoch; name every instance that
        does not answer.

        Raises `CredentialsRefused` when any instance refuses the URL's credentials.
        """
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
            logger.error(
                "waiting for a Redis majority (%d of %d); unreachable: %s",
                self.majority, self.size, ", ".join(down), extra=names,
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
        """Read every instance's epoch, give one to an instance that has none, and
        decide which instances are trusted (gateway/keys.py, "Epochs"). `patient`
        (at start): allow FIRST_CONTACT_S for the reads, which then connect and load
        the script: an instance missed at the first start joins as recovering."""
        self._epochs_read, self._reread = True, False
        timeout = max(self.timeout, FIRST_CONTACT_S) if patient else self.timeout
        reads = await asyncio.gather(
            *(self.run_script(inst, "epoch_read", [self.prefix], timeout)
              for inst in self.instances)
        )  # fmt: skip
        seen: dict[int, tuple[Epoch | None, int, bool]] = {}
        for n, read in enumerate(reads):
            if read is not None:
                raw, now_ms, has_marks = read
                epoch = Epoch.parse(raw.decode(errors="replace")) if raw else None
                seen[n] = (epoch, int(now_ms), bool(has_marks))
        missing = [n for n, (epoch, _, _) in seen.items() if epoch is None]
        todo = {n: state for n in missing if (state := self._state_for_missing(n, seen))}
        made = await asyncio.gather(
            *(self.run_script(self.instances[n], "epoch_create",
                              [self.prefix, uuid.uuid4().hex[:16], state])
              for n, state in todo.items())
        )  # fmt: skip
        for n, raw in zip(todo, made, strict=True):
            if raw is not None:
                _, now_ms, has_marks = seen[n]
                seen[n] = (Epoch.parse(raw.decode(errors="replace")), now_ms, has_marks)
        for n, (epoch, now_ms, _) in seen.items():
            await self._adopt(self.instances[n], epoch, now_ms)

    def _state_for_missing(
        self, n: int, seen: dict[int, tuple[Epoch | None, int, bool]]
    ) -> str | None:
        """The state to give instance `n`, which answered without an epoch; None: wait.

        Only the scripts that check the epoch open a slice, so an instance with
        marks but no epoch kept data written before epochs existed: trusted. One
        without marks lost its data if this gateway knew it by an epoch, or if
        another instance holds marks: recovering. If no instance that answers
        holds marks, nothing was claimed yet (a fresh deployment): trusted, once a
        majority answers.
        """
        _, _, has_marks = seen[n]
        if has_marks:
            return EPOCH_TRUSTED
        if self.instances[n].known_id is not None or any(m for _, _, m in seen.values()):
            return EPOCH_RECOVERING
        return EPOCH_TRUSTED if len(seen) >= self.majority else None

    async def _adopt(self, inst: Instance, epoch: Epoch | None, now_ms: int) -> None:
        """Take `epoch` as the instance's, decide its trust, log and count changes."""
        trusted = epoch is not None and (
            epoch.state == EPOCH_TRUSTED or now_ms - epoch.since_ms >= self.recovery_ms
        )
        if epoch is not None and trusted and epoch.state != EPOCH_TRUSTED:
            # A whole mark lifetime has passed: say so on the instance, for every gateway.
            promoted = epoch.with_state(EPOCH_TRUSTED)
            args = [self.prefix, epoch.raw, promoted.raw]
            if await self.run_script(inst, "epoch_set", args) == 1:
                epoch = promoted
        lost = epoch is not None and inst.known_id is not None and inst.known_id != epoch.id
        trust = "unknown" if epoch is None else "trusted" if trusted else "recovering"
        if epoch is None and trust != inst.trust:
            logger.warning(
                "Redis instance %s holds no epoch, and whether it lost its data cannot be "
                "decided while fewer than a majority answer: its answers are not counted",
                inst.name, extra={"redis": inst.name},
            )  # fmt: skip
        elif epoch is not None and not trusted and (lost or trust != inst.trust):
            logger.warning(
                "Redis instance %s %s (epoch %s, its data began %s): its answers are not "
                "counted until `dedup-gateway rebuild %s` or %s",
                inst.name, "lost its data" if lost else "is recovering", epoch.id,
                _when(epoch.since_ms), inst.name, _when(epoch.since_ms + self.recovery_ms),
                extra={"redis": inst.name},
            )  # fmt: skip
        elif trusted and inst.trust not in ("", "trusted"):
            logger.info("Redis instance %s is trusted again", inst.name, extra={"redis": inst.name})
        inst.epoch, inst.trusted, inst.trust = epoch, trusted, trust
        if epoch is not None:
            inst.known_id = epoch.id
        self.metrics.redis_recovering.labels(inst.name).set(0 if trusted else 1)
        self.metrics.quorum_healthy.set(1 if self.healthy else 0)

    # -- the data path ----------------------------------------------------------

    async def claim(self, digests: Sequence[bytes], owners: Sequence[str]) -> list[list[Reply]]:
        """Per instance, the reply for each digest: MINE, the owner that holds it, or
        None where the instance gave no answer (down, timed out, its chunk failed, or
        its data was lost since we last looked). An instance that is not trusted
        answers too: `counted()` says which answers the vote may count.

        Every digest must have the same length (they do: `keys.mark_digest`).
        """
        if not digests:
            return [[] for _ in self.instances]
        if not self._epochs_read:
            await self.refresh_epochs()
        n, size = len(digests), scripts.CHUNK_DIGESTS
        spans = [(start, min(start + size, n)) for start in range(0, n, size)]
        width = len(digests[0])
        blobs = [(b"".join(digests[a:b]), ",".join(owners[a:b]) + ",") for a, b in spans]

        async def one(inst: Instance) -> list[Reply]:
            if inst.epoch is None:  # not known: what it would answer could not be counted
                return [None] * n
            fills = self._take_fills(inst)
            todo: list[Call] = [("claim", [*self.layout, inst.epoch.id, width, d, o])
                                for d, o in blobs]  # fmt: skip
            if fills:  # first, so that this batch's claims see the completed marks
                todo.insert(0, self._fill_call(inst, fills))
            results = await self._run(inst, "claim", todo)
            if fills:
                if results[0] is None:
                    self._queue(inst, fills, front=True)
                results = results[1:]
            replies: list[Reply] = []
            for (a, b), result in zip(spans, results, strict=True):
                if result is None:
                    replies.extend([None] * (b - a))
                elif result.count(MINE) == len(result):  # all new (or replays): no decoding
                    replies.extend(result)
                else:
                    replies.extend([r if r == MINE else r.decode() for r in result])
            return replies

        out = list(await asyncio.gather(*(one(inst) for inst in self.instances)))
        if self._reread:
            await self.refresh_epochs()
        return out

    def queue_fills(self, per_instance: Sequence[Iterable[Fill]]) -> None:
        """Marks to complete later: per instance, (digest, winner, token sent) for the
        votes it gave no answer to (see scripts.FILL)."""
        for inst, fills in zip(self.instances, per_instance, strict=True):
            self._queue(inst, fills)

    async def repair(self, per_instance: Sequence[list[tuple[bytes, str, str]]]) -> int:
        """Rewrite (digest, seen owner, winner) marks where they still hold what was seen.

        A chunk that gets no answer is queued as fills (digest, winner, seen): the
        fill writes the winner where the mark still holds `seen`, once the instance
        answers. Dropped instead, a split left unrepaired would outlive the vote, and
        with another instance recovering a later copy could win its tie.
        """
        size = scripts.CHUNK_DIGESTS

        async def one(inst: Instance, todo: list[tuple[bytes, str, str]]) -> int:
            if not todo:
                return 0
            chunks = [todo[a : a + size] for a in range(0, len(todo), size)]
            calls: list[Call] = [
                ("repair", [*self.layout, *(v for mark in chunk for v in mark)]) for chunk in chunks
            ]
            results = await self._run(inst, "repair", calls)
            missed = [
                (digest, winner, seen)
                for chunk, result in zip(chunks, results, strict=True)
                if result is None
                for digest, seen, winner in chunk
            ]
            if missed:
                self._queue(inst, missed)
            return sum(int(r or 0) for r in results)

        results = await asyncio.gather(
            *(one(inst, todo) for inst, todo in zip(self.instances, per_instance, strict=True))
        )
        repaired = sum(results)
        self.metrics.repairs.inc(repaired)
        return repaired

    async def release(
        self, digests: Sequence[bytes], tokens: Sequence[str]
    ) -> list[list[int] | None]:
        """Per instance, 1/0 per digest for deleted/not, or None for no answer (or an
        instance that is not trusted)."""
        args = [*self.layout, *(v for pair in zip(digests, tokens, strict=True) for v in pair)]
        results = await self._counted_on_all(
            "release", lambda inst: inst.scripts["release"](args=args)
        )
        return [None if r is None else [int(x) for x in r] for r in results]

    async def handover(
        self, marks: Sequence[tuple[bytes, str, str, str]]
    ) -> list[list[int] | None]:
        """(digest, failed token, next token, command ref) per command.

        Per instance, per command: 1 handed over now, 2 replay of the same
        command (redo), 3 another copy of the command, 4 already done, 0 stale;
        None for no answer (or an instance that is not trusted).
        """
        keys = [handover_key(self.prefix, digest) for digest, *_ in marks]
        args = [b"".join(digest for digest, *_ in marks),
                *(v for _, failed, nxt, ref in marks for v in (failed, nxt, ref))]  # fmt: skip

        async def call(inst: Instance) -> Any:
            assert inst.epoch is not None
            reply = await inst.scripts["handover"](
                keys=keys, args=[*self.layout, inst.epoch.id, *args]
            )
            if isinstance(reply, bytes):  # 'epoch:...'
                self._epoch_differs(inst, reply.decode())
                return None
            return reply

        results = await self._counted_on_all("handover", call, needs_epoch=True)
        if self._reread:
            await self.refresh_epochs()
        return [None if r is None else [int(x) for x in r] for r in results]

    async def mark_done(self, digests: Sequence[bytes], refs: Sequence[str]) -> None:
        """Note that these commands' effects are acknowledged (see scripts.MARK_DONE)."""
        keys = [handover_key(self.prefix, digest) for digest in digests]
        await self._on_all(
            "mark_done", lambda inst: inst.scripts["mark_done"](keys=keys, args=list(refs))
        )

    # -- coalescing windows (gateway/coalesce.py, scripts.COALESCE_*) -------------

    async def coalesce_update(
        self, digests: Sequence[bytes], stamps: Sequence[int], versions: Sequence[str],
        mode: str, window_ms: int, max_window_ms: int, on: Sequence[bool] | None = None,
    ) -> list[list[tuple[int, bool]] | None]:  # fmt: skip
        """Per instance, per update: (its window's start, whether it opened the window);
        None where the instance gave no answer (or had another epoch), or is not `on`."""
        if not digests:
            return [[] for _ in self.instances]
        if not self._epochs_read:
            await self.refresh_epochs()
        width = len(digests[0])

        async def one(inst: Instance, asked: bool) -> list[tuple[int, bool]] | None:
            if inst.epoch is None or not asked:
                return None
            head = [inst.epoch.id, mode, window_ms, max_window_ms, width]
            flat = await self._in_chunks(
                inst, "coalesce_update", len(digests),
                lambda a, b: [*head, b"".join(digests[a:b]),
                              "".join(f"{t}," for t in stamps[a:b]),
                              "".join(f"{v}," for v in versions[a:b])],
            )  # fmt: skip
            if flat is None:
                return None
            return [(int(flat[k]), int(flat[k + 1]) == 1) for k in range(0, len(flat), 2)]

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
        """Per instance, per window: (newest version or '', updates, newest timestamp);
        None where the instance gave no answer."""
        if not digests:
            return [[] for _ in self.instances]
        width = len(digests[0])

        async def one(inst: Instance) -> list[tuple[str, int, int]] | None:
            flat = await self._in_chunks(
                inst, "coalesce_close", len(digests),
                lambda a, b: [width, b"".join(digests[a:b]),
                              "".join(f"{s}," for s in starts[a:b])],
            )  # fmt: skip
            if flat is None:
                return None
            return [
                (flat[k].decode(), int(flat[k + 1]), int(flat[k + 2]))
                for k in range(0, len(flat), 3)
            ]

        return list(await asyncio.gather(*(one(inst) for inst in self.instances)))

    async def _in_chunks(
        self, inst: Instance, script: str, n: int, args_of: Callable[[int, int], list[Any]]
    ) -> list[Any] | None:
        """`script` on `inst` over items [0, n) in chunks of `scripts.CHUNK_DIGESTS`, the
        arguments of items [a, b) being the layout and `args_of(a, b)`; the replies
        flattened, or None when a chunk got no answer."""
        size = scripts.CHUNK_DIGESTS
        calls: list[Call] = [
            (script, [*self.layout, *args_of(a, min(a + size, n))]) for a in range(0, n, size)
        ]
        replies = await self._run(inst, script, calls)
        if any(r is None for r in replies):
            return None
        return [x for r in replies if r is not None for x in r]

    async def delete(self, digest: bytes) -> list[int | None]:
        """Release the mark whoever holds it (operator release; a tombstone, gateway/keys.py);
        per instance 1 released, 0 absent or released already, None for no answer (or an
        instance that is not trusted)."""
        args = [*self.layout, digest]
        return await self._counted_on_all("delete", lambda i: i.scripts["delete"](args=args))

    async def inspect(self, digest: bytes) -> list[MarkView | None]:
        """Per instance, the mark and its bucket (owner None when absent); None if down."""

        async def call(inst: Instance) -> MarkView:
            found = await inst.scripts["inspect"](args=[*self.layout, digest])
            handed = await inst.client.get(handover_key(self.prefix, digest))
            by = handed.decode() if isinstance(handed, bytes) else handed
            if not found:
                return MarkView(None, -2, None, by)
            owner, ttl, encoding = found
            return MarkView(owner.decode(), int(ttl), encoding.decode(), by)

        return await self._on_all("inspect", call)

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
        """Up to one chunk of queued fills, when the instance's epoch is known."""
        if not inst.backlog or inst.epoch is None:
            return []
        taken = [
            inst.backlog.popleft() for _ in range(min(len(inst.backlog), scripts.CHUNK_DIGESTS))
        ]
        self.metrics.repair_backlog.labels(inst.name).set(len(inst.backlog))
        return taken

    def _fill_call(self, inst: Instance, fills: list[Fill]) -> Call:
        assert inst.epoch is not None
        digests = b"".join(digest for digest, _, _ in fills)
        winners = "".join(f"{winner}," for _, winner, _ in fills)
        sent = "".join(f"{token}," for _, _, token in fills)
        return "fill", [*self.layout, inst.epoch.id, len(fills[0][0]), digests, winners, sent]

    async def _drain(self, inst: Instance) -> None:
        """Send this instance's queued fills, a chunk per call, until the backlog seen at
        the start is sent or a call fails."""
        for _ in range(-(-len(inst.backlog) // scripts.CHUNK_DIGESTS)):
            fills = self._take_fills(inst)
            if not fills:
                return
            (result,) = await self._run(inst, "fill", [self._fill_call(inst, fills)])
            if result is None:
                self._queue(inst, fills, front=True)
                return

    # -- calls ------------------------------------------------------------------

    async def _run(self, inst: Instance, what: str, calls: Sequence[Call]) -> list[Any | None]:
        """The calls on `inst`, in order on one connection, `scripts.CHUNKS_PER_TRIP` per
        round trip, each round trip bounded by `[redis] timeout` (timed as `what`). The
        reply per call; None for a call that got no answer (after a timeout or a lost
        connection the calls not yet sent are not sent) or found another epoch."""
        results: list[Any | None] = [None] * len(calls)
        for start in range(0, len(calls), scripts.CHUNKS_PER_TRIP):
            group = range(start, min(start + scripts.CHUNKS_PER_TRIP, len(calls)))
            trip = partial(self._pipelined, inst, [calls[n] for n in group])
            replies = await self._timed(inst, what, trip)
            if replies is None:
                return results
            for n, reply in zip(group, replies, strict=True):
                if isinstance(reply, ResponseError):
                    self._failed(inst, "response", str(reply))
                elif isinstance(reply, bytes) and reply.startswith(b"epoch:"):
                    self._epoch_differs(inst, reply[len(b"epoch:") :].decode())
                    return results
                else:
                    results[n] = reply
        return results

    async def _pipelined(self, inst: Instance, calls: list[Call]) -> list[Any]:
        """EVALSHA per call in one pipeline. A script the instance does not have (it
        restarted) is loaded, and the calls it refused are sent once more."""
        replies = await self._send(inst, calls)
        lost = [n for n, reply in enumerate(replies) if isinstance(reply, NoScriptError)]
        if lost:
            for name in {calls[n][0] for n in lost}:
                await inst.client.script_load(inst.scripts[name].script)
            again = await self._send(inst, [calls[n] for n in lost])
            for n, reply in zip(lost, again, strict=True):
                replies[n] = reply
        return replies

    async def _send(self, inst: Instance, calls: list[Call]) -> list[Any]:
        pipe = inst.client.pipeline(transaction=False)
        for name, args in calls:
            pipe.evalsha(inst.scripts[name].sha, 0, *args)
        replies: list[Any] = await pipe.execute(raise_on_error=False)
        return replies

    def _epoch_differs(self, inst: Instance, held: str) -> None:
        """A claim found another epoch: the instance lost its data since we read it."""
        logger.warning(
            "Redis instance %s holds epoch %r, not %r: nothing was written; re-reading epochs",
            inst.name, held, inst.epoch.raw if inst.epoch else None, extra={"redis": inst.name},
        )  # fmt: skip
        inst.epoch, inst.trusted = None, False
        self._reread = True
        self.metrics.redis_recovering.labels(inst.name).set(1)
        self.metrics.quorum_healthy.set(1 if self.healthy else 0)

    async def _counted_on_all(
        self, script: str, call: Callable[[Instance], Awaitable[T]], needs_epoch: bool = False
    ) -> list[T | None]:
        """`call` on every instance; None where it gave no answer, where the vote must
        not count it (not trusted), or, with `needs_epoch`, where its epoch is not
        known (then it is not called: a script that writes needs the epoch)."""
        if not self._epochs_read:
            await self.refresh_epochs()

        async def one(inst: Instance) -> T | None:
            if needs_epoch and inst.epoch is None:
                return None
            return await self._timed(inst, script, partial(call, inst))

        results = await asyncio.gather(*(one(inst) for inst in self.instances))
        return [r if i.trusted else None for i, r in zip(self.instances, results, strict=True)]

    async def _on_all(
        self, script: str, call: Callable[[Instance], Awaitable[T]]
    ) -> list[T | None]:
        return list(await asyncio.gather(*(self._timed(i, script, partial(call, i))
                                           for i in self.instances)))  # fmt: skip

    async def run_script(
        self, inst: Instance, name: str, args: list[Any], bound_s: float | None = None
    ) -> Any | None:
        """One call of script `name` on `inst`, bounded by `bound_s` (default: `[redis]
        timeout`); None for no answer (counted and logged like every other call)."""
        return await self._timed(inst, name, partial(inst.scripts[name], args=args), bound_s)

    async def _timed(
        self, inst: Instance, script: str, call: Callable[[], Awaitable[T]],
        bound_s: float | None = None,
    ) -> T | None:  # fmt: skip
        started = time.perf_counter()
        timeout = bound_s or self.timeout
        try:
            result = await asyncio.wait_for(call(), timeout)
        except (TimeoutError, RedisTimeoutError):
            self._failed(inst, "timeout", f"no answer within {timeout}s")
            return None
        except AuthenticationError as exc:  # before its base class, ConnectionError
            self._failed(inst, "auth", str(exc))
            return None
        except RedisConnectionError as exc:
            self._failed(inst, "connection", str(exc))
            return None
        except ResponseError as exc:  # e.g. OOM under noeviction, or a script error
            self._failed(inst, "response", str(exc))
            return None
        except RedisError as exc:
            self._failed(inst, "other", str(exc))
            return None
        except RuntimeError as exc:
            # uvloop's error for a write to a connection the server just closed (seen
            # on the handshake of a reconnect to a restarting member); redis-py passes
            # it on untranslated, after dropping the connection.
            if _CLOSED_TRANSPORT not in str(exc):
                raise
            self._failed(inst, "connection", str(exc))
            return None
        self.metrics.redis_call_seconds.labels(inst.name, script).observe(
            time.perf_counter() - started
        )
        if not inst.up:
            logger.info("Redis instance %s answers", inst.name, extra={"redis": inst.name})
        inst.failure = None
        self._set_up(inst, True)
        return result

    def _failed(self, inst: Instance, kind: str, detail: str) -> None:
        self.metrics.redis_errors.labels(inst.name, kind).inc()
        inst.failure = (kind, detail)
        if inst.up:
            logger.warning(
                "Redis instance %s failed (%s): %s", inst.name, kind, detail,
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


def _when(epoch_ms: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(epoch_ms / 1000))
