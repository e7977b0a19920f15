"""Marks written on a bare majority do not stay that way: an instance that gave
no answer gets the winner's mark later (gateway/quorum/quorum.py "Fill backlog",
scripts.FILL), from a bounded queue."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

from devtools.harness import Topics, clean_ids, counter_value, eventually, make_settings, running
from devtools.topics import wait_committed
from devtools.traffic import produce_traffic
from gateway.config import load_settings
from gateway.contract.tokens import mark_digest
from gateway.metrics import Metrics
from gateway.quorum.quorum import Quorum
from tests.conftest import redis_urls
from tests.integration.redis_marks import alone, owners_on


async def test_marks_a_hung_instance_missed_are_completed_when_it_resumes_and_outlive_another_loss(
    broker: str, redis_servers: Any, names: Callable[[str], str]
) -> None:
    topics = Topics(names)
    await topics.create(broker)
    servers = redis_servers(3)
    settings = make_settings(broker, topics, redis_urls(servers))
    settings.redis.ping_interval = timedelta(milliseconds=200)
    first = await produce_traffic(broker, topics.raw, 1500, duplicate_share=0.3, seed=5)
    digests = [mark_digest(i.encode()) for i in sorted(first.unique_ids)]
    async with running(settings) as gateway:
        m, hung = gateway.metrics, servers[0].name_label
        backlog = m.repair_backlog.labels(hung)._value
        await eventually(lambda: all(gateway.quorum.counted()), what="all three trusted")
        servers[0].pause()  # SIGSTOP: every claim to it times out
        await wait_committed(broker, topics.group, topics.raw, first.per_partition)
        assert backlog.get() > 0  # decided by the other two: marks on a bare majority
        servers[0].resume()
        await eventually(lambda: backlog.get() == 0, what="backlog sent")
        # The claims it timed out on may have run late, on resume: every mark is the winner's.
        assert await owners_on(servers[0], digests) == await owners_on(servers[1], digests)

        servers[1].stop()  # now lose another one: the completed marks still decide
        duplicates = counter_value(m.duplicates)
        again = await produce_traffic(broker, topics.raw, 1500, duplicate_share=0.3, seed=5)
        ends = {p: first.per_partition[p] + n for p, n in again.per_partition.items()}
        await wait_committed(broker, topics.group, topics.raw, ends, timeout_s=60)
        assert counter_value(m.duplicates) - duplicates == again.produced
        assert counter_value(m.undecided, "block") == 0
    ids = await clean_ids(broker, topics.clean)
    assert set(ids) == first.unique_ids and max(ids.values()) == 1


async def test_fill_writes_the_winner_where_absent_or_where_the_unanswered_claim_ran_late(
    redis_servers: Any,
) -> None:
    (server,) = redis_servers(1)
    absent, late, other = (mark_digest(f"f-{n}".encode()) for n in range(3))
    async with alone(server) as quorum:
        # A claim the gateway got no answer for ran anyway (late); another owner holds `other`.
        await quorum.claim([late, other], ["22", "33"])
        quorum.queue_fills([[(absent, "11", "11"), (late, "11", "22"), (other, "11", "44")]])
        assert quorum.metrics.repair_backlog.labels(server.name_label)._value.get() == 3
        await quorum.check()
        assert quorum.metrics.repair_backlog.labels(server.name_label)._value.get() == 0
    assert await owners_on(server, [absent, late, other]) == ["11", "11", "33"]


async def test_queued_fills_go_out_with_the_next_claim_before_its_marks(
    redis_servers: Any,
) -> None:
    (server,) = redis_servers(1)
    missed, fresh = mark_digest(b"missed"), mark_digest(b"fresh")
    async with alone(server) as quorum:
        await quorum.check()
        quorum.queue_fills([[(missed, "11", "11")]])
        # A copy of the missed id in the next batch already sees the winner's mark.
        assert await quorum.claim([missed, fresh], ["99", "12"]) == [["11", 1]]
        assert quorum.metrics.repair_backlog.labels(server.name_label)._value.get() == 0


async def test_the_backlog_is_bounded_dropping_the_oldest_and_counting_them() -> None:
    settings = load_settings(redis={"nodes": ["redis://127.0.0.1:1/0"], "repair_backlog": 10})
    quorum = Quorum(settings.redis, Metrics())
    try:
        fills = [(mark_digest(f"b-{n}".encode()), "1", "1") for n in range(25)]
        quorum.queue_fills([fills[:20]])
        quorum.queue_fills([fills[20:]])
        (inst,) = quorum.members
        assert list(inst.backlog) == fills[15:]  # the newest ten
        assert quorum.metrics.repair_backlog.labels(inst.name)._value.get() == 10
        assert counter_value(quorum.metrics.repairs_dropped, inst.name) == 15
    finally:
        await quorum.close()


async def test_a_repair_that_gets_no_answer_is_queued_and_done_when_the_instance_resumes(
    redis_servers: Any,
) -> None:
    (server,) = redis_servers(1)
    split = mark_digest(b"split")
    async with alone(server) as quorum:
        await quorum.check()
        await quorum.claim([split], ["22"])  # the minority's mark of a decided split
        server.pause()  # SIGSTOP: the repair times out
        try:
            assert await quorum.repair([[(split, "22", "11")]]) == 0
        finally:
            server.resume()
        # Queued as a fill: the winner, where the mark still holds what the vote saw.
        assert quorum.metrics.repair_backlog.labels(server.name_label)._value.get() == 1
        await quorum.check()  # the background ping sends the queue
        assert quorum.metrics.repair_backlog.labels(server.name_label)._value.get() == 0
    assert await owners_on(server, [split]) == ["11"]


async def test_another_gateway_counts_a_member_again_once_the_run_that_noted_it_drained(
    redis_servers: Any,
) -> None:
    servers = redis_servers(3)
    settings = load_settings(redis={"nodes": redis_urls(servers), "timeout": "300ms"})
    noting, other = Quorum(settings.redis, Metrics()), Quorum(settings.redis, Metrics())
    mark = mark_digest(b"noted")
    try:
        await noting.check()
        servers[2].pause()  # SIGSTOP: no answer to the claim
        replies = await noting.claim([mark], ["11"])
        assert replies[2] == [None]
        noting.queue_fills([[], [], [(mark, "11", "11")]])
        await other.refresh_epochs()
        assert other.counted() == [True, True, False]  # noted behind by the other run
        assert noting.counted()[:2] == [True, True]
        servers[2].resume()
        await noting.drain_at_stop(bound_s=10)
        assert noting.metrics.repair_backlog.labels(servers[2].name_label)._value.get() == 0
        await other.refresh_epochs()
        assert other.counted() == [True, True, True]  # the note was cleared
        assert await owners_on(servers[2], [mark]) == ["11"]
        assert counter_value(noting.metrics.repairs_lost_at_stop, servers[2].name_label) == 0
    finally:
        servers[2].resume()
        await noting.close()
        await other.close()
