"""N=3 with Redis instances stopped, hung, restarted empty: the vote's promises
(an instance that restarted empty is recovering: tests/integration/test_epochs.py)."""

from __future__ import annotations

from datetime import timedelta

from devtools.harness import (
    clean_ids,
    counter_value,
    eventually,
    running,
)
from devtools.topics import wait_committed
from devtools.traffic import produce_traffic
from gateway.config import Settings
from gateway.contract.tokens import mark_digest
from gateway.metrics import Metrics
from gateway.quorum.quorum import Quorum
from tests.integration.redis_marks import owners_on


async def _assert_exactly_once(broker, topics, expected_ids):
    ids = await clean_ids(broker, topics.clean)
    assert set(ids) == expected_ids
    assert max(ids.values()) == 1


def _ends(*traffics):
    ends: dict[int, int] = {}
    for t in traffics:
        for p, n in t.per_partition.items():
            ends[p] = ends.get(p, 0) + n
    return ends


async def test_one_instance_stopped_loses_nothing_and_duplicates_nothing(broker, stack):
    s = await stack()
    topics, servers = s.topics, s.servers
    servers[2].stop()
    traffic = await produce_traffic(broker, topics.raw, 3000, duplicate_share=0.3)
    async with running(s.settings) as gateway:
        await wait_committed(broker, topics.group, topics.raw, traffic.per_partition)
        assert counter_value(gateway.metrics.redis_errors, servers[2].name_label, "connection") > 0
    await _assert_exactly_once(broker, topics, traffic.unique_ids)


async def test_one_instance_hung_times_out_and_the_majority_decides(broker, stack):
    s = await stack()
    topics, servers = s.topics, s.servers
    servers[0].pause()  # SIGSTOP: holds the socket, answers nothing
    traffic = await produce_traffic(broker, topics.raw, 2000, duplicate_share=0.3)
    async with running(s.settings) as gateway:
        await wait_committed(broker, topics.group, topics.raw, traffic.per_partition)
        assert counter_value(gateway.metrics.redis_errors, servers[0].name_label, "timeout") > 0
    servers[0].resume()
    await _assert_exactly_once(broker, topics, traffic.unique_ids)


async def test_instance_restarted_empty_is_recovering_not_counted_and_duplicates_still_drop(
    broker, stack
):
    s = await stack()
    topics, servers, settings = s.topics, s.servers, s.settings
    settings.redis.ping_interval = timedelta(milliseconds=200)
    first = await produce_traffic(broker, topics.raw, 2000, duplicate_share=0.2, seed=1)
    async with running(settings) as gateway:
        await wait_committed(broker, topics.group, topics.raw, first.per_partition)
        servers[1].stop()
        servers[1].start()  # same port, no data: it lost every mark
        recovering = gateway.metrics.redis_recovering.labels(servers[1].name_label)._value
        await eventually(lambda: recovering.get() == 1, what="recovering")
        assert gateway.readiness()[0]  # two trusted instances of three still decide
        # Copies of the first phase's ids arrive again, plus new ids.
        again = await produce_traffic(broker, topics.raw, 2000, duplicate_share=0.0, seed=1)
        await wait_committed(broker, topics.group, topics.raw, _ends(first, again))
        assert recovering.get() == 1  # until rebuilt, or 2 x ttl has passed
        # What it is given meanwhile is right: the ids seen again carry the winners'
        # marks there too (repaired, or filled where it gave no answer).
        backlog = gateway.metrics.repair_backlog.labels(servers[1].name_label)._value
        await eventually(lambda: backlog.get() == 0, what="fills sent")
        seen_again = sorted(mark_digest(i.encode()) for i in first.unique_ids & again.unique_ids)
        assert await owners_on(servers[1], seen_again) == await owners_on(servers[0], seen_again)
    await _assert_exactly_once(broker, topics, first.unique_ids | again.unique_ids)


async def test_majority_down_stops_progress_then_resumes_without_loss_or_duplicates(broker, stack):
    s = await stack(aof=True)  # marks survive a restart, as in production
    topics, servers = s.topics, s.servers
    first = await produce_traffic(broker, topics.raw, 1000, duplicate_share=0.2, seed=3)
    async with running(s.settings) as gateway:
        await wait_committed(broker, topics.group, topics.raw, first.per_partition)
        forwarded_before = counter_value(gateway.metrics.forwarded)
        servers[0].stop()
        servers[1].stop()
        second = await produce_traffic(
            broker, topics.raw, 1000, duplicate_share=0.3, seed=3, id_prefix="m"
        )
        await eventually(lambda: gateway.metrics.partitions_blocked._value.get() >= 1)
        ready, why = gateway.readiness()
        assert not ready and ("majority" in why or "blocked" in why)
        assert counter_value(gateway.metrics.forwarded) == forwarded_before
        servers[0].start()
        servers[1].start()
        await wait_committed(broker, topics.group, topics.raw, _ends(first, second))
        assert gateway.readiness()[0]
    await _assert_exactly_once(broker, topics, first.unique_ids | second.unique_ids)


async def _pause_members(settings: Settings, members: list[int], paused: bool) -> None:
    """`dedup-gateway member pause` / `resume`, as the operator's command does it."""
    quorum = Quorum(settings.redis, Metrics())
    try:
        await quorum.refresh_epochs()
        for n in members:
            assert await quorum.admin.pause(quorum.members[n], paused)
    finally:
        await quorum.close()


async def test_a_batch_claimed_ahead_of_a_block_leaves_the_blocked_partition_to_be_read_again(
    broker, stack
):
    """The next batch's claims are sent while a batch's vote is awaited: when that
    vote blocks a partition, the next batch's records of it (past the block) must be
    neither forwarded nor committed, nor move the partition past the block."""
    s = await stack(raw_partitions=1, kafka={"max_batch_records": 50})
    topics, settings = s.topics, s.settings
    settings.redis.ping_interval = timedelta(milliseconds=200)
    # All in the partition before the gateway reads: its first fetch brings more
    # than one batch, so the second is claimed while the first is voted on.
    traffic = await produce_traffic(broker, topics.raw, 600, duplicate_share=0.2, seed=7)
    await _pause_members(settings, [0, 1], paused=True)  # no majority counted: blocks
    async with running(settings) as gateway:
        await eventually(lambda: counter_value(gateway.metrics.records_reread, "block") > 0,
                         what="a batch's records left to be read again")  # fmt: skip
        assert counter_value(gateway.metrics.forwarded) == 0
        await _pause_members(settings, [0, 1], paused=False)
        await wait_committed(broker, topics.group, topics.raw, traffic.per_partition)
    await _assert_exactly_once(broker, topics, traffic.unique_ids)
