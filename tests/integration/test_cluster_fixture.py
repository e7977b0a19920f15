"""The cluster fixtures (devtools/localstack.py `redis_cluster`) against the real
servers, Redis Cluster 7.0 and Valkey 9: what a cluster member may rely on (keys
across slots, scripts confined to their node) and that a reshard under a running
client loses nothing."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Callable

import pytest
import redis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.crc import key_slot as _key_slot
from redis.exceptions import ResponseError

from devtools.localstack import RedisClusterProcesses
from tests.conftest import ClusterFactory

# Sets KEYS[1] and the undeclared ARGV[2] to ARGV[1]; returns what ARGV[2] holds.
TOUCH_UNDECLARED = """
redis.call('SET', KEYS[1], ARGV[1])
redis.call('SET', ARGV[2], ARGV[1])
return redis.call('GET', ARGV[2])
"""


@pytest.fixture(params=["redis-server", "valkey-server"])
def cluster(
    request: pytest.FixtureRequest, redis_clusters: ClusterFactory
) -> RedisClusterProcesses:
    binary: str = request.param
    return redis_clusters(3, binary)


@pytest.fixture
async def client(cluster: RedisClusterProcesses) -> AsyncIterator[RedisCluster]:
    # Room for the tests' 300 calls side by side (redis-py's default is 100 per node,
    # past which it refuses calls), and the slot map read before them: a cold
    # client's first calls race its own refresh (redis-py can hand one a connection
    # the refresh just closed: 'NoneType' object has no attribute 'writelines').
    client = RedisCluster(
        startup_nodes=[ClusterNode("127.0.0.1", port) for port in cluster.ports],
        max_connections=1000,
    )
    await client.initialize()
    yield client
    await client.aclose()


def key_slot(key: str | bytes) -> int:
    return _key_slot(key.encode() if isinstance(key, str) else key)


def key_where(accept: Callable[[str], bool], prefix: str = "k") -> str:
    """The first key `prefix-N` that `accept` takes (slots are pseudo-random per key)."""
    return next(k for k in (f"{prefix}-{i}" for i in itertools.count()) if accept(k))


def slot_count(port: int, slot: int) -> int:
    with redis.Redis("127.0.0.1", port) as node:
        return int(node.execute_command("CLUSTER", "COUNTKEYSINSLOT", slot))


async def test_keys_in_many_slots_round_trip_and_live_on_their_owner(
    cluster: RedisClusterProcesses, client: RedisCluster
) -> None:
    keys = [f"key-{i}".encode() for i in range(300)]
    view = cluster.view()
    assert {view.owners[key_slot(k)] for k in keys} == set(cluster.ports)
    assert len({key_slot(k) for k in keys}) > 290
    await asyncio.gather(*(client.set(k, k[::-1]) for k in keys))
    assert await client.mget_nonatomic(keys) == [k[::-1] for k in keys]
    for port in cluster.ports:  # each node holds exactly the keys of its slots
        with redis.Redis("127.0.0.1", port) as node:
            assert node.dbsize() == sum(view.owners[key_slot(k)] == port for k in keys)
    assert cluster.slot_owner_port(keys[0]) == view.owners[key_slot(keys[0])]
    assert cluster.url == "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in cluster.ports)


async def test_a_script_touches_undeclared_keys_of_its_slot_but_not_of_another_node(
    cluster: RedisClusterProcesses, client: RedisCluster
) -> None:
    sha = await client.script_load(TOUCH_UNDECLARED)
    assert await client.evalsha(sha, 1, "{g}x", "v1", "{g}y") == b"v1"
    assert await client.get("{g}y") == b"v1"

    home, owners = cluster.slot_owner_port("{g}x"), cluster.view().owners
    elsewhere = key_where(lambda k: owners[key_slot(k)] != home)
    with pytest.raises(ResponseError, match="non local key"):
        await client.evalsha(sha, 1, "{g}x", "v2", elsewhere)
    assert await client.get(elsewhere) is None
    # Declared keys in two slots: CROSSSLOT before the script runs (on the node: the
    # cluster client refuses them itself).
    with (
        redis.Redis("127.0.0.1", home) as node,
        pytest.raises(ResponseError, match="don't hash to the same slot"),
    ):
        node.evalsha(sha, 2, "{g}x", elsewhere, "v3", "{g}y")


async def test_an_undeclared_key_in_another_slot_works_until_a_reshard_splits_the_two(
    cluster: RedisClusterProcesses, client: RedisCluster
) -> None:
    """Neither server checks an undeclared key's slot, only that its node holds it:
    a script leaning on that passes every test until the slots land apart."""
    sha = await client.script_load(TOUCH_UNDECLARED)
    home = cluster.slot_owner_port("{g}x")
    view = cluster.view()
    neighbour = key_where(
        lambda k: key_slot(k) != key_slot("{g}x") and view.owners[key_slot(k)] == home
    )
    assert await client.evalsha(sha, 1, "{g}x", "v1", neighbour) == b"v1"

    away = next(port for port in cluster.ports if port != home)
    assert cluster.reshard([key_slot(neighbour)], home, away) == [key_slot(neighbour)]
    with pytest.raises(ResponseError, match="non local key"):
        await client.evalsha(sha, 1, "{g}x", "v2", neighbour)
    assert await client.get(neighbour) == b"v1"


async def test_moving_a_keys_slot_under_a_running_client_loses_nothing(
    cluster: RedisClusterProcesses, client: RedisCluster
) -> None:
    key, slot = "{moving}key", key_slot("{moving}key")
    await client.set(key, "before")
    # Enough keys in the slot that MIGRATE takes several batches while the writer runs.
    await client.mset_nonatomic({f"{{moving}}{i}": i for i in range(1000)})
    source = cluster.slot_owner_port(key)
    target = next(port for port in cluster.ports if port != source)
    stop = asyncio.Event()

    async def write_and_read() -> int:
        n = 0
        while not stop.is_set():
            await client.set(f"{{moving}}w{n}", n)
            assert await client.get(f"{{moving}}w{n}") == str(n).encode()
            n += 1
        return n

    writer = asyncio.create_task(write_and_read())
    try:
        moved = await asyncio.to_thread(cluster.move_slots_of, [key], target)
    finally:
        stop.set()
        written = await writer
    assert moved == [slot]
    assert cluster.slot_owner_port(key) == target
    assert await client.get(key) == b"before"
    assert written > 0
    assert await client.mget_nonatomic([f"{{moving}}w{n}" for n in range(written)]) == [
        str(n).encode() for n in range(written)
    ]
    assert (slot_count(source, slot), slot_count(target, slot)) == (0, 1001 + written)


async def test_redis_cli_reshard_by_count_moves_the_sources_lowest_slots(
    cluster: RedisClusterProcesses, client: RedisCluster
) -> None:
    source, target = cluster.ports[1], cluster.ports[0]
    first = cluster.view().slots_of(source)[0]
    key = key_where(lambda k: key_slot(k) == first)
    await client.set(key, "kept")
    moved = cluster.reshard(5, source, target)
    assert moved == list(range(first, first + 5))
    assert all(cluster.view().owners[s] == target for s in moved)
    assert cluster.slot_owner_port(key) == target
    assert await client.get(key) == b"kept"


async def test_a_killed_node_restarts_empty_with_its_slots_while_the_others_serve(
    cluster: RedisClusterProcesses, client: RedisCluster
) -> None:
    victim, before = cluster.ports[0], cluster.view()
    lost = key_where(lambda k: before.owners[key_slot(k)] == victim)
    kept = key_where(lambda k: before.owners[key_slot(k)] != victim)
    await client.set(lost, "x")
    await client.set(kept, "y")
    cluster.node(victim).kill()
    assert await client.get(kept) == b"y"
    cluster.node(victim).start()
    assert cluster.wait_agreed().owners == before.owners
    assert await client.get(lost) is None
    assert await client.get(kept) == b"y"
