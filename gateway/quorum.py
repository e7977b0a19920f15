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
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from gateway import scripts
from gateway.config import RedisSettings, redacted
from gateway.metrics import Metrics
from gateway.vote import Reply

logger = logging.getLogger(__name__)
T = TypeVar("T")


class QuorumUnavailable(RuntimeError):
    """Fewer than a majority of instances answer."""


@dataclass
class Instance:
    name: str  # host:port/db, never the password
    client: aioredis.Redis
    claim: Any  # redis-py Script objects: EVALSHA with a reload on NOSCRIPT
    repair: Any
    release: Any
    handover: Any
    mark_done: Any
    up: bool = False


class Quorum:
    """The instances of `[redis] nodes` and the calls the gateway makes to them."""

    def __init__(self, settings: RedisSettings, metrics: Metrics) -> None:
        self.metrics = metrics
        self.timeout = settings.timeout.total_seconds()
        self.ttl_ms = int(settings.ttl.total_seconds() * 1000)
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
                )
            )
        metrics.quorum_size.set(self.majority)

    @property
    def healthy(self) -> bool:
        return sum(i.up for i in self.instances) >= self.majority

    async def wait_for_majority(self, stop: asyncio.Event, retry_s: float = 1.0) -> None:
        """Return once a majority answers PING; name every instance that does not."""
        while not stop.is_set():
            replies = await self._on_all("ping", lambda inst: inst.client.ping())
            down = [inst.name for inst, ok in zip(self.instances, replies, strict=True) if not ok]
            if sum(1 for ok in replies if ok) >= self.majority:
                if down:
                    logger.warning("serving with Redis instances unreachable: %s", ", ".join(down))
                return
            logger.error(
                "waiting for a Redis majority (%d of %d); unreachable: %s",
                self.majority, self.size, ", ".join(down),
            )  # fmt: skip
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), retry_s)

    async def claim(self, keys: Sequence[bytes], owners: Sequence[str]) -> list[list[Reply]]:
        """Per instance, the reply for each key (all `None` for an instance that failed).

        Every key must have the same length (they do: prefix + fixed digest).
        """
        if not keys:
            return [[] for _ in self.instances]
        args = [self.ttl_ms, len(keys[0]), b"".join(keys), ",".join(owners) + ","]
        results = await self._on_all("claim", lambda inst: inst.claim(keys=[], args=args))
        return [
            [r if isinstance(r, int) else r.decode() for r in result]
            if result is not None
            else [None] * len(keys)
            for result in results
        ]

    async def repair(self, per_instance: Sequence[list[tuple[bytes, str, str]]]) -> int:
        """Rewrite (key, seen owner, winner) marks where they still hold what was seen."""

        async def call(inst: Instance) -> int:
            todo = per_instance[self.instances.index(inst)]
            if not todo:
                return 0
            args = [v for _, seen, winner in todo for v in (seen, winner)]
            return int(await inst.repair(keys=[k for k, _, _ in todo], args=args))

        results = await self._on_all("repair", call)
        repaired = sum(r or 0 for r in results)
        self.metrics.repairs.inc(repaired)
        return repaired

    async def release(self, keys: Sequence[bytes], tokens: Sequence[str]) -> list[list[int] | None]:
        """Per instance, 1/0 per key for deleted/not, or None for no answer."""
        results = await self._on_all(
            "release", lambda inst: inst.release(keys=keys, args=list(tokens))
        )
        return [None if r is None else [int(x) for x in r] for r in results]

    async def handover(
        self, marks: Sequence[tuple[bytes, bytes, str, str, str]]
    ) -> list[list[int] | None]:
        """(mark key, handover key, failed token, next token, command ref) per command.

        Per instance, per command: 1 handed over now, 2 replay of the same
        command (redo), 3 another copy of the command, 4 already done, 0 stale;
        None for no answer.
        """
        keys = [k for mark, by, *_ in marks for k in (mark, by)]
        args = [self.ttl_ms, *(v for *_, failed, nxt, ref in marks for v in (failed, nxt, ref))]
        results = await self._on_all("handover", lambda inst: inst.handover(keys=keys, args=args))
        return [None if r is None else [int(x) for x in r] for r in results]

    async def mark_done(self, handover_keys: Sequence[bytes], refs: Sequence[str]) -> None:
        """Note that these commands' effects are acknowledged (see scripts.MARK_DONE)."""
        await self._on_all(
            "mark_done", lambda inst: inst.mark_done(keys=handover_keys, args=list(refs))
        )

    async def delete(self, key: bytes) -> list[int | None]:
        """Unconditional delete on every instance (operator release); None for no answer."""
        return await self._on_all("delete", lambda inst: inst.client.delete(key))

    async def inspect(self, key: bytes) -> list[tuple[str, str | None, int] | None]:
        """Per instance: (name, owner or None, TTL ms; -2 when absent), or None if down."""

        async def call(inst: Instance) -> tuple[str, str | None, int]:
            owner = await inst.client.get(key)
            ttl = await inst.client.pttl(key)
            held = owner.decode() if isinstance(owner, bytes) else owner
            return inst.name, held, int(ttl)

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
        self._set_up(inst, True)
        return result

    def _failed(self, inst: Instance, kind: str, detail: str) -> None:
        self.metrics.redis_errors.labels(inst.name, kind).inc()
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
