"""Marks written on a bare majority do not stay that way: an instance that gave
no answer gets the winner's mark later (gateway/quorum/repairs.py, fills.py,
scripts.FILL), from a bounded queue."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import timedelta
from typing import Any

from aiokafka import ConsumerRecord, TopicPartition

from devtools.harness import (
    Topics,
    clean_ids,
    counter_value,
    eventually,
    redis_urls,
    running,
)
from devtools.topics import read_topic, wait_committed
from devtools.traffic import produce_traffic
from gateway.config import Settings, load_settings
from gateway.contract.tokens import mark_digest, owner_tokens
from gateway.metrics import Metrics
from gateway.quorum.quorum import Quorum
from gateway.raw.pipeline import Pipeline
from gateway.rules.vote import MINE, Outcome
from tests.integration.conftest import StackFactory
from tests.integration.redis_marks import alone, noted_behind_on, owners_on


async def test_marks_a_hung_instance_missed_are_completed_when_it_resumes_and_outlive_another_loss(
    broker: str, stack: StackFactory
) -> None:
    s = await stack()
    topics, servers, settings = s.topics, s.servers, s.settings
    settings.redis.ping_interval = timedelta(milliseconds=200)
    first = await produce_traffic(broker, topics.raw, 1500, duplicate_share=0.3, seed=5)
    digests = [mark_digest(i.encode()) for i in sorted(first.unique_ids)]
    async with running(settings) as gateway:
        m, hung = gateway.metrics, servers[0].name_label
        backlog = m.repair_backlog.labels(hung)._value
        await eventually(lambda: all(gateway.quorum.counted()), what="all three trusted")
        servers[0].pause()  # SIGSTOP: every claim to it times out
        try:
            await wait_committed(broker, topics.group, topics.raw, first.per_partition)
        except TimeoutError as exc:  # two loaded full runs: every partition's head undecided
            raise AssertionError(await why_stuck(broker, topics, gateway, servers)) from exc
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


async def why_stuck(broker: str, topics: Topics, gateway: Any, servers: Any) -> str:
    """What the gateway knows of each member, and what the answering ones hold for
    each partition's first records: for a failure that has not been reproduced."""
    members = [(i.name, i.up, i.trust, i.paused, i.epoch, sorted(i.behind), len(i.backlog),
                i.sending) for i in gateway.quorum.members]  # fmt: skip
    heads = [r for r in await read_topic(broker, topics.raw) if r.offset < 2]
    digests = [mark_digest(dict(r.headers)["message-id"]) for r in heads]
    held = [await owners_on(server, digests) for server in servers[1:]]
    rows = [(r.partition, r.offset, owner_tokens(r.topic, r.partition, [r.offset])[0], *owners)
            for r, *owners in zip(heads, *held, strict=True)]  # fmt: skip
    return (
        f"members (name, up, trust, paused, epoch, noted by, backlog, sending): {members}\n"
        f"counted: {gateway.quorum.counted()}\n"
        f"heads (partition, offset, token, owner on member 1, on member 2): {rows}"
    )


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
        (member,) = quorum.members
        assert list(member.backlog) == fills[15:]  # the newest ten
        assert quorum.metrics.repair_backlog.labels(member.name)._value.get() == 10
        assert counter_value(quorum.metrics.repairs_dropped, member.name) == 15
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


@asynccontextmanager
async def two_runs(servers: Any) -> AsyncIterator[tuple[Settings, Quorum, Quorum]]:
    """Two gateway runs' quorums on `servers` (300 ms timeout): `noting` holds fills
    and notes them, `other` reads the notes; every server is resumed at the end."""
    settings = load_settings(redis={"nodes": redis_urls(servers), "timeout": "300ms"})
    noting, other = Quorum(settings.redis, Metrics()), Quorum(settings.redis, Metrics())
    try:
        yield settings, noting, other
    finally:
        for server in servers:
            server.resume()
        await noting.close()
        await other.close()


async def one_fill_noted(noting: Quorum, message_id: bytes) -> str:
    """`noting` holds one fill for member 2, noted on the others; the note's field."""
    await noting.check()
    noting.queue_fills([[], [], [(mark_digest(message_id), "11", "11")]])
    assert await noting.note_behind()
    return f"{noting.members[2].name}|{noting.behind.run_id}"


async def test_another_gateway_counts_a_member_again_once_the_run_that_noted_it_drained(
    redis_servers: Any,
) -> None:
    servers = redis_servers(3)
    async with two_runs(servers) as (_, noting, other):
        mark = mark_digest(b"noted")
        await noting.check()
        servers[2].pause()  # SIGSTOP: no answer to the claim
        replies = await noting.claim([mark], ["11"])
        assert replies[2] == [None]
        noting.queue_fills([[], [], [(mark, "11", "11")]])
        assert await noting.note_behind()
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


async def test_the_watch_running_between_a_vote_and_its_fills_leaves_the_note_standing(
    redis_servers: Any,
) -> None:
    """The quorum's watch (`check`: drain, then clear the notes of members with nothing
    left to send) ran between a vote's claims and the fills it queued: it cleared
    the note the claims had just written, the batch was committed, and a gateway
    killed then left the paused member counted without the mark (a loaded run of
    test_fills_across_restarts). Here the watch runs in that window every time."""
    servers = redis_servers(3)
    async with two_runs(servers) as (settings, noting, other):
        pipeline = Pipeline(settings, noting, None, noting.metrics)  # type: ignore[arg-type]
        claim = noting.claim

        async def claim_then_watch(digests: Any, owners: Any) -> Any:
            replies = await claim(digests, owners)
            await noting.check()
            return replies

        noting.claim = claim_then_watch  # type: ignore[method-assign]
        await noting.check()
        assert await noting.admin.pause(noting.members[2], True)  # its claims are refused
        assert await pipeline.vote([b"m-1"], ["11"]) == [Outcome.FORWARD]
        assert len(noting.members[2].backlog) == 1  # held until it is resumed
        await noting.check()  # the watch again, the fill still queued
        note = f"{noting.members[2].name}|{noting.behind.run_id}"
        for server in servers[:2]:
            assert note in await noted_behind_on(server)
        await noting.admin.pause(noting.members[2], False)
        await other.refresh_epochs()
        assert other.counted() == [True, True, False]  # noted behind by the other run


async def test_a_note_stays_while_its_fills_are_in_flight(redis_servers: Any) -> None:
    """A fill taken from the backlog and not yet answered is still this run's to
    send: a clear meanwhile (from a claim or the watch) must leave the note, or a
    stop after that send failed would leave no trace of the mark."""
    servers = redis_servers(3)
    async with two_runs(servers) as (_, noting, other):
        lagging, note = noting.members[2], await one_fill_noted(noting, b"m-2")
        servers[2].pause()  # SIGSTOP: the fill call hangs until it times out
        sending = asyncio.ensure_future(noting.fills.drain(lagging))
        await eventually(lambda: lagging.sending == 1, what="the fill in flight")
        assert not lagging.backlog
        await noting.behind.clear(lagging)
        for server in servers[:2]:
            assert note in await noted_behind_on(server)  # the note stands
        await sending  # timed out: back in the backlog
        assert len(lagging.backlog) == 1
        servers[2].resume()
        await other.refresh_epochs()
        assert other.counted() == [True, True, False]  # noted behind by the other run
        for _ in range(10):  # the first may meet the connection the timeout closed
            await noting.check()
            if not lagging.backlog:
                break
        assert not lagging.backlog
        await other.refresh_epochs()
        assert other.counted() == [True, True, True]  # sent, then cleared


async def test_a_clear_a_down_member_missed_is_made_once_it_answers(redis_servers: Any) -> None:
    """The run sent its fills for member 2 while member 1 was down: the note is
    cleared on member 0 at once, and on member 1 by the first clear after it answers
    again (until then the run holds it unsure)."""
    servers = redis_servers(3)
    async with two_runs(servers) as (_, noting, other):
        lagging, note = noting.members[2], await one_fill_noted(noting, b"m-5")
        servers[1].pause()  # SIGSTOP
        await noting.check()  # member 1 gives no answer: down; the fill is sent, the clear made
        assert not noting.members[1].up and not lagging.backlog
        assert note not in await noted_behind_on(servers[0])
        servers[1].resume()
        assert note in await noted_behind_on(servers[1])  # missed: it was down
        for _ in range(10):  # the first check may meet the connection the timeout closed
            await noting.check()
            if note not in await noted_behind_on(servers[1]):
                break
        assert note not in await noted_behind_on(servers[1])
        await other.refresh_epochs()
        assert other.counted() == [True, True, True]


async def test_a_batch_whose_fills_could_not_be_noted_is_tried_again_whatever_the_policy(
    redis_servers: Any,
) -> None:
    """The note that member 2 lacks the mark reaches member 1 but not member 0 (it
    hangs right after answering the claim): committed, the batch would rest on a
    note one emptied member takes away. So it is blocked and tried again, even
    under `on_no_quorum = "forward"` (nothing here is undecided by the vote)."""
    servers = redis_servers(3)
    settings = load_settings(
        redis={"nodes": redis_urls(servers), "timeout": "300ms"},
        dedup={"on_no_quorum": "forward"},
    )
    quorum = Quorum(settings.redis, Metrics())
    pipeline = Pipeline(settings, quorum, None, quorum.metrics)  # type: ignore[arg-type]
    claim = quorum.claim

    async def claim_then_hang(digests: Any, owners: Any) -> Any:
        replies = await claim(digests, owners)
        servers[0].pause()  # SIGSTOP: it answered the claim, it will not answer the note
        return replies

    tp = TopicPartition("raw", 0)
    record = ConsumerRecord("raw", 0, 7, 0, 0, None, b"{}", None, 0, 2, [("message-id", b"m-3")])
    try:
        await quorum.check()
        assert await quorum.admin.pause(quorum.members[2], True)  # its claims are refused
        quorum.claim = claim_then_hang  # type: ignore[method-assign]
        decided = (await pipeline.decide({tp: [record]})).decided
        assert decided.blocked == {tp: 7} and not decided.commits and not decided.forward
        assert counter_value(quorum.metrics.undecided, "block") == 0  # not the vote's doing
        servers[0].resume()
        quorum.claim = claim  # type: ignore[method-assign]
        await quorum.check()
        owner = owner_tokens("raw", 0, [7])
        assert await pipeline.vote([b"m-3"], owner) == [Outcome.FORWARD]  # tried again
        note = f"{quorum.members[2].name}|{quorum.behind.run_id}"
        for server in servers[:2]:
            assert note in await noted_behind_on(server)
    finally:
        servers[0].resume()
        await quorum.close()


async def test_claims_reach_each_answering_member_in_the_order_the_votes_began(
    redis_servers: Any,
) -> None:
    """Two votes in flight (the raw loop claims a batch while it finishes the one
    before) with copies of one id: the second's claim to a member waits for the first's
    answer there, so every member holds the first copy. Sent side by side, they
    reached two members in opposite orders, a 1:1 split no vote decides while the
    third member is down (the hung-member test above blocked so, one loaded run in
    four)."""
    servers = redis_servers(3)
    settings = load_settings(redis={"nodes": redis_urls(servers), "timeout": "5s"})
    quorum = Quorum(settings.redis, Metrics())
    first, second = [mark_digest(b"m-4")], [mark_digest(b"m-4")]  # one id, two votes
    events: list[tuple[str, str, str]] = []  # (what, member, vote)
    transport = quorum._via(quorum.members[0])
    grouped = transport.grouped

    async def spied(member: Any, what: str, digests: Any, plan: Any) -> Any:
        vote = "first" if digests is first else "second"
        events.append(("sent", member.name, vote))
        try:
            return await grouped(member, what, digests, plan)
        finally:
            events.append(("answered", member.name, vote))

    transport.grouped = spied  # type: ignore[method-assign]
    slow = quorum.members[1].name
    try:
        await quorum.check()
        servers[1].pause()  # SIGSTOP, briefly: still up, its claims wait for it
        one = asyncio.ensure_future(quorum.claim(first, ["11"]))
        await eventually(lambda: ("sent", slow, "first") in events, what="the first vote sent")
        two = asyncio.ensure_future(quorum.claim(second, ["22"]))
        others = [m.name for m in quorum.members if m.name != slow]
        await eventually(lambda: all(("answered", m, "second") in events for m in others),
                         what="the second vote answered by the others")  # fmt: skip
        assert ("sent", slow, "second") not in events  # it waits for the first's answer
        servers[1].resume()
        assert await one == [[MINE], [MINE], [MINE]]
        assert await two == [["11"], ["11"], ["11"]]  # the first copy holds every member
    finally:
        servers[1].resume()
        await quorum.close()


async def test_a_member_that_does_not_answer_gets_no_claim_beside_an_earlier_votes(
    redis_servers: Any,
) -> None:
    """Member 2's last call failed, an earlier vote's claim to it is still in flight (it
    holds the member's claim lock) and it came back: a claim sent beside that one could
    run before it, the 1:1 split the lock prevents. It gets none (no answer, as a
    timeout); once the earlier claim is done it gets the next."""
    servers = redis_servers(3)
    settings = load_settings(redis={"nodes": redis_urls(servers), "timeout": "300ms"})
    quorum = Quorum(settings.redis, Metrics())
    digest = mark_digest(b"o-1")
    try:
        await quorum.check()
        member = quorum.members[2]
        member.up = False  # as after a timeout
        async with member.claiming:  # the earlier vote's claim to it, in flight
            replies = await quorum.claim([digest], ["11"])
        assert replies[2] == [None]
        assert await owners_on(servers[2], [digest]) == [None]  # not sent beside it
        assert (await quorum.claim([digest], ["11"]))[2] == [MINE]
    finally:
        await quorum.close()
