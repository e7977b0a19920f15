"""The least-privilege Redis ACL documented in
deploy/k8s/components/example-secrets/secret.example.yaml is enough for
everything the gateway does (claim, repair, release/handover, retries) and no
more: a gateway user built from exactly that line works, and cannot flush."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis.exceptions import NoPermissionError

from devtools.harness import (
    Topics,
    counter_value,
    eventually,
    failure_command,
    make_settings,
    produce,
    running,
)
from devtools.topics import read_topic, wait_committed
from gateway.metrics import total
from tests.deployment.conftest import DEPLOY

ADMIN_PASSWORD = "admin-pw"
GATEWAY_PASSWORD = "gw-pw"


def documented_acl() -> list[str]:
    """The `ACL SETUSER ...` arguments from the Secret's comment, with our password."""
    text = (DEPLOY / "k8s/components/example-secrets/secret.example.yaml").read_text()
    match = re.search(r"ACL SETUSER (.+)", text)
    assert match, "secret.example.yaml documents no ACL SETUSER line"
    return [">" + GATEWAY_PASSWORD if t == ">PASSWORD" else t for t in match[1].split()]


async def test_the_documented_acl_lets_the_gateway_dedup_and_release_and_nothing_more(
    broker: str, redis_servers: Any, names: Callable[[str], str]
) -> None:
    topics = Topics(names)
    await topics.create(broker, raw_partitions=1, clean_partitions=1)
    servers = redis_servers(3, password=ADMIN_PASSWORD)
    acl = documented_acl()
    user = acl[0]
    for server in servers:
        async with aioredis.Redis(port=server.port, password=ADMIN_PASSWORD) as admin:
            await admin.execute_command("ACL", "SETUSER", *acl)  # type: ignore[no-untyped-call]
    urls = [f"redis://{user}:{GATEWAY_PASSWORD}@127.0.0.1:{s.port}/0" for s in servers]
    settings = make_settings(broker, topics, urls, failures={"mode": "release"})
    message = [("message-id", b"acl-1")]
    async with running(settings) as gateway:
        m = gateway.metrics
        await produce(broker, topics.raw, [(b"k", b"v", message), (b"k", b"v", message)])
        await wait_committed(broker, topics.group, topics.raw, {0: 2})
        assert (counter_value(m.forwarded), counter_value(m.duplicates)) == (1, 1)
        (clean,) = await read_topic(broker, topics.clean, min_records=1)
        await produce(broker, topics.failures, [failure_command(clean, "api down")])
        await eventually(lambda: counter_value(m.releases, "released") == 1, what="released")
        assert sum(counter_value(m.redis_errors, s.name_label, kind)
                   for s in servers for kind in ("response", "connection", "timeout", "other")
                   ) == 0  # fmt: skip

    async with aioredis.Redis(port=servers[0].port, username=user,
                              password=GATEWAY_PASSWORD) as gw:  # fmt: skip
        with pytest.raises(NoPermissionError):
            await gw.flushall()
        with pytest.raises(NoPermissionError):
            await gw.set("not-a-mark", 1)


def documented_cluster_acl() -> list[str]:
    """What docs/redis-cluster.md adds to the ACL for a Redis Cluster member's nodes."""
    text = (DEPLOY.parent / "docs/redis-cluster.md").read_text()
    match = re.search(r"what the cluster client needs:\s+`([^`]+)`", text)
    assert match, "docs/redis-cluster.md documents no ACL additions for a cluster member"
    return match[1].split()


async def test_a_cluster_member_works_behind_the_documented_acl_on_every_node(
    broker: str, redis_servers: Any, redis_clusters: Any, names: Callable[[str], str]
) -> None:
    """The member's credentials reach every connection: the cluster client's and the
    per-node pipelines' (gateway/quorum/transport.py, `_on_masters`). The default user is
    switched off, so a connection without them is refused."""
    topics = Topics(names)
    await topics.create(broker, raw_partitions=1, clean_partitions=1)
    cluster = redis_clusters(3)
    acl = [*documented_acl(), *documented_cluster_acl()]
    for port in cluster.ports:
        async with aioredis.Redis(port=port) as admin:
            await admin.execute_command("ACL", "SETUSER", *acl)  # type: ignore[no-untyped-call]
            await admin.execute_command("ACL", "SETUSER", "default", "off")  # type: ignore[no-untyped-call]
    hosts = ",".join(f"127.0.0.1:{port}" for port in cluster.ports)
    member = f"redis+cluster://{acl[0]}:{GATEWAY_PASSWORD}@{hosts}"
    standalone = redis_servers(2)
    urls = [member, *(f"redis://127.0.0.1:{s.port}/0" for s in standalone)]
    settings = make_settings(broker, topics, urls)
    ids = [f"acl-{n}".encode() for n in range(300)]
    async with running(settings) as gateway:
        m = gateway.metrics
        await produce(broker, topics.raw, [(b"k", b"v", [("message-id", i)]) for i in ids])
        await wait_committed(broker, topics.group, topics.raw, {0: len(ids)})
        # One standalone member gone: the cluster member's answers now decide.
        standalone[0].kill()
        await produce(broker, topics.raw, [(b"k", b"v", [("message-id", i)]) for i in ids])
        await wait_committed(broker, topics.group, topics.raw, {0: 2 * len(ids)})
        assert (counter_value(m.forwarded), counter_value(m.duplicates)) == (len(ids), len(ids))
        assert gateway.quorum.members[0].nodes, "no per-node pipeline was used"
        # What a missing grant or credential gives: NOPERM (a response error), WRONGPASS
        # (auth). A timeout is the loaded machine's, not the ACL's: it is counted apart.
        name = gateway.quorum.members[0].name
        for kind in ("auth", "response", "other"):
            assert total(m.redis_errors, redis=name, kind=kind) == 0, kind
