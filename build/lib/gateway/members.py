"""Quorum members: their URLs, their clients, and how their keys are grouped.

A member is one `redis-server` (`redis://`, `rediss://`) or one Redis Cluster
(`redis+cluster://h1:7000,h2:7000`, `rediss+cluster://...`): managed services
in cluster mode, Valkey clusters, marks that outgrow one machine.

A cluster runs a script only when every key it touches lives in one hash
slot, so a cluster member's keys are split into `[redis] cluster_groups`
groups, each under its own hash tag: `<prefix>{<k>.<groups>}` (k = the
digest's `group_of`). A group holds its own slice meta, buckets, handover
keys, coalescing windows, epoch copy and pause flag (gateway/keys.py), and a
batch is sent as one call per group. A standalone member is one group whose
prefix is the plain key prefix: its layout is what it was before clusters.
The group count is part of the tag, so a member whose count changed looks
empty (lost data: recovering) instead of hiding the marks it holds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any
from urllib.parse import parse_qsl

import redis.asyncio as aioredis
from pydantic import UrlConstraints
from pydantic_core import MultiHostUrl
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.retry import Retry

CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
MemberUrl = Annotated[
    MultiHostUrl,
    UrlConstraints(
        allowed_schemes=["redis", "rediss", *CLUSTER_SCHEMES], default_port=6379, host_required=True
    ),
]
# The TLS options a cluster URL may carry in its query (plain URLs take redis-py's own).
_CLUSTER_QUERY = {
    "ssl_cert_reqs",
    "ssl_ca_certs",
    "ssl_certfile",
    "ssl_keyfile",
    "ssl_check_hostname",
}
# How far a cluster call may be redirected (MOVED/ASK) or retried (TRYAGAIN, a node
# failing over) inside our own `[redis] timeout`.
CLUSTER_ATTEMPTS = 3
# The cluster client carries the calls made group by group (epoch reads and copies,
# calls sent again after a redirect; the rest goes pipelined per master on
# `node_client_for` connections): at most one per key group for each concurrent
# operation. redis-py's own bound (100 per node) refused the calls past it with
# MaxConnectionsError, so a burst over many groups made groups of a healthy member
# give no answer.
CLUSTER_CALLS_PER_GROUP = 8


def is_cluster(url: MultiHostUrl) -> bool:
    return url.scheme in CLUSTER_SCHEMES


def member_name(url: MultiHostUrl) -> str:
    """`host:port/db`, or `cluster:host:port` (the first seed) for a cluster: safe to
    log and to use as a metric label, never the password."""
    first = url.hosts()[0]
    where = f"{first['host']}:{first['port']}"
    return f"cluster:{where}" if is_cluster(url) else f"{where}{url.path or ''}"


def masked(url: MultiHostUrl) -> str:
    """The URL with its password replaced by `***`."""
    text = str(url)
    for host in url.hosts():
        if host["password"]:
            text = text.replace(f":{host['password']}@", ":***@", 1)
    return text


def check_member_url(url: MultiHostUrl) -> None:
    """Raise ValueError for what the URL type cannot say: a cluster has database 0 only."""
    if is_cluster(url) and (url.path or "/") not in ("/", "/0"):
        raise ValueError(f"{member_name(url)}: a Redis Cluster has database 0 only, got {url.path}")
    if not is_cluster(url) and len(url.hosts()) > 1:
        raise ValueError(f"{member_name(url)}: several hosts need the redis+cluster:// scheme")


def client_for(
    url: MultiHostUrl, timeout_s: float, groups: int = 1
) -> aioredis.Redis | RedisCluster:
    """The member's client. Our own timeout and the vote handle failure, so a plain
    client retries nothing; a cluster client (of `groups` key groups) follows
    redirects and a failover inside the member, within that timeout."""
    if not is_cluster(url):
        return aioredis.Redis.from_url(
            str(url),
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),
            health_check_interval=0,
        )
    hosts = url.hosts()
    return RedisCluster(
        startup_nodes=[ClusterNode(str(h["host"]), h["port"] or 6379) for h in hosts],
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        retry=AsyncRetry(ExponentialBackoff(cap=0.1, base=0.01), CLUSTER_ATTEMPTS),
        # A group whose slots no node serves fails alone; the others go on.
        require_full_coverage=False,
        max_connections=CLUSTER_CALLS_PER_GROUP * groups,
        **_cluster_access(url),
    )


def node_client_for(url: MultiHostUrl, host: str, port: int, timeout_s: float) -> aioredis.Redis:
    """A plain client of one node of the cluster member at `url`, with the member's
    credentials and TLS: pipelines the calls of the key groups that node serves.

    No socket timeout: every round trip on it is bounded as a whole by `[redis]
    timeout` (gateway/quorum.py, `_timed`), and redis-py's own bound on each
    reply of a pipeline cost 14% of a cluster claim's CPU (a timer per reply)."""
    return aioredis.Redis(
        host=host,
        port=port,
        socket_timeout=None,
        socket_connect_timeout=timeout_s,
        retry=AsyncRetry(NoBackoff(), 0),
        health_check_interval=0,
        **_cluster_access(url),
    )


def _cluster_access(url: MultiHostUrl) -> dict[str, Any]:
    """A cluster URL's credentials (the first seed's, for every node) and TLS options."""
    first = url.hosts()[0]
    options: dict[str, Any] = {
        key: value for key, value in parse_qsl(url.query or "") if key in _CLUSTER_QUERY
    }
    if "ssl_check_hostname" in options:
        options["ssl_check_hostname"] = options["ssl_check_hostname"].lower() in ("1", "true")
    return {
        "username": first["username"],
        "password": first["password"],
        "ssl": url.scheme == "rediss+cluster",
        **options,
    }


@dataclass(frozen=True)
class Group:
    """One hash-tag group of a member's keys (the whole member when standalone)."""

    prefix: bytes  # every key of the group starts with it
    layout: tuple[Any, ...]  # the mark scripts' first arguments (gateway/scripts.py)

    @property
    def meta(self) -> bytes:
        """The slice meta: KEYS[1] of every mark script, which routes the call."""
        return self.prefix + b"slice"

    @property
    def epoch_key(self) -> bytes:
        return self.prefix + b"epoch"


def groups_for(prefix: bytes, layout_tail: tuple[Any, ...], count: int) -> list[Group]:
    """A member's groups: one under the plain prefix when `count` is 1, else one hash
    tag each."""
    if count == 1:
        return [Group(prefix, (prefix, *layout_tail))]
    tagged = [prefix + b"{%d.%d}" % (k, count) for k in range(count)]
    return [Group(p, (p, *layout_tail)) for p in tagged]


def group_of(digest: bytes, count: int) -> int:
    """The group a digest's keys live in. Bytes 4-6: the bucket uses bytes 1-3, and
    sharing them would leave most buckets of a group empty."""
    return int.from_bytes(digest[4:7], "big") % count


def split(digests: Sequence[bytes], count: int) -> list[tuple[int, list[int]]]:
    """(group, positions in `digests`) for every group that has any, positions in order."""
    by: dict[int, list[int]] = {}
    for n, digest in enumerate(digests):
        by.setdefault(int.from_bytes(digest[4:7], "big") % count, []).append(n)
    return sorted(by.items())
