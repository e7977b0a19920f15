"""Two gateway instances in one consumer group, with rebalances mid-stream."""

from __future__ import annotations

from devtools.harness import (
    Topics,
    clean_ids,
    counter_value,
    eventually,
    make_settings,
    running,
)  # fmt: skip
from devtools.topics import wait_committed
from devtools.traffic import produce_traffic
from tests.conftest import redis_urls


async def test_two_gateways_with_rebalances_forward_each_id_exactly_once(
    broker, redis_servers, names
):
    topics = Topics(names)
    await topics.create(broker, raw_partitions=6)
    # Small batches keep the first gateway busy while the second one joins.
    settings = make_settings(broker, topics, redis_urls(redis_servers(3)),
                             kafka={"max_batch_records": 50})  # fmt: skip
    first = await produce_traffic(broker, topics.raw, 30_000, duplicate_share=0.3, seed=11)
    ends = dict(first.per_partition)
    async with running(settings) as one:
        await eventually(lambda: counter_value(one.metrics.forwarded) > 0)
        async with running(settings) as two:  # joins: a rebalance while one is mid-stream
            await eventually(lambda: bool(two.partitions()), what="two assigned")
            second = await produce_traffic(
                broker, topics.raw, 6000, duplicate_share=0.3, seed=12, id_prefix="n"
            )
            for p, n in second.per_partition.items():
                ends[p] += n
            await wait_committed(broker, topics.group, topics.raw, ends)
            assert not one.partitions() & two.partitions()
        # two leaves: another rebalance hands its partitions back to one
        third = await produce_traffic(
            broker, topics.raw, 3000, duplicate_share=0.3, seed=13, id_prefix="o"
        )
        for p, n in third.per_partition.items():
            ends[p] += n
        await wait_committed(broker, topics.group, topics.raw, ends)
    assert counter_value(two.metrics.forwarded) > 0  # the second gateway really shared the work
    ids = await clean_ids(broker, topics.clean)
    assert set(ids) == first.unique_ids | second.unique_ids | third.unique_ids
    assert max(ids.values()) == 1
