"""One quorum member: its client, its state, and the accounting of every call to it.

Every call to a member goes through `MemberLink.timed`: bounded by `[redis]
timeout`, its failure sorted into a kind (timeout, auth, connection, response,
other) for the metrics and the log, and the member's `up` (and, on a cluster
member, its key groups that are down) kept from the outcome.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import AuthenticationError, RedisError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from gateway.member_urls import MemberUrl
from gateway.metrics import Metrics
from gateway.quorum.keys import Epoch
from gateway.quorum.members import Group
from gateway.rules.trust import TRUST_MOVES, Trust

logger = logging.getLogger(__name__)
_CLOSED_TRANSPORT = "unable to perform operation on"  # uvloop: the handle is closed
T = TypeVar("T")

# A mark to complete on one member: (digest, winner token, token of the claim it
# gave no answer to: that claim may still have run, late).
Fill = tuple[bytes, str, str]


__all__ = ["TRUST_MOVES", "IllegalTrustMove", "MemberLink", "Trust"]  # Trust: rules/trust.py


class IllegalTrustMove(RuntimeError):
    """A move of a member's trust that `TRUST_MOVES` does not allow: a bug in what
    decides it (gateway/quorum/epochs.py), never an outage."""


@dataclass
class MemberLink:
    """One member of `[redis] nodes`: its client and script objects, its key groups,
    and what the gateway knows of it."""

    name: str  # host:port/db or cluster:host:port, never the password
    client: aioredis.Redis | RedisCluster
    scripts: dict[str, Any]  # redis-py Script objects by name: EVALSHA, reloaded on NOSCRIPT
    groups: list[Group]  # one for a standalone member
    metrics: Metrics
    timeout: float  # `[redis] timeout`, seconds
    on_health: Callable[[], None] = lambda: None  # a member's up, trust or pause changed
    up: bool = False
    failure: tuple[str, str] | None = None  # (kind, detail) of the last call, if it failed
    epoch: Epoch | None = None  # as last read; None: not known (no claims are sent)
    known_id: str | None = None  # the last epoch id this gateway knew it by
    trust: Trust = Trust.NEW
    reported: Trust = Trust.NEW  # the trust last logged: a change is logged once
    paused: bool = False  # `dedup-gateway pause`: no claims, not counted
    down_groups: set[int] = field(default_factory=set)  # groups whose last call failed
    backlog: deque[Fill] = field(default_factory=deque)
    sending: int = 0  # fill calls in flight (taken from the backlog, not yet answered)
    # Held by a vote's calls to this member (claims.py): claims reach it in order.
    claiming: asyncio.Lock = field(default_factory=asyncio.Lock, repr=False)
    behind: set[str] = field(default_factory=set)  # other runs that noted it behind (behind.py)
    stale: set[str] = field(default_factory=set)  # of those, the runs that stopped
    lagging: bool = False  # not counted only for marks it missed: a catch-up completes it
    url: MemberUrl | None = None  # a cluster member's, for `nodes`
    # How its claims run (`[redis] claim`): "lua", "module" (the native claim,
    # gateway/quorum/native), "" not decided yet (the Lua script: both answer alike).
    claim_path: str = ""
    nodes: dict[str, aioredis.Redis] = field(default_factory=dict)  # by node name: pipelines

    @property
    def cluster(self) -> bool:
        return len(self.groups) > 1

    @property
    def trusted(self) -> bool:
        """Its answers count in votes (unless it is paused)."""
        return self.trust is Trust.TRUSTED

    @property
    def counted(self) -> bool:
        """The vote may count its answers: trusted and not paused."""
        return self.trusted and not self.paused

    def set_trust(self, trust: Trust) -> None:
        """Move its trust (gateway/quorum/epochs.py decides). A move `TRUST_MOVES` does
        not allow, or UNKNOWN with an epoch known (or another trust without one), is a
        bug: raised, not logged and refused, because refusing would keep a trust its
        epoch no longer supports (a member that lost its data counted in votes), and the
        gateway stops loudly instead (as on any bug in the watch or a loop)."""
        if trust not in TRUST_MOVES[self.trust] or (trust is Trust.UNKNOWN) != (self.epoch is None):
            known = "no epoch known" if self.epoch is None else f"epoch {self.epoch.raw}"
            raise IllegalTrustMove(
                f"Redis member {self.name}: trust {self.trust.name} -> {trust.name} is not a "
                f"legal move ({known})"
            )
        self.trust = trust
        self.metrics.redis_recovering.labels(self.name).set(0 if self.trusted else 1)
        self.on_health()

    def set_behind(self, lagging: bool) -> None:
        self.lagging = lagging
        self.metrics.redis_behind.labels(self.name).set(1 if lagging else 0)

    def set_paused(self, paused: bool) -> None:
        self.paused = paused
        self.metrics.redis_paused.labels(self.name).set(1 if paused else 0)
        self.on_health()

    async def timed(
        self, script: str, call: Callable[[], Awaitable[T]],
        bound_s: float | None = None, group: int | Sequence[int] = 0,
    ) -> T | None:  # fmt: skip
        """`call`'s result within `bound_s`; None for no answer, counted and logged
        against its key group(s) (`group`: one, or those a pipelined trip served)."""
        started = time.perf_counter()
        timeout = bound_s or self.timeout
        try:
            result = await asyncio.wait_for(call(), timeout)
        except (TimeoutError, RedisTimeoutError):
            self.failed("timeout", f"no answer within {timeout}s", group)
            return None
        except AuthenticationError as exc:  # before its base class, ConnectionError
            self.failed("auth", str(exc), group)
            return None
        except RedisConnectionError as exc:  # some say nothing (MaxConnectionsError)
            self.failed("connection", str(exc) or type(exc).__name__, group)
            return None
        except ResponseError as exc:  # e.g. OOM under noeviction, or a script error
            self.failed("response", str(exc), group)
            return None
        except RedisError as exc:  # a cluster's own errors (no node serves the slot) too
            self.failed("other", str(exc), group)
            return None
        except RuntimeError as exc:
            # uvloop's error for a write to a connection the server just closed (seen
            # on the handshake of a reconnect to a restarting member); redis-py passes
            # it on untranslated, after dropping the connection.
            if _CLOSED_TRANSPORT not in str(exc):
                raise
            self.failed("connection", str(exc), group)
            return None
        except AttributeError as exc:
            # redis-py's cluster client can hand a call a connection that a concurrent
            # refresh of the slot map has just closed ('NoneType' object has no
            # attribute 'writelines'): that call got no answer; the next one reconnects.
            if not self.cluster:
                raise
            detail = f"connection closed under the call by a slot map refresh ({exc})"
            self.failed("connection", detail, group)
            return None
        self.metrics.redis_call_seconds.labels(self.name, script).observe(
            time.perf_counter() - started
        )
        answered = self.down_groups.intersection(_groups(group))
        if answered:
            self.down_groups -= answered
            self.metrics.redis_groups_down.labels(self.name).set(len(self.down_groups))
            if not self.down_groups and self.up:
                logger.info("Redis member %s: every key group answers again", self.name,
                            extra={"redis": self.name})  # fmt: skip
        if not self.up:
            logger.info("Redis member %s answers", self.name, extra={"redis": self.name})
        if not self.cluster:  # a cluster member's is cleared by its epoch read
            self.failure = None
        self._set_up(True)
        return result

    def failed(self, kind: str, detail: str, group: int | Sequence[int] = 0) -> None:
        """Count and log a call that got no answer. A cluster member is down when
        every key group is; while some answer, only the groups that do not are."""
        self.metrics.redis_errors.labels(self.name, kind).inc()
        self.failure = (kind, detail)
        failed = [g for g in _groups(group) if g not in self.down_groups]
        if self.cluster and failed:
            first = not self.down_groups
            self.down_groups.update(failed)
            self.metrics.redis_groups_down.labels(self.name).set(len(self.down_groups))
            if first and self.up:
                logger.warning(
                    "Redis member %s: key group %s failed (%s): %s; its records get no "
                    "answer from this member", self.name, self.named(failed), kind, detail,
                    extra={"redis": self.name, "kind": kind},
                )  # fmt: skip
        if self.cluster and len(self.down_groups) < len(self.groups):
            return
        if self.up:
            logger.warning(
                "Redis member %s failed (%s): %s", self.name, kind, detail,
                extra={"redis": self.name, "kind": kind},
            )  # fmt: skip
        self._set_up(False)

    def _set_up(self, up: bool) -> None:
        self.up = up
        self.metrics.redis_up.labels(self.name).set(1 if up else 0)
        self.on_health()

    def named(self, groups: Sequence[int]) -> str:
        """Key groups as a log names them: the first three prefixes, and how many more."""
        names = ", ".join(self.groups[g].prefix.decode(errors="replace") for g in groups[:3])
        return names + (f" and {len(groups) - 3} more" if len(groups) > 3 else "")

    async def close(self) -> None:
        await self.client.aclose()
        for node in self.nodes.values():
            await node.aclose()


def _groups(group: int | Sequence[int]) -> Sequence[int]:
    return (group,) if isinstance(group, int) else group
