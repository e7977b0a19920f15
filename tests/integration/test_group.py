"""Two gateway instances in one consumer group, with rebalances mid-stream."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from collections.abc import Callable
from typing import Any

from devtools.harness import (
    clean_ids,
    counter_value,
    eventually,
    running,
)  # fmt: skip
from devtools.topics import wait_committed
from devtools.traffic import produce_traffic
from gateway.raw.source import RawSource
from tests.integration.conftest import StackFactory


async def test_two_gateways_with_rebalances_forward_each_id_exactly_once(broker, stack):
    # Small batches keep the first gateway busy while the second one joins.
    s = await stack(raw_partitions=6, kafka={"max_batch_records": 50})
    topics, settings = s.topics, s.settings
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


async def test_a_batch_fetched_before_a_rebalance_is_read_again_not_forwarded_stale(broker, stack):
    """The window between a fetch and the batch lock: a revoke that runs there
    drains what is in hand and lets the partitions move, so the batch fetched
    just before it is stale (positions restart from the commits). It must be
    left to be read again, not forwarded: forwarded, it repeats on the reread."""

    def hold_a_fetched_batch(source: RawSource, revoked: asyncio.Event) -> asyncio.Event:
        holding, fetch = asyncio.Event(), source.loop.fetch

        async def fetch_then_hold(*args: Any, **kwargs: Any) -> Any:
            batch = await fetch(*args, **kwargs)
            if batch and not holding.is_set():
                holding.set()
                await revoked.wait()
            return batch

        source.loop.fetch = fetch_then_hold  # type: ignore[method-assign]
        return holding

    reread = await _rebalance_while_held(broker, stack, hold_a_fetched_batch)
    assert reread > 0  # the held batch was the one left to be read again


async def test_a_fetch_that_waits_out_a_rebalance_keeps_the_new_assignments_records(broker, stack):
    """The other side of that check: a fetch that began before the revoke and
    returns after it brings records of the new assignment. Dropped as stale,
    they would be lost (the position is past them and later commits too)."""

    def fetch_after_the_revoke(source: RawSource, revoked: asyncio.Event) -> asyncio.Event:
        entered, consumer = asyncio.Event(), source.consumer
        getmany = consumer.getmany

        async def getmany_across_the_revoke(*args: Any, **kwargs: Any) -> Any:
            if entered.is_set():
                return await getmany(*args, **kwargs)
            entered.set()
            await revoked.wait()
            batch: Any = {}
            while not batch:  # as a waiting getmany does, until records come
                batch = await getmany(*args, **{**kwargs, "timeout_ms": 1000})
            return batch

        consumer.getmany = getmany_across_the_revoke  # type: ignore[method-assign]
        return entered

    reread = await _rebalance_while_held(broker, stack, fetch_after_the_revoke)
    assert reread == 0  # its records were the new assignment's: kept


async def _rebalance_while_held(
    broker: str, stack: StackFactory, hold: Callable[[RawSource, asyncio.Event], asyncio.Event]
) -> float:
    """Gateway one's fetch is held by `hold` (it returns an event set once held)
    while a second gateway joins and one's revoke runs; every id arrives once.
    Records are produced after it is armed, so the held fetch, and the fetch after
    the revoke, have records to bring whatever one read before. Returns the
    records one left to be read again after the rebalance (`records_reread`)."""
    s = await stack(raw_partitions=6, kafka={"max_batch_records": 50})
    topics, settings = s.topics, s.settings
    first = await produce_traffic(broker, topics.raw, 6000, duplicate_share=0.3, seed=21)
    async with running(settings) as one:
        await eventually(lambda: counter_value(one.metrics.forwarded) > 0)
        source = one.source
        assert source is not None
        revoked, forget = asyncio.Event(), source.forget

        def forget_and_tell(partitions: Any) -> None:  # runs in the revoke, under the lock
            forget(partitions)
            revoked.set()

        source.forget = forget_and_tell  # type: ignore[method-assign]
        held = hold(source, revoked)
        # Records produced once it is armed: there is one to hold, whatever one has read.
        second = await produce_traffic(
            broker, topics.raw, 3000, duplicate_share=0.3, seed=22, id_prefix="n"
        )
        await eventually(held.is_set, what="a fetch held")
        async with running(settings) as two:  # joins: the revoke runs while it is held
            await eventually(lambda: bool(two.partitions()), what="two assigned")
            ends = {p: n + second.per_partition[p] for p, n in first.per_partition.items()}
            await wait_committed(broker, topics.group, topics.raw, ends)
        assert revoked.is_set()
        reread = counter_value(one.metrics.records_reread, "rebalance")
    ids = await clean_ids(broker, topics.clean)
    assert set(ids) == first.unique_ids | second.unique_ids
    assert max(ids.values()) == 1
    return reread


# A plain group member with a long session: SIGSTOPped, the broker waits for it
# to rejoin (up to its session) before it answers anyone's JoinGroup.
STALLING_MEMBER = """
import asyncio, sys
from aiokafka import AIOKafkaConsumer
async def member():
    consumer = AIOKafkaConsumer(sys.argv[2], bootstrap_servers=sys.argv[1], group_id=sys.argv[3],
                                session_timeout_ms=45000, heartbeat_interval_ms=3000)
    await consumer.start()
    while not consumer.assignment():
        await consumer.getmany(timeout_ms=100)
    print("assigned", flush=True)
    while True:
        await consumer.getmany(timeout_ms=100)
asyncio.run(member())
"""


async def test_a_gateway_stops_promptly_while_the_broker_holds_its_group_join(broker, stack):
    s = await stack()
    topics, settings = s.topics, s.settings
    member = subprocess.Popen(  # noqa: ASYNC220 (started once, before the loop matters)
        [sys.executable, "-c", STALLING_MEMBER, broker, topics.raw, topics.group],
        stdout=subprocess.PIPE,
    )
    try:
        assert member.stdout is not None
        assert await asyncio.to_thread(member.stdout.readline) == b"assigned\n"
        member.send_signal(signal.SIGSTOP)
        loop = asyncio.get_running_loop()
        async with running(settings) as gateway:
            await eventually(lambda: gateway.source is not None)  # in its fetch loop
            assert gateway.partitions() == set()  # its join is held back
            stopping = loop.time()
        # Before: the fetch waited for the join, i.e. for the member's 45 s session.
        assert loop.time() - stopping < 20  # the consumers' stop is bounded (15 s, side by side)
    finally:
        member.kill()
        member.wait()
        if member.stdout is not None:
            member.stdout.close()
