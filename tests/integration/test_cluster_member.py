"""A quorum member that is a Redis Cluster (gateway/quorum/members.py), beside two
standalone members: exact dedup, the failure loop, a node restarting empty,
resharding while paused, memory per mark, on Redis 7.0 and Valkey 9 clusters."""

from __future__ import annotations

import asyncio
from collections import Counter
from datetime import timedelta
from typing import Any

import pytest
import redis.asyncio as aioredis

from devtools.harness import (
    Topics,
    clean_ids,
    counter_value,
    eventually,
    failure_command,
    make_settings,
    produce,
    redis_urls,
    running,
)
from devtools.localstack import ManagedProcess, RedisClusterProcesses
from devtools.topics import read_topic, wait_committed
from devtools.traffic import produce_traffic
from gateway.config import Settings, load_settings
from gateway.contract.tokens import mark_digest, owner_token
from gateway.metrics import Metrics, total
from gateway.ops.pause import set_paused
from gateway.ops.rebuild import rebuild
from gateway.quorum.members import group_of
from gateway.quorum.quorum import Quorum
from gateway.rules.commands import Handover
from gateway.rules.vote import MINE

# Valkey's run of each test in `make test-long` (marker second_engine): the same
# protocol and scripts, and a Redis Cluster test takes 20-90 s.
SERVERS = ["redis-server", pytest.param("valkey-server", marks=pytest.mark.second_engine)]


def cluster_quorum(cluster: RedisClusterProcesses, **redis: Any) -> Quorum:
    """A quorum of the cluster member alone: what a gateway's calls to it do.

    Its calls may take 5 s (`[redis] timeout`) unless a test sets its own: these tests
    check what the scripts answer, and a first call on a fresh cluster (connections,
    slot map, script loads) can outlast a tight timeout on a loaded machine."""
    settings = load_settings(redis={"nodes": [cluster.url], "timeout": "5s", **redis})
    return Quorum(settings.redis, Metrics())


async def owners_on(
    cluster: RedisClusterProcesses, ids: list[str], **redis: Any
) -> list[str | None]:
    quorum = cluster_quorum(cluster, **redis)
    try:
        await quorum.refresh_epochs()
        found = await quorum.admin.lookup(quorum.members[0], [mark_digest(i.encode()) for i in ids])
    finally:
        await quorum.close()
    assert found is not None, "the cluster member does not answer"
    return [owner.decode() or None for owner, _ in found]


async def keys_per_master(cluster: RedisClusterProcesses) -> list[int]:
    sizes = []
    for port in cluster.ports:
        async with aioredis.Redis(port=port) as node:
            sizes.append(await node.dbsize())
    return sizes


async def mixed_quorum(
    broker: str, redis_servers: Any, redis_clusters: Any, names: Any, server: str,
    **partitions: int,
) -> tuple[Topics, RedisClusterProcesses, list[ManagedProcess], Settings]:  # fmt: skip
    """Topics, and settings whose members are a 3-master cluster of `server` first,
    then two standalone redis-servers."""
    topics = Topics(names)
    await topics.create(broker, **partitions)
    cluster = redis_clusters(3, binary=server)
    standalone = redis_servers(2)
    settings = make_settings(broker, topics, [cluster.url, *redis_urls(standalone)])
    return topics, cluster, standalone, settings


def copies_of(ids: list[str]) -> list[tuple[bytes, bytes, list[tuple[str, bytes]]]]:
    return [(b"k", b"v", [("message-id", i.encode())]) for i in ids]


async def replay_deciding_on_the_cluster(
    broker: str, topics: Topics, standalone: list[ManagedProcess], ids: set[str],
    done: dict[int, int],
) -> list[str]:  # fmt: skip
    """Kill the first standalone member, so the cluster member's answers decide, and
    replay a copy of every id in `ids` (into partition 0: `done` is moved on); the
    ids, sorted."""
    standalone[0].kill()
    every = sorted(ids)
    replays = copies_of(every)
    await produce(broker, topics.raw, replays)
    done[0] += len(replays)
    await wait_committed(broker, topics.group, topics.raw, done)
    return every


@pytest.mark.parametrize("server", SERVERS)
async def test_each_id_forwarded_once_and_the_cluster_members_answers_count(
    broker, redis_servers, redis_clusters, names, server
):
    topics, cluster, standalone, settings = await mixed_quorum(
        broker, redis_servers, redis_clusters, names, server
    )
    first = await produce_traffic(broker, topics.raw, 4000, duplicate_share=0.3, seed=11)
    async with running(settings) as gateway:
        await wait_committed(broker, topics.group, topics.raw, first.per_partition)
        assert gateway.quorum.counted() == [True, True, True]
        # Every mark is on the cluster, spread over all three masters.
        ids = sorted(first.unique_ids)
        assert None not in await owners_on(cluster, ids)
        assert min(await keys_per_master(cluster)) > 0

        # One standalone member goes: the votes need the cluster's answers now.
        standalone[0].kill()
        again = await produce_traffic(
            broker, topics.raw, 2000, duplicate_share=0.3, seed=12, id_prefix="n"
        )
        replays = copies_of(ids[:500])
        await produce(broker, topics.raw, replays)
        done = {p: first.per_partition[p] + again.per_partition[p] for p in first.per_partition}
        done[0] += len(replays)
        await wait_committed(broker, topics.group, topics.raw, done)
        metrics = gateway.metrics
    out = await clean_ids(broker, topics.clean)
    assert set(out) == first.unique_ids | again.unique_ids
    assert max(out.values()) == 1
    assert counter_value(metrics.duplicates) == first.duplicates + again.duplicates + len(replays)


@pytest.mark.parametrize("server", SERVERS)
async def test_the_failure_loop_hands_a_mark_over_on_the_cluster_member(
    broker, redis_servers, redis_clusters, names, server
):
    topics, _, _, settings = await mixed_quorum(
        broker, redis_servers, redis_clusters, names, server, raw_partitions=1,
        clean_partitions=1,
    )  # fmt: skip
    settings.failures.mode = "retry"
    settings.failures.backoff_initial = timedelta(milliseconds=10)
    settings.failures.backoff_max = timedelta(milliseconds=50)
    message = (b"k", b"v", [("message-id", b"c-1")])
    async with running(settings) as gateway:
        await produce(broker, topics.raw, [message])
        (first,) = await read_topic(broker, topics.clean, min_records=1)
        await produce(broker, topics.failures, [failure_command(first, "api down")])
        records = await read_topic(broker, topics.clean, min_records=2)
        assert [dict(r.headers)["dedup-attempt"] for r in records[1:]] == [b"2"]
        await produce(broker, topics.raw, [message])  # a resend: still a duplicate
        await wait_committed(broker, topics.group, topics.raw, {0: 2})
        assert counter_value(gateway.metrics.duplicates) == 1
        views = await gateway.quorum.admin.inspect(mark_digest(b"c-1"))
    retried = owner_token(topics.raw, 0, 0, attempt=2)
    assert [v.owner if v else None for v in views] == [retried] * 3
    assert views[0] is not None and views[0].handed_over_by is not None
    assert views[0].handed_over_by.endswith("!done")


@pytest.mark.parametrize("server", SERVERS)
async def test_a_cluster_node_restarting_empty_makes_the_member_recovering_until_rebuilt(
    broker, redis_servers, redis_clusters, names, server
):
    topics, cluster, _, settings = await mixed_quorum(
        broker, redis_servers, redis_clusters, names, server
    )
    settings.redis.ping_interval = timedelta(milliseconds=200)
    first = await produce_traffic(broker, topics.raw, 3000, duplicate_share=0.3, seed=21)
    async with running(settings) as gateway:
        await wait_committed(broker, topics.group, topics.raw, first.per_partition)
        # One master of the member dies: the records of its key groups get no answer
        # from the member (the standalone members decide them); the others do.
        node = cluster.nodes[1]
        node.kill()
        during = await produce_traffic(
            broker, topics.raw, 1000, duplicate_share=0.3, seed=22, id_prefix="d"
        )
        done = {p: first.per_partition[p] + during.per_partition[p] for p in first.per_partition}
        await wait_committed(broker, topics.group, topics.raw, done)
        down = gateway.metrics.redis_groups_down.labels(cluster.name_label)._value.get()
        assert 0 < down < settings.redis.cluster_groups
        assert gateway.quorum.members[0].up
        node.start()  # no persistence: it comes back empty, owning the same slots
        cluster.wait_agreed()
        await eventually(lambda: gateway.quorum.counted() == [False, True, True],
                         what="the cluster member is recovering")  # fmt: skip
        recovering = gateway.metrics.redis_recovering.labels(cluster.name_label)
        assert recovering._value.get() == 1
        # Copies of old ids still come out once: the two standalone members decide.
        every = sorted(first.unique_ids | during.unique_ids)
        replays = copies_of(every)
        await produce(broker, topics.raw, replays)
        done[0] += len(replays)
        await wait_committed(broker, topics.group, topics.raw, done)

        assert await rebuild(gateway.settings, cluster.name_label, source=None,
                             dry_run=False, output="json") == 0  # fmt: skip
        await eventually(lambda: gateway.quorum.counted() == [True, True, True],
                         what="the rebuilt member is trusted")  # fmt: skip
    assert None not in await owners_on(cluster, every)
    out = await clean_ids(broker, topics.clean)
    assert set(out) == set(every) and max(out.values()) == 1


@pytest.mark.parametrize("server", SERVERS)
async def test_resharding_a_paused_cluster_member_while_records_flow_loses_and_repeats_nothing(
    broker, redis_servers, redis_clusters, names, server
):
    topics, cluster, standalone, settings = await mixed_quorum(
        broker, redis_servers, redis_clusters, names, server
    )
    settings.redis.cluster_groups = 16
    member = cluster.name_label
    first = await produce_traffic(broker, topics.raw, 3000, duplicate_share=0.3, seed=31)
    async with running(settings) as gateway:
        await wait_committed(broker, topics.group, topics.raw, first.per_partition)
        assert await set_paused(settings, member, True) == 0
        await eventually(lambda: gateway.quorum.counted() == [False, True, True],
                         what="the gateway sees the pause")  # fmt: skip
        # Records keep flowing while the slots move: the two standalone members decide.
        during = asyncio.create_task(produce_traffic(
            broker, topics.raw, 3000, duplicate_share=0.3, seed=32, id_prefix="d"
        ))  # fmt: skip
        source, target = cluster.ports[0], cluster.ports[1]
        group_keys = [f"dd:{{{k}.16}}slice".encode() for k in range(16)]
        moving = [key for key in group_keys if cluster.slot_owner_port(key) == source]
        assert moving, "no key group on the first master"
        moved = await asyncio.to_thread(cluster.move_slots_of, moving, target)
        second = await during
        assert await set_paused(settings, member, False) == 0
        done = {p: first.per_partition[p] + second.per_partition[p] for p in first.per_partition}
        await wait_committed(broker, topics.group, topics.raw, done)
        await eventually(lambda: gateway.quorum.counted() == [True, True, True]
                         and not gateway.quorum.members[0].backlog,
                         what="resumed, and the marks it missed filled in")  # fmt: skip

        # With one standalone member gone, the cluster's answers decide: the marks
        # in the moved groups and those it missed while paused are all there.
        every = await replay_deciding_on_the_cluster(
            broker, topics, standalone, first.unique_ids | second.unique_ids, done
        )
    assert moved and all(cluster.slot_owner_port(key) == target for key in moving)
    assert None not in await owners_on(cluster, every, cluster_groups=16)
    out = await clean_ids(broker, topics.clean)
    assert set(out) == first.unique_ids | second.unique_ids
    assert max(out.values()) == 1


@pytest.mark.parametrize("server", SERVERS)
async def test_a_mark_on_a_cluster_member_costs_what_it_does_on_one_instance(
    redis_clusters, server
):
    cluster = redis_clusters(3, binary=server)
    owner = owner_token("raw", 0, 1)
    warm = [mark_digest(f"warm-{n}".encode()) for n in range(2000)]
    ids = [mark_digest(f"mem-{n}".encode()) for n in range(20_000)]
    await claim_all(cluster, warm, owner)
    before = await used_memory(cluster)
    await claim_all(cluster, ids, owner)
    grown = await used_memory(cluster) - before
    assert len(Counter(group_of(d, 8) for d in ids)) == 8
    per_mark = grown / len(ids)
    # At least the 12-byte digest; at most what one instance costs (test_marks.py).
    assert 12 < per_mark < 45, f"{per_mark:.1f} bytes per mark"


async def claim_all(cluster: RedisClusterProcesses, digests: list[bytes], owner: str) -> None:
    """Claim every digest, checking each is new; 8 groups x 8 buckets hold ~300 marks
    per bucket, as the standalone measurement. The quorum is closed after, so its
    connections' buffers are not counted as marks."""
    quorum = cluster_quorum(cluster, buckets=64, cluster_groups=8)
    try:
        for start in range(0, len(digests), 2000):
            batch = digests[start : start + 2000]
            assert await quorum.claim(batch, [owner] * len(batch)) == [[MINE] * len(batch)]
    finally:
        await quorum.close()


async def used_memory(cluster: RedisClusterProcesses) -> int:
    """`used_memory` summed over the masters, once only this call's client is connected."""
    total = 0
    for port in cluster.ports:
        async with aioredis.Redis(port=port) as node:
            await eventually_async(
                lambda n=node: _only_client(n), what=f"the quorum's connections to :{port} closed"
            )
            total += (await node.info("memory"))["used_memory"]
    return total


async def _only_client(node: aioredis.Redis) -> bool:
    return int((await node.info("clients"))["connected_clients"]) == 1


async def eventually_async(condition: Any, timeout_s: float = 10, what: str = "") -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not await condition():
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def test_every_script_runs_on_a_cluster_member_within_its_groups(redis_clusters):
    """Each call's keys share one slot; a script that strayed into another slot (on
    another master) would fail here ("non local key")."""
    cluster = redis_clusters(3)
    quorum = cluster_quorum(cluster, cluster_groups=8)
    try:
        digests = [mark_digest(f"s-{n}".encode()) for n in range(600)]
        owners = [str(n + 1) for n in range(600)]
        assert await quorum.claim(digests, owners) == [[MINE] * 600]
        assert await quorum.claim(digests, ["999999"] * 600) == [owners]
        repairs = [(d, o, "7") for d, o in zip(digests[:50], owners[:50], strict=True)]
        assert await quorum.repair([repairs]) == 50
        assert await quorum.release(digests[:3], ["7", "7", "x"]) == [[1, 1, 0]]
        assert await quorum.admin.delete(digests[60]) == [1]
        assert await quorum.handover([Handover(digests[70], owners[70], "99", "failures/0/1")]) == [
            [1]
        ]
        await quorum.mark_done([digests[70]], ["failures/0/1"])
        (view,) = await quorum.admin.inspect(digests[70])
        assert view is not None and (view.owner, view.handed_over_by) == ("99", "failures/0/1!done")
        fresh = [mark_digest(f"f-{n}".encode()) for n in range(100)]
        quorum.queue_fills([[(d, "5", "4") for d in fresh]])
        await quorum.check()
        assert not quorum.members[0].backlog
        assert await quorum.claim(fresh, ["6"] * 100) == [["5"] * 100]
        windows = await quorum.windows.coalesce_update(
            digests[:4], [1000] * 4, ["1", "2", "3", "4"], "fixed", 1000, 5000
        )
        assert windows == [[(1000, True, 0)] * 4]  # (start, opened, newest before)
        assert await quorum.windows.coalesce_close(digests[:4], [1000] * 4) == [
            [(v, 1, 1000) for v in ("1", "2", "3", "4")]
        ]
        found = await quorum.admin.lookup(quorum.members[0], digests[100:103])
        assert found is not None and [o for o, _ in found] == [b"101", b"102", b"103"]
        assert not quorum.members[0].down_groups
    finally:
        await quorum.close()


async def test_calls_pipelined_to_a_master_that_no_longer_holds_their_slots_follow_them(
    redis_clusters,
):
    """Each master's calls go in one pipeline by the client's slot map; a group whose
    slot moved since is answered MOVED there and sent again through the cluster
    client, which follows it: every reply still comes, from the marks' new home."""
    cluster = redis_clusters(3)
    quorum = cluster_quorum(cluster, cluster_groups=16)
    try:
        digests = [mark_digest(f"m-{n}".encode()) for n in range(800)]
        assert await quorum.claim(digests, ["5"] * 800) == [[MINE] * 800]
        assert quorum.members[0].nodes, "the calls went by node"
        source, target = cluster.ports[0], cluster.ports[1]
        group_keys = [f"dd:{{{k}.16}}slice".encode() for k in range(16)]
        moving = [key for key in group_keys if cluster.slot_owner_port(key) == source]
        assert moving, "no key group on the first master"
        await asyncio.to_thread(cluster.move_slots_of, moving, target)
        moved = {k for k, d in enumerate(digests) if f"dd:{{{group_of(d, 16)}.16}}slice".encode()
                 in moving}  # fmt: skip
        assert moved, "no digest in a moved group"
        assert await quorum.claim(digests, ["6"] * 800) == [["5"] * 800]
        assert total(quorum.metrics.redis_errors) == 0
        assert not quorum.members[0].down_groups
    finally:
        await quorum.close()


async def test_a_hung_master_holds_back_only_its_own_groups_calls(redis_clusters):
    """Each master's calls are one pipeline, the masters side by side: a master that
    stops answering (SIGSTOP) costs its own groups' records their answer, after
    `[redis] timeout`, and nothing else; once it answers again, so do they."""
    cluster = redis_clusters(3)
    quorum = cluster_quorum(cluster, cluster_groups=16, timeout="2s")
    try:
        n = 1200
        digests = [mark_digest(f"h-{k}".encode()) for k in range(n)]
        assert await quorum.claim(digests, ["5"] * n) == [[MINE] * n]
        hung = cluster.ports[0]
        groups_there = {g for g in range(16)
                        if cluster.slot_owner_port(f"dd:{{{g}.16}}slice") == hung}  # fmt: skip
        on_hung = {k for k, d in enumerate(digests) if group_of(d, 16) in groups_there}
        assert on_hung, "no digest on the first master"
        cluster.node(hung).pause()
        try:
            (replies,) = await quorum.claim(digests, ["6"] * n)
        finally:
            cluster.node(hung).resume()
        assert {k for k, r in enumerate(replies) if r is None} == on_hung
        assert {r for k, r in enumerate(replies) if k not in on_hung} == {"5"}
        assert quorum.members[0].down_groups == groups_there
        assert await quorum.claim(digests, ["7"] * n) == [["5"] * n]
        assert not quorum.members[0].down_groups
    finally:
        await quorum.close()


async def test_a_burst_of_calls_on_a_cold_cluster_client_all_get_answers(redis_clusters):
    """A cold client's burst of calls made group by group (the epoch read and its
    copy to 256 key groups just after start: over 100 per master at once), then two
    batches claimed side by side. redis-py's cluster pool refused the calls past
    100 per node (MaxConnectionsError): groups of a healthy member missed their
    epoch copy and gave no answer. (A bound of 5 s: opening that many connections
    at once takes longer than the default on this machine.)"""
    cluster = redis_clusters(3)
    quorum = cluster_quorum(cluster, cluster_groups=256, timeout="5s")
    try:
        await quorum.refresh_epochs(patient=True)  # as the gateway starts
        batches = [[mark_digest(f"b{b}-{n}".encode()) for n in range(2000)] for b in (1, 2)]
        replies = await asyncio.gather(*(quorum.claim(d, ["5"] * 2000) for d in batches))
        assert replies == [[[MINE] * 2000]] * 2
        assert total(quorum.metrics.redis_errors) == 0
    finally:
        await quorum.close()


@pytest.mark.parametrize("server", SERVERS)
async def test_a_master_failing_over_to_its_replica_leaves_the_member_trusted_with_every_mark(
    broker, redis_servers, redis_clusters, names, server
):
    topics = Topics(names)
    await topics.create(broker)
    cluster = redis_clusters(3, binary=server, replicas=1)
    standalone = redis_servers(2)
    settings = make_settings(broker, topics, [cluster.url, *redis_urls(standalone)])
    settings.redis.ping_interval = timedelta(milliseconds=200)
    member = cluster.name_label
    first = await produce_traffic(broker, topics.raw, 3000, duplicate_share=0.3, seed=41)
    async with running(settings) as gateway:
        await wait_committed(broker, topics.group, topics.raw, first.per_partition)
        # A master dies once its replica holds all it wrote; records keep coming while
        # the replica takes over (about cluster-node-timeout, 2 s).
        dying = cluster.masters()[0]
        replica = cluster.replica_of(dying)
        cluster.wait_replicated(dying)
        moving = cluster.view().slots_of(dying)
        cluster.node(dying).kill()
        during = asyncio.create_task(produce_traffic(
            broker, topics.raw, 3000, duplicate_share=0.3, seed=42, id_prefix="d"
        ))  # fmt: skip
        await asyncio.to_thread(cluster.wait_agreed, {slot: replica for slot in moving})
        second = await during
        done = {p: first.per_partition[p] + second.per_partition[p] for p in first.per_partition}
        await wait_committed(broker, topics.group, topics.raw, done)
        # The replica has the epoch copies: the member stays trusted, and once the
        # client follows the new master every group answers again.
        await eventually(lambda: gateway.metrics.redis_groups_down.labels(member)._value.get()
                         == 0 and not gateway.quorum.members[0].backlog,
                         what="every group answers, the marks it missed filled in")  # fmt: skip
        assert total(gateway.metrics.redis_errors, redis=member) > 0  # the failover was felt
        assert gateway.quorum.counted() == [True, True, True]
        assert gateway.metrics.redis_recovering.labels(member)._value.get() == 0

        # With one standalone member gone, the cluster's answers decide: every mark
        # is on it, the failed-over groups' too.
        every = await replay_deciding_on_the_cluster(
            broker, topics, standalone, first.unique_ids | second.unique_ids, done
        )
    assert None not in await owners_on(cluster, every)
    out = await clean_ids(broker, topics.clean)
    assert set(out) == set(every) and max(out.values()) == 1
