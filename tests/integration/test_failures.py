"""The failure loop: release, retry from the source, dead-letter, bad commands,
a broker too slow to read the raw record back, a rebalance of the command group."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import Counter
from datetime import timedelta

import pytest
import redis.asyncio as aioredis

from devtools.harness import (
    Topics,
    counter_value,
    eventually,
    failure_command,
    make_settings,
    produce,
    redis_urls,
    running,
)
from devtools.topics import committed_offsets, read_topic, wait_committed
from gateway.contract.tokens import mark_digest
from gateway.kafka.clients import build_consumer, build_producer
from gateway.kafka.completion import PlainCompletions
from gateway.kafka.read_back import RawFetcher
from gateway.kafka.sink import Sink
from gateway.metrics import Metrics, total
from gateway.quorum.quorum import Quorum
from gateway.service.app import failure_loop
from tests.integration.redis_marks import alone, owners_on

ORDER = b'{"order_id": "m-1"}'


def copy_of(message_id: str) -> tuple[bytes, bytes, list[tuple[str, bytes]]]:
    return b"k", ORDER, [("message-id", message_id.encode())]


async def clean_copies(broker, topics, message_id="m-1", count=None):
    records = await read_topic(broker, topics.clean, min_records=count or 0)
    return [r for r in records if dict(r.headers)["dedup-id"] == message_id.encode()]


def token_of(rec) -> str:
    return dict(rec.headers)["dedup-token"].decode()


def attempt_of(rec) -> int:
    return int(dict(rec.headers).get("dedup-attempt", b"1"))


@pytest.fixture
async def one_partition(stack):
    """The stack of `setup`'s gateway: one raw and one clean partition, three members."""
    return await stack(raw_partitions=1, clean_partitions=1)


@pytest.fixture
def members(one_partition):
    """The three redis-servers of `setup`'s gateway (the same in one test)."""
    return one_partition.servers


@pytest.fixture
def setup(one_partition):
    s = one_partition
    urls = redis_urls(s.servers)

    def settings(**failures):
        return make_settings(
            s.broker, s.topics, urls,
            failures={"backoff_initial": "10ms", "backoff_max": "50ms", **failures},
        )  # fmt: skip

    return s.topics, settings


async def test_release_with_the_right_token_lets_the_next_copy_through_and_stale_does_not(
    broker, setup
):
    topics, settings = setup
    async with running(settings(mode="release")) as gateway:
        m = gateway.metrics
        await produce(broker, topics.raw, [copy_of("m-1")])
        (first,) = await clean_copies(broker, topics, count=1)
        await produce(broker, topics.failures, [failure_command(first, "api down")])
        await eventually(lambda: counter_value(m.releases, "released") == 1)

        await produce(broker, topics.raw, [copy_of("m-1")])  # the producer sends it again
        await wait_committed(broker, topics.group, topics.raw, {0: 2})
        copies = await clean_copies(broker, topics, count=2)
        assert len(copies) == 2

        # The first copy's token is stale now: the second copy owns the mark.
        await produce(broker, topics.failures, [failure_command(first, "late replay")])
        await eventually(lambda: counter_value(m.releases, "stale") == 1)
        await produce(broker, topics.raw, [copy_of("m-1")])
        await wait_committed(broker, topics.group, topics.raw, {0: 3})
        assert counter_value(m.duplicates) == 1
    assert len(await clean_copies(broker, topics)) == 2


async def failed_and_commanded_twice(broker, topics, m):
    """One copy forwarded, its failure command delivered twice, the repeat counted
    stale; the command."""
    await produce(broker, topics.raw, [copy_of("m-1")])
    (first,) = await clean_copies(broker, topics, count=1)
    command = failure_command(first, "boom")
    await produce(broker, topics.failures, [command, command])  # delivered twice
    await eventually(lambda: counter_value(m.releases, "stale") == 1)
    return command


async def test_a_release_delivered_twice_counts_one_release_and_one_repeat(broker, setup):
    topics, settings = setup
    async with running(settings(mode="release")) as gateway:
        m = gateway.metrics
        await failed_and_commanded_twice(broker, topics, m)
        assert counter_value(m.releases, "released") == 1
        await produce(broker, topics.raw, [copy_of("m-1")])  # released: new again
        await wait_committed(broker, topics.group, topics.raw, {0: 2})
    assert len(await clean_copies(broker, topics)) == 2


async def test_retry_forwards_k_plus_1_times_then_dead_letters_and_resends_stay_duplicates(
    broker, setup
):
    topics, settings = setup
    async with running(settings(mode="retry", max_attempts=4)) as gateway:
        m = gateway.metrics
        await produce(broker, topics.raw, [copy_of("m-1")])
        for attempt in (1, 2, 3):  # fails 3 times: forwarded with attempts 1..4
            copies = await clean_copies(broker, topics, count=attempt)
            assert sorted(map(attempt_of, copies)) == list(range(1, attempt + 1))
            latest = max(copies, key=attempt_of)
            await produce(broker, topics.failures, [failure_command(latest, f"boom {attempt}")])
        copies = await clean_copies(broker, topics, count=4)
        assert sorted(map(attempt_of, copies)) == [1, 2, 3, 4]
        assert len({dict(c.headers)["dedup-token"] for c in copies}) == 4
        assert json.loads(dict(max(copies, key=attempt_of).headers)["dedup-reasons"]) == [
            "boom 1", "boom 2", "boom 3",
        ]  # fmt: skip

        # The 4th attempt fails too: max_attempts reached, dead-lettered.
        await produce(
            broker, topics.failures, [failure_command(max(copies, key=attempt_of), "boom 4")]
        )
        (dead,) = await read_topic(broker, topics.dead, min_records=1)
        headers = dict(dead.headers)
        assert headers["dedup-attempt"] == b"4" and headers["dedup-reason"] == b"boom 4"
        assert json.loads(headers["dedup-reasons"]) == ["boom 1", "boom 2", "boom 3", "boom 4"]
        assert dead.value == ORDER
        assert counter_value(m.dead_lettered) == 1

        await produce(broker, topics.raw, [copy_of("m-1")])  # a producer resend: still a duplicate
        await wait_committed(broker, topics.group, topics.raw, {0: 2})
        assert counter_value(m.duplicates) == 1
    assert len(await clean_copies(broker, topics)) == 4


async def test_duplicated_and_reordered_commands_retry_once(broker, setup):
    topics, settings = setup
    async with running(settings(mode="retry")) as gateway:
        m = gateway.metrics
        command = await failed_and_commanded_twice(broker, topics, m)
        await eventually(lambda: counter_value(m.retries, "2") == 1)
        second = max(await clean_copies(broker, topics, count=2), key=attempt_of)
        # Reordered: attempt 2's failure, then attempt 1's again (late).
        await produce(broker, topics.failures, [failure_command(second, "boom 2"), command])
        await eventually(lambda: counter_value(m.retries, "3") == 1)
        await eventually(lambda: counter_value(m.releases, "stale") == 2)
    copies = await clean_copies(broker, topics)
    assert sorted(map(attempt_of, copies)) == [1, 2, 3]


async def test_bad_commands_are_counted_and_skipped_and_the_loop_goes_on(broker, setup):
    topics, settings = setup
    async with running(settings(mode="retry")) as gateway:
        m = gateway.metrics
        await produce(broker, topics.raw, [copy_of("m-1"), copy_of("m-2")])
        first = (await clean_copies(broker, topics, count=2))[0]
        good = json.loads(failure_command(first, "boom")[1])
        source = good["source"]
        unknown = {k: v for k, v in good.items() if k != "id_b64"}
        bad = [
            b"not json",
            b"[1, 2]",
            json.dumps({"id": "m-1", "token": good["token"]}).encode(),
            json.dumps({**good, "source": {**source, "offset": -1}}).encode(),
            json.dumps({**good, "token": "not-a-number"}).encode(),
            # Unknown id: no mark to hand over, and the raw record there has another id.
            json.dumps({**unknown, "id": "never-seen"}).encode(),
            # Nothing at that offset: past the end of the partition.
            json.dumps({**unknown, "id": "m-9", "source": {**source, "offset": 10_000}}).encode(),
            # Not a raw topic of this gateway; a raw partition that does not exist.
            json.dumps({**unknown, "id": "m-8", "source": {**source, "topic": "other"}}).encode(),
            json.dumps({**unknown, "id": "m-7", "source": {**source, "partition": 99}}).encode(),
        ]
        await produce(broker, topics.failures, [(b"k", v, []) for v in bad])
        await produce(broker, topics.failures, [failure_command(first, "boom")])
        await eventually(lambda: counter_value(m.retries, "2") == 1)
        expected = {"not_json": 1, "not_object": 1, "missing_field": 1, "bad_field": 2,
                    "id_mismatch": 1, "beyond_end": 1, "unknown_source": 2}  # fmt: skip
        for reason, n in expected.items():
            await eventually(
                lambda r=reason, n=n: counter_value(m.invalid_commands, r) == n, 40, reason
            )
        assert counter_value(m.invalid_commands, "raw_record_gone") == 0
        # Every command was handled: the failure topic is committed to its end.
        await wait_committed(broker, f"{topics.group}.failures", topics.failures, {0: len(bad) + 1})


@pytest.mark.parametrize("mode", ["release", "retry"])
async def test_an_id_that_is_not_utf8_is_released_or_retried_by_its_exact_bytes(
    broker, stack, mode
):
    s = await stack(
        raw_partitions=1, clean_partitions=1, dedup={"id": "key"},
        failures={"mode": mode, "backoff_initial": "10ms", "backoff_max": "50ms"},
    )  # fmt: skip
    topics, settings = s.topics, s.settings
    binary = b"\xff\xfe-bin"  # a Kafka key that is not UTF-8: the id
    async with running(settings) as gateway:
        m = gateway.metrics
        await produce(broker, topics.raw, [(binary, ORDER, [])])
        (first,) = await read_topic(broker, topics.clean, min_records=1)
        # As the Spark job sends it: readable id (U+FFFD for the bad bytes) and id_b64.
        await produce(broker, topics.failures, [failure_command(first, "boom")])
        if mode == "release":
            await eventually(lambda: counter_value(m.releases, "released") == 1)
            await produce(broker, topics.raw, [(binary, ORDER, [])])  # sent again: new now
            await wait_committed(broker, topics.group, topics.raw, {0: 2})
        else:
            await eventually(lambda: counter_value(m.retries, "2") == 1)
        assert total(m.invalid_commands) == 0
    copies = await read_topic(broker, topics.clean)
    assert [dict(c.headers)["dedup-id"] for c in copies] == [binary, binary]
    assert sorted(map(attempt_of, copies)) == ([1, 1] if mode == "release" else [1, 2])


async def test_a_raw_fetch_outlasting_its_deadline_is_retried_later_not_called_gone(
    proxied_broker, redis_servers, names, caplog
):
    caplog.set_level(logging.WARNING, logger="gateway.failures")
    bootstrap, proxy = proxied_broker
    topics = Topics(names)
    await topics.create(bootstrap, raw_partitions=1, clean_partitions=1)
    settings = make_settings(
        bootstrap, topics, redis_urls(redis_servers(3)),
        failures={"backoff_initial": "1s", "backoff_max": "1s"},
    )  # fmt: skip
    # A gateway forwards the record; in a group of its own, so that the failure loop
    # below joins a fresh command group (no rebalance to wait out).
    forwarding = settings.model_copy(
        update={"kafka": settings.kafka.model_copy(update={"group_id": names("forwarder")})}
    )
    async with running(forwarding):
        await produce(bootstrap, topics.raw, [copy_of("m-1")])
        (first,) = await read_topic(bootstrap, topics.clean, min_records=1)

    # The gateway's failure loop, wired as app.py does, with a short raw-read deadline.
    kafka, metrics = settings.kafka, Metrics()
    quorum = Quorum(settings.redis, metrics)
    producer = build_producer(kafka)
    commands = build_consumer(kafka, f"{kafka.group_id}.failures")
    raw_reader = build_consumer(kafka, None, auto_offset_reset="none")
    for client in (producer, commands, raw_reader):
        await client.start()
    sink = Sink(producer, kafka, metrics)
    loop = await failure_loop(
        settings, quorum, PlainCompletions(sink), metrics, commands,
        RawFetcher(raw_reader, deadline_s=0.5),
    )  # fmt: skip
    commands.subscribe([kafka.failure_topic], listener=loop.listener())
    stop = asyncio.Event()
    task = asyncio.create_task(loop.run(stop))
    try:
        await produce(bootstrap, topics.failures, [failure_command(first, "boom")])
        await eventually(lambda: counter_value(metrics.releases, "handed_over") == 1)
        proxy.pause()  # the retry is due about 1s after the handover: it meets a silent broker
        await eventually(
            lambda: "not done, trying again" in caplog.text or total(metrics.invalid_commands) > 0,
            15, "a raw read that failed",
        )  # fmt: skip
        assert total(metrics.invalid_commands) == 0, "a slow broker was taken for a gone record"
        assert counter_value(metrics.retries, "2") == 0
        proxy.resume()

        deadline = time.monotonic() + 30
        while True:  # whenever the command is committed, its retry is on the clean topic
            group = f"{kafka.group_id}.failures"
            committed = (await committed_offsets(bootstrap, group, topics.failures))[0]
            retried = [r for r in await read_topic(bootstrap, topics.clean) if attempt_of(r) == 2]
            if committed >= 1:
                assert len(retried) == 1
                break
            assert time.monotonic() < deadline, "the command was never committed"
        assert counter_value(metrics.retries, "2") == 1
        assert total(metrics.invalid_commands) == 0  # not raw_record_gone, nor anything else
    finally:
        proxy.resume()
        stop.set()
        await asyncio.wait_for(task, 30)
        for client in (commands, raw_reader, producer):
            await client.stop()
        await quorum.close()


async def test_a_rebalance_of_the_command_group_hands_scheduled_retries_to_the_new_owner(
    broker, stack
):
    backoff = 10.0
    s = await stack(
        raw_partitions=1, clean_partitions=1,  # failures: 2 partitions
        failures={"backoff_initial": f"{backoff}s", "backoff_max": f"{backoff}s"},
    )  # fmt: skip
    topics, settings = s.topics, s.settings

    def retries(gateway):
        return counter_value(gateway.metrics.retries, "2")

    async with running(settings) as first:
        await produce(broker, topics.raw, [copy_of("m-1"), copy_of("m-2")])
        forwarded = await read_topic(broker, topics.clean, min_records=2)
        clean = {dict(r.headers)["dedup-id"]: r for r in forwarded}
        # One command on each failure partition: whichever moves, a scheduled retry moves.
        for partition, message_id in enumerate((b"m-1", b"m-2")):
            command = failure_command(clean[message_id], "boom")
            await produce(broker, topics.failures, [command], partition=partition)
        await eventually(lambda: counter_value(first.metrics.releases, "handed_over") == 2)
        first_schedule_ends = time.monotonic() + backoff

        async with running(settings) as second:
            # The second gateway took one partition and replayed its command (a redo).
            await eventually(lambda: counter_value(second.metrics.releases, "handed_over") == 1)
            assert retries(first) == 0, "the rebalance came after the retries: no test"
            await eventually(lambda: retries(first) + retries(second) == 2, 3 * backoff)
            # Past the first gateway's original schedule: a dropped entry stays dropped.
            await asyncio.sleep(max(0.0, first_schedule_ends + 1 - time.monotonic()))
            assert (retries(first), retries(second)) == (1, 1)
            await wait_committed(broker, f"{topics.group}.failures", topics.failures, {0: 1, 1: 1})
    copies = await read_topic(broker, topics.clean)
    assert Counter(dict(c.headers)["dedup-id"] for c in copies if attempt_of(c) == 2) == {
        b"m-1": 1, b"m-2": 1,
    }  # fmt: skip


async def test_an_invalid_command_behind_one_that_waits_for_a_majority_is_counted_once(
    broker, stack
):
    """A partition waiting for a majority reads the commands behind the waiting one
    again at every retry; an invalid one among them is counted and logged once."""
    s = await stack(
        raw_partitions=1, clean_partitions=1,
        failures={"mode": "retry", "backoff_initial": "10ms", "backoff_max": "50ms"},
    )  # fmt: skip
    topics, servers, settings = s.topics, s.servers, s.settings
    async with running(settings) as gateway:
        m = gateway.metrics
        await produce(broker, topics.raw, [copy_of("m-1")])
        (first,) = await clean_copies(broker, topics, count=1)
        for server in servers[1:]:
            server.pause()  # hung: no majority answers the handover
        try:
            await produce(
                broker, topics.failures, [failure_command(first, "boom"), (b"k", b"not json", [])]
            )
            await eventually(lambda: counter_value(m.releases, "no_quorum") >= 3, 40)
            assert counter_value(m.invalid_commands, "not_json") == 1
        finally:
            for server in servers[1:]:
                server.resume()
        await eventually(lambda: counter_value(m.retries, "2") == 1, 40)
        await wait_committed(broker, f"{topics.group}.failures", topics.failures, {0: 2})
    assert counter_value(m.invalid_commands, "not_json") == 1


async def test_a_member_that_missed_a_handover_is_brought_up_though_another_recovers(
    broker, setup, members
):
    """Member 2 hangs through attempt 1's handover (members 0 and 1 make it), then
    member 1 restarts empty (recovering, not counted). Attempt 2's command is decided
    by members 0 and 2: member 2, still holding attempt 1's token, is handed over too.
    It used to answer "stale" against member 0's "handed over", and the command
    partition waited forever (chaos seed 1, retry mode)."""
    (topics, settings), servers = setup, members
    async with running(settings(mode="retry")) as gateway:
        await produce(broker, topics.raw, [copy_of("m-1")])
        (first,) = await clean_copies(broker, topics, count=1)
        servers[2].pause()
        try:
            await produce(broker, topics.failures, [failure_command(first, "boom 1")])
            await eventually(lambda: counter_value(gateway.metrics.retries, "2") == 1)
        finally:
            servers[2].resume()
        second = max(await clean_copies(broker, topics, count=2), key=attempt_of)
        assert await owners_on(servers[2], [mark_digest(b"m-1")]) == [token_of(first)]
        servers[1].stop()
        servers[1].start()  # empty: recovering until rebuilt
        await eventually(lambda: gateway.quorum.counted() == [True, False, True])
        await produce(broker, topics.failures, [failure_command(second, "boom 2")])
        await eventually(
            lambda: counter_value(gateway.metrics.retries, "3") == 1, what="attempt 3 retried"
        )
    third = max(await clean_copies(broker, topics, count=3), key=attempt_of)
    assert attempt_of(third) == 3
    # Member 2 is up to date: it holds attempt 3's token, as member 0 does.
    for server in (servers[0], servers[2]):
        assert await owners_on(server, [mark_digest(b"m-1")]) == [token_of(third)]


async def test_a_member_that_missed_a_claim_and_its_fill_does_not_hold_a_release_back(
    broker, setup, members
):
    """Member 2 hangs through the claim, and the gateway stops before its fill is
    sent: it never holds the mark (and the stopped gateway's note that it is behind
    expires). Then member 1 restarts empty (recovering). The
    release is decided by members 0 (released) and 2 (no live mark: the id is free
    there too). It used to count that member as "stale", and the 1:1 tie held the
    command partition forever, as the retry case above did."""
    (topics, settings_in), servers = setup, members
    settings = settings_in(mode="release")
    try:
        async with running(settings) as gateway:
            await eventually(lambda: gateway.readiness()[0], what="ready")  # epochs read
            servers[2].pause()
            await produce(broker, topics.raw, [copy_of("m-1")])
            await wait_committed(broker, topics.group, topics.raw, {0: 1})
    finally:
        servers[2].resume()
    (first,) = await clean_copies(broker, topics, count=1)
    assert await owners_on(servers[2], [mark_digest(b"m-1")]) == [None]
    # The stopped gateway noted member 2 as behind (gateway/quorum/behind.py): not
    # counted until rebuilt or the note expires (2 x ttl). Here it has expired.
    deleted = []
    for server in servers:
        async with aioredis.from_url(redis_urls([server])[0]) as client:
            deleted.append(await client.delete(settings.redis.key_prefix + "behind"))
    assert deleted == [1, 1, 0]  # noted on the members that answered
    servers[1].stop()
    servers[1].start()  # empty: recovering until rebuilt
    async with running(settings) as gateway:
        m = gateway.metrics
        await eventually(lambda: gateway.quorum.counted() == [True, False, True])
        await produce(broker, topics.failures, [failure_command(first, "api down")])
        await eventually(lambda: counter_value(m.releases, "released") == 1, what="released")
        await produce(broker, topics.raw, [copy_of("m-1")])  # the producer's next copy: new
        await wait_committed(broker, topics.group, topics.raw, {0: 2})
    assert len(await clean_copies(broker, topics, count=2)) == 2


SHORT_TTL = timedelta(seconds=4)  # marks gone after 4-6 s (a slice is half the ttl)


async def expired_everywhere(servers, message_id: bytes, timeout_s: float = 30) -> None:
    """Wait until no member holds a live mark for `message_id` (its ttl has passed)."""
    deadline = time.monotonic() + timeout_s
    while True:
        owners = []
        for server in servers:
            async with alone(server, ttl=SHORT_TTL) as quorum:
                reply = await quorum.admin.lookup(quorum.members[0], [mark_digest(message_id)])
                # No answer within the test's 300 ms member timeout (a loaded host):
                # asked again, as a held mark is, until the deadline.
                owners.append(reply[0][0] if reply is not None else f"{server.name}: no answer")
        if not any(owners):
            return
        assert time.monotonic() < deadline, f"marks still held after {timeout_s}s: {owners}"
        await asyncio.sleep(0.2)  # polling the members' state, not standing in for it


async def test_a_retry_command_after_the_marks_ttl_still_retries_its_record(broker, setup, members):
    """A command that comes after its id's mark expired finds the id free on every
    member: nobody holds it, so the handover claims it for the next attempt and the
    record is retried (docs/failures.md)."""
    topics, settings = setup
    config = settings(mode="retry")
    config.redis.ttl = SHORT_TTL
    async with running(config) as gateway:
        await produce(broker, topics.raw, [copy_of("m-1")])
        (first,) = await clean_copies(broker, topics, count=1)
        await expired_everywhere(members, b"m-1")
        await produce(broker, topics.failures, [failure_command(first, "late")])
        await eventually(lambda: counter_value(gateway.metrics.retries, "2") == 1, what="retried")
        assert counter_value(gateway.metrics.releases, "stale") == 0
    copies = await clean_copies(broker, topics, count=2)
    assert sorted(map(attempt_of, copies)) == [1, 2]
    assert len(set(map(token_of, copies))) == 2


async def test_a_retry_command_after_the_ttl_is_stale_once_a_new_copy_holds_the_id(
    broker, setup, members
):
    """After the mark expired, the producer's next copy is new: it is forwarded under a
    token of its own and is the id's delivery from then on. The first copy's late
    command then finds the id held by another owner: skipped as stale, no retry."""
    topics, settings = setup
    config = settings(mode="retry")
    config.redis.ttl = SHORT_TTL
    async with running(config) as gateway:
        m = gateway.metrics
        await produce(broker, topics.raw, [copy_of("m-1")])
        (first,) = await clean_copies(broker, topics, count=1)
        await expired_everywhere(members, b"m-1")
        await produce(broker, topics.raw, [copy_of("m-1")])
        await clean_copies(broker, topics, count=2)
        await produce(broker, topics.failures, [failure_command(first, "late")])
        await eventually(lambda: counter_value(m.releases, "stale") == 1, what="stale")
        assert counter_value(m.retries, "2") == 0 and counter_value(m.duplicates) == 0
    copies = await clean_copies(broker, topics, count=2)
    assert [attempt_of(c) for c in copies] == [1, 1]
    assert len(set(map(token_of, copies))) == 2
