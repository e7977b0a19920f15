"""The N Redis instances, queried concurrently, one script call each per batch.

This is the only module that talks to Redis on the data path. Each call is
bounded by `[redis] timeout`; an instance that errs or is too slow gives no
answer for that batch (`None` replies), which the vote treats as unknown.
Connection, timeout and response errors are told apart in the metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import redis.asyncio as aioredis
from redis.backoff import NoBackoff
from redis.exceptions import AuthenticationError, RedisError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from gateway import scripts
from gateway.config import ConfigError, RedisSettings, redacted
from gateway.keys import handover_key
from gateway.metrics import Metrics
from gateway.vote import Reply

logger = logging.getLogger(__name__)
T = TypeVar("T")


class CredentialsRefused(ConfigError):
    """A Redis instance refused the user/password of its URL: a setting to fix, not an outage."""


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
    claim: Any  # redis-py Script objects: EVALSHA with a reload on NOSCRIPT
    repair: Any
    release: Any
    handover: Any
    mark_done: Any
    inspect: Any
    delete: Any
    up: bool = False
    failure: tuple[str, str] | None = None  # (kind, detail) of the last call, if it failed


class Quorum:
    """The instances of `[redis] nodes` and the calls the gateway makes to them."""

    def __init__(self, settings: RedisSettings, metrics: Metrics) -> None:
        self.metrics = metrics
        self.timeout = settings.timeout.total_seconds()
        self.ttl_ms = int(settings.ttl.total_seconds() * 1000)
        self.prefix = settings.key_prefix.encode()
        # What every mark script takes first (gateway/scripts.py).
        self._layout: list[Any] = [
            self.prefix,
            self.ttl_ms,
            self.ttl_ms // scripts.SLICES_BACK,
            settings.buckets,
        ]
        self.size = len(settings.nodes)
        self.majority = self.size // 2 + 1
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
                    claim=client.register_script(scripts.CLAIM),
                    repair=client.register_script(scripts.REPAIR),
                    release=client.register_script(scripts.RELEASE),
                    handover=client.register_script(scripts.HANDOVER),
                    mark_done=client.register_script(scripts.MARK_DONE),
                    inspect=client.register_script(scripts.INSPECT),
                    delete=client.register_script(scripts.DELETE),
                )
            )
        metrics.quorum_size.set(self.majority)

    @property
    def healthy(self) -> bool:
        return sum(i.up for i in self.instances) >= self.majority

    async def wait_for_majority(self, stop: asyncio.Event, retry_s: float = 1.0) -> None:
        """Return once a majority answers PING; name every instance that does not.

        Raises `CredentialsRefused` when any instance refuses the URL's credentials.
        """
        while not stop.is_set():
            await self._on_all("ping", lambda inst: inst.client.ping())
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
            if self.size - len(failed) >= self.majority:
                if down:
                    logger.warning("serving with Redis instances unreachable: %s", ", ".join(down))
                return
            logger.error(
                "waiting for a Redis majority (%d of %d); unreachable: %s",
                self.majority, self.size, ", ".join(down),
            )  # fmt: skip
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), retry_s)

    async def claim(self, digests: Sequence[bytes], owners: Sequence[str]) -> list[list[Reply]]:
        """Per instance, the reply for each digest (all `None` for an instance that failed).

        Every digest must have the same length (they do: `keys.mark_digest`).
        """
        if not digests:
            return [[] for _ in self.instances]
        args = [*self._layout, len(digests[0]), b"".join(digests), ",".join(owners) + ","]
        results = await self._on_all("claim", lambda inst: inst.claim(keys=[], args=args))
        return [
            [r if isinstance(r, int) else r.decode() for r in result]
            if result is not None
            else [None] * len(digests)
            for result in results
        ]

    async def repair(self, per_instance: Sequence[list[tuple[bytes, str, str]]]) -> int:
        """Rewrite (digest, seen owner, winner) marks where they still hold what was seen."""

        async def call(inst: Instance) -> int:
            todo = per_instance[self.instances.index(inst)]
            if not todo:
                return 0
            args = [*self._layout, *(v for mark in todo for v in mark)]
            return int(await inst.repair(keys=[], args=args))

        results = await self._on_all("repair", call)
        repaired = sum(r or 0 for r in results)
        self.metrics.repairs.inc(repaired)
        return repaired

    async def release(
        self, digests: Sequence[bytes], tokens: Sequence[str]
    ) -> list[list[int] | None]:
        """Per instance, 1/0 per digest for deleted/not, or None for no answer."""
        args = [*self._layout, *(v for pair in zip(digests, tokens, strict=True) for v in pair)]
        results = await self._on_all("release", lambda inst: inst.release(keys=[], args=args))
        return [None if r is None else [int(x) for x in r] for r in results]

    async def handover(
        self, marks: Sequence[tuple[bytes, str, str, str]]
    ) -> list[list[int] | None]:
        """(digest, failed token, next token, command ref) per command.

        Per instance, per command: 1 handed over now, 2 replay of the same
        command (redo), 3 another copy of the command, 4 already done, 0 stale;
        None for no answer.
        """
        keys = [handover_key(self.prefix, digest) for digest, *_ in marks]
        args = [*self._layout, b"".join(digest for digest, *_ in marks),
                *(v for _, failed, nxt, ref in marks for v in (failed, nxt, ref))]  # fmt: skip
        results = await self._on_all("handover", lambda inst: inst.handover(keys=keys, args=args))
        return [None if r is None else [int(x) for x in r] for r in results]

    async def mark_done(self, digests: Sequence[bytes], refs: Sequence[str]) -> None:
        """Note that these commands' effects are acknowledged (see scripts.MARK_DONE)."""
        keys = [handover_key(self.prefix, digest) for digest in digests]
        await self._on_all("mark_done", lambda inst: inst.mark_done(keys=keys, args=list(refs)))

    async def delete(self, digest: bytes) -> list[int | None]:
        """Delete the mark whoever holds it (operator release); None for no answer."""
        args = [*self._layout, digest]
        return await self._on_all("delete", lambda inst: inst.delete(keys=[], args=args))

    async def inspect(self, digest: bytes) -> list[MarkView | None]:
        """Per instance, the mark and its bucket (owner None when absent); None if down."""

        async def call(inst: Instance) -> MarkView:
            found = await inst.inspect(keys=[], args=[*self._layout, digest])
            handed = await inst.client.get(handover_key(self.prefix, digest))
            by = handed.decode() if isinstance(handed, bytes) else handed
            if not found:
                return MarkView(None, -2, None, by)
            owner, ttl, encoding = found
            return MarkView(owner.decode(), int(ttl), encoding.decode(), by)

        return await self._on_all("inspect", call)

    async def _on_all(
        self, script: str, call: Callable[[Instance], Awaitable[T]]
    ) -> list[T | None]:
        return list(await asyncio.gather(*(self._timed(i, script, call) for i in self.instances)))

    async def _timed(
        self, inst: Instance, script: str, call: Callable[[Instance], Awaitable[T]]
    ) -> T | None:
        started = time.perf_counter()
        try:
            result = await asyncio.wait_for(call(inst), self.timeout)
        except (TimeoutError, RedisTimeoutError):
            self._failed(inst, "timeout", f"no answer within {self.timeout}s")
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
        self.metrics.redis_call_seconds.labels(inst.name, script).observe(
            time.perf_counter() - started
        )
        if not inst.up:
            logger.info("Redis instance %s answers", inst.name)
        inst.failure = None
        self._set_up(inst, True)
        return result

    def _failed(self, inst: Instance, kind: str, detail: str) -> None:
        self.metrics.redis_errors.labels(inst.name, kind).inc()
        inst.failure = (kind, detail)
        if inst.up:
            logger.warning("Redis instance %s failed (%s): %s", inst.name, kind, detail)
        self._set_up(inst, False)

    def _set_up(self, inst: Instance, up: bool) -> None:
        inst.up = up
        self.metrics.redis_up.labels(inst.name).set(1 if up else 0)
        self.metrics.quorum_healthy.set(1 if self.healthy else 0)

    async def close(self) -> None:
        for inst in self.instances:
            await inst.client.aclose()
