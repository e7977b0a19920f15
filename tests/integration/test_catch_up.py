"""A member only behind is caught up by the gateways (gateway/quorum/catchup.py), and
the ways a member behind was once left out of the count, or counted too early, with
real redis-servers: the run that dropped fills, a rebuild whose forget a hung member
missed, a notes key that refuses the note, a dry run that wrote epochs, a rebuild
after `ttl` was lowered."""

from __future__ import annotations

import contextlib
import io
from typing import Any

import redis.asyncio as aioredis

from devtools.harness import counter_value, redis_urls
from gateway.config import load_settings
from gateway.contract.tokens import mark_digest, owner_tokens
from gateway.metrics import Metrics
from gateway.ops.rebuild import rebuild
from gateway.quorum.copy import Copied, copy_marks
from gateway.quorum.quorum import Quorum
from gateway.raw.pipeline import Pipeline
from gateway.rules.commands import Handover
from gateway.rules.vote import Outcome
from tests.integration.redis_marks import alone, epoch_on, noted_behind_on, owners_on
from tests.integration.test_epochs import ping_twice, restart_empty, vote


async def test_the_run_that_dropped_fills_stops_counting_the_member_and_catches_it_up(
    redis_servers: Any,
) -> None:
    """`repair_backlog = 1`: member 2 missed two marks, the fill of the first was
    dropped. The run that dropped it counted member 2 all the same (every other run
    did not): after one more fault it forwarded a copy on a 1:1 tie. Now it does not
    count it, and catches it up from the others once it answers."""
    servers = redis_servers(3)
    settings = load_settings(
        redis={"nodes": redis_urls(servers), "timeout": "300ms", "repair_backlog": 1}
    )
    quorum = Quorum(settings.redis, Metrics())
    first, second = mark_digest(b"d-1"), mark_digest(b"d-2")
    try:
        await quorum.check()
        assert quorum.counted() == [True, True, True]
        servers[2].pause()  # SIGSTOP: it answers no claim
        try:
            replies = await quorum.claim([first, second], ["11", "12"])
            assert replies[2] == [None, None]
            quorum.queue_fills([[], [], [(first, "11", "11"), (second, "12", "12")]])
        finally:
            servers[2].resume()
        lagging = quorum.members[2]
        assert counter_value(quorum.metrics.repairs_dropped, lagging.name) == 1
        assert quorum.counted() == [True, True, False]  # it lacks `first`, and this run knows
        for _ in range(20):  # the first check may meet the connection the timeout closed
            await quorum.check()
            if quorum.catch_up.task is not None:
                await quorum.catch_up.task
            if quorum.counted()[2]:
                break
        assert quorum.counted() == [True, True, True]
        assert await owners_on(servers[2], [first, second]) == ["11", "12"]
        assert counter_value(quorum.metrics.catchups, lagging.name, "done") == 1
    finally:
        await quorum.close()


async def test_a_rebuild_sticks_though_a_member_holding_a_note_was_hung_meanwhile(
    redis_servers: Any,
) -> None:
    """A stopped run noted member 2 behind on members 0 and 1; member 1 hangs during
    `rebuild` of member 2, so the forget misses it. Once it answers again, its note
    must not take member 2 out of the count: the rebuild made every note written
    before it began void on member 2 itself."""
    servers = redis_servers(3)
    settings = load_settings(redis={"nodes": redis_urls(servers), "timeout": "300ms"})
    noting, other = Quorum(settings.redis, Metrics()), Quorum(settings.redis, Metrics())
    try:
        await noting.check()
        noting.queue_fills([[], [], [(mark_digest(b"r-1"), "11", "11")]])
        assert await noting.note_behind()
        note = f"{noting.members[2].name}|{noting.behind.run_id}"
        await other.refresh_epochs()
        assert other.counted() == [True, True, False]
        servers[1].pause()  # SIGSTOP: it misses the forget
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                code = await rebuild(settings, servers[2].name_label, source=None,
                                     dry_run=False, output="json")  # fmt: skip
            assert code == 0
        finally:
            servers[1].resume()
        assert note not in await noted_behind_on(servers[0])
        assert note in await noted_behind_on(servers[1])  # the forget missed it
        for _ in range(3):  # the first read may meet the connection the hang timed out
            await other.refresh_epochs()
        assert other.counted() == [True, True, True]
    finally:
        await noting.close()
        await other.close()


async def test_a_member_whose_notes_key_refuses_the_note_does_not_block_every_batch(
    redis_servers: Any,
) -> None:
    """Member 2 is paused (its fills are queued), member 1 answers claims but its
    notes key holds a string (a key collision), so the note call fails there: every
    batch was RETRY for as long as that lasted. The note on member 0 stands alone."""
    servers = redis_servers(3)
    settings = load_settings(redis={"nodes": redis_urls(servers), "timeout": "300ms"})
    quorum = Quorum(settings.redis, Metrics())
    pipeline = Pipeline(settings, quorum, None, quorum.metrics)  # type: ignore[arg-type]
    try:
        await quorum.check()
        async with aioredis.Redis(port=servers[1].port) as client:
            await client.set("dd:behind", "someone else's")
        assert await quorum.admin.pause(quorum.members[2], True)  # its claims are refused
        for n in range(3):
            owner = owner_tokens("raw", 0, [n])
            assert await pipeline.vote([f"k-{n}".encode()], owner) == [Outcome.FORWARD]
        note = f"{quorum.members[2].name}|{quorum.behind.run_id}"
        assert note in await noted_behind_on(servers[0])
    finally:
        await quorum.close()


async def test_a_dry_run_rebuild_writes_no_epoch(redis_servers: Any) -> None:
    """Members 1 and 2 restarted empty, member 0 (holding the marks) hangs: the
    quorum `rebuild --dry-run` built gave the two emptied members `trusted` epochs by
    the fresh-deployment rule (no member that answers holds marks), and a copy was
    then forwarded. An operator command's quorum writes no epoch."""
    servers = redis_servers(3)
    settings = load_settings(redis={"nodes": redis_urls(servers), "timeout": "300ms"})
    quorum = Quorum(settings.redis, Metrics())
    try:
        await quorum.check()
        await quorum.claim([mark_digest(b"held")], ["11"])
    finally:
        await quorum.close()
    for server in servers[1:]:
        restart_empty(server)
    servers[0].pause()
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            await rebuild(settings, servers[1].name_label, source=None, dry_run=True,
                          output="json")  # fmt: skip
    finally:
        servers[0].resume()
    assert await epoch_on(servers[1]) is None
    assert await epoch_on(servers[2]) is None


async def test_a_rebuild_after_ttl_was_lowered_keeps_each_copy_s_remaining_life(
    redis_servers: Any,
) -> None:
    """A mark claimed under ttl 60 s, copied by a rebuild configured with ttl 10 s,
    lives about as long as the original, not 10-15 s. (Timeouts of 5 s: on a loaded
    host the default 500 ms let the claim go unanswered, and nothing was copied.)"""
    servers = redis_servers(3)
    long = load_settings(redis={"nodes": redis_urls(servers), "ttl": "60s", "timeout": "5s"})
    quorum = Quorum(long.redis, Metrics())
    digest = mark_digest(b"long-lived")
    try:
        await quorum.check()  # both get an epoch
    finally:
        await quorum.close()
    async with alone(servers[0], ttl="60s", timeout="5s") as source:
        await source.check()
        assert await source.claim([digest], ["11"]) == [[1]]  # answered: new, on member 0 only
    short = load_settings(redis={"nodes": redis_urls(servers), "ttl": "10s", "timeout": "5s"})
    with contextlib.redirect_stdout(io.StringIO()):
        code = await rebuild(short, servers[1].name_label, source=servers[0].name_label,
                             dry_run=False, output="json")  # fmt: skip
    assert code == 0
    async with alone(servers[1], ttl="10s", timeout="5s") as target:
        reply = await target.admin.lookup(target.members[0], [digest])
        assert reply is not None
        ((owner, left),) = reply
    assert owner == b"11"
    assert int(left) > 50_000, left


async def test_a_claim_landing_between_the_copys_lookup_and_its_import_is_left_standing(
    redis_servers: Any,
) -> None:
    """Issue 52: the copy (catch-up or rebuild) looks a chunk up, then imports the owner
    it picked. A claim that landed in between (here: just before the import, where the
    catch-up renews its lease) was overwritten with the older owner, the tombstone the
    sources held: marks [T2, T2, -T1]. Once member 1 restarted empty, a later copy T3
    split the two counted members 1:1 and was forwarded (the smaller token). IMPORT now
    writes only where the member holds what the lookup saw: T2 stays, T3 is a duplicate."""
    servers = redis_servers(3)
    settings = load_settings(redis={"nodes": redis_urls(servers), "timeout": "2s"})
    message, (t1, t2, t3) = b"order-52", ("3003", "2002", "1001")  # t3 < t2: wins a tie
    digest = mark_digest(message)
    gateway, copier = Quorum(settings.redis, Metrics()), Quorum(settings.redis, Metrics())
    try:
        await gateway.check()
        assert await gateway.claim([digest], [t1]) == [[1], [1], [1]]
        assert await gateway.release([digest], [t1]) == [[1], [1], [1]]  # -t1 everywhere
        await copier.check()
        target = copier.members[2]
        assert target.epoch is not None
        landed: list[Any] = []

        async def live_claim() -> None:  # a gateway's claim, between lookup and import
            if not landed:
                landed.append(await gateway.claim([digest], [t2]))

        async def advance(found: int, fraction: float) -> None:
            pass

        copied = Copied()
        await copy_marks(copier.admin, target, target.epoch.id, copier.members[:2], copied,
                         advance, before_import=live_claim)  # fmt: skip
        assert landed == [[[f"={t1}"]] * 3]  # claimed over the tombstone on all three
        assert [(await owners_on(s, [digest]))[0] for s in servers] == [t2, t2, t2]
        assert (copied.marks_read, copied.changed) == (1, 1)
        restart_empty(servers[1])
        await ping_twice(gateway)
        assert gateway.counted() == [True, False, True]
        pipeline = Pipeline(settings, gateway, None, gateway.metrics)  # type: ignore[arg-type]
        assert await vote(pipeline, message, t3) is Outcome.DUPLICATE
    finally:
        await gateway.close()
        await copier.close()


async def test_a_handover_landing_between_the_copys_lookup_and_its_import_keeps_its_note(
    redis_servers: Any,
) -> None:
    """The same window, a failure command's handover (token 11 to 12, noted with the
    command's ref) landing in it: the copy wrote the failed attempt's token back over
    it and deleted its note, so a replay of that command read "another copy" there."""
    servers = redis_servers(3)
    settings = load_settings(redis={"nodes": redis_urls(servers), "timeout": "2s"})
    digest = mark_digest(b"failed-once")
    gateway, copier = Quorum(settings.redis, Metrics()), Quorum(settings.redis, Metrics())
    try:
        await gateway.check()
        assert await gateway.claim([digest], ["11"]) == [[1], [1], [1]]
        await copier.check()
        target = copier.members[2]
        assert target.epoch is not None
        landed: list[Any] = []

        async def live_handover() -> None:
            if not landed:
                landed.append(await gateway.handover([Handover(digest, "11", "12", "f/0/1")]))

        async def advance(found: int, fraction: float) -> None:
            pass

        copied = Copied()
        await copy_marks(copier.admin, target, target.epoch.id, copier.members[:2], copied,
                         advance, before_import=live_handover)  # fmt: skip
        assert landed == [[[1], [1], [1]]]
        assert await owners_on(servers[2], [digest]) == ["12"]
        async with aioredis.Redis(port=servers[2].port) as client:
            assert await client.get(b"dd:h:" + digest) == b"f/0/1"
        assert copied.changed == 1
    finally:
        await gateway.close()
        await copier.close()


async def test_a_catch_up_that_lost_its_lease_after_reading_writes_nothing(
    redis_servers: Any,
) -> None:
    """The lease is renewed before every IMPORT call too: a gateway that stalled after
    its lookups while another run took the member's lease over (here: the lease key
    rewritten) stops there. Before, it wrote what it had read, then found the lease gone."""
    servers = redis_servers(3)
    settings = load_settings(
        redis={"nodes": redis_urls(servers), "timeout": "300ms", "repair_backlog": 1}
    )
    quorum = Quorum(settings.redis, Metrics())
    first, second = mark_digest(b"l-1"), mark_digest(b"l-2")
    try:
        await quorum.check()
        servers[2].pause()  # SIGSTOP: it answers no claim
        try:
            await quorum.claim([first, second], ["11", "12"])
            quorum.queue_fills([[], [], [(first, "11", "11"), (second, "12", "12")]])
        finally:
            servers[2].resume()
        lagging = quorum.members[2]
        quorum.catch_up.not_before = float("inf")  # no catch-up started by the watch
        for _ in range(5):
            await quorum.check()
        assert quorum.counted() == [True, True, False] and lagging.up
        lookup = quorum.admin.lookup

        async def then_taken_over(member: Any, digests: Any, notes: bool = False) -> Any:
            reply = await lookup(member, digests, notes)
            if member is not lagging:  # the sources' lookup, after the member's
                async with aioredis.Redis(port=servers[2].port) as client:
                    await client.set("dd:catch-up", "another-run", px=30_000)
            return reply

        quorum.admin.lookup = then_taken_over  # type: ignore[method-assign]
        assert not await quorum.catch_up.run(lagging)
        assert counter_value(quorum.metrics.catchups, lagging.name, "failed") == 1
        assert await owners_on(servers[2], [first]) == [None]  # nothing imported
    finally:
        await quorum.close()
