"""The failure loop: release, retry from the source, dead-letter, bad commands."""

from __future__ import annotations

import json

import pytest

from gateway.topics import read_topic, wait_committed
from tests.conftest import redis_urls
from tests.integration.gateway_harness import (
    Topics,
    counter_value,
    eventually,
    failure_command,
    make_settings,
    produce,
    running,
)

ORDER = b'{"order_id": "m-1"}'


def copy_of(message_id: str) -> tuple[bytes, bytes, list[tuple[str, bytes]]]:
    return b"k", ORDER, [("message-id", message_id.encode())]


async def clean_copies(broker, topics, message_id="m-1", count=None):
    records = await read_topic(broker, topics.clean, min_records=count or 0)
    return [r for r in records if dict(r.headers)["dedup-id"] == message_id.encode()]


def attempt_of(rec) -> int:
    return int(dict(rec.headers).get("dedup-attempt", b"1"))


@pytest.fixture
async def setup(broker, redis_servers, names):
    topics = Topics(names)
    await topics.create(broker, raw_partitions=1, clean_partitions=1)
    urls = redis_urls(redis_servers(3))

    def settings(**failures):
        return make_settings(
            broker, topics, urls,
            failures={"backoff_initial": "10ms", "backoff_max": "50ms", **failures},
        )  # fmt: skip

    return topics, settings


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
        await produce(broker, topics.raw, [copy_of("m-1")])
        (first,) = await clean_copies(broker, topics, count=1)
        command = failure_command(first, "boom")
        await produce(broker, topics.failures, [command, command])  # delivered twice
        await eventually(lambda: counter_value(m.releases, "stale") == 1)
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
        bad = [
            b"not json",
            b"[1, 2]",
            json.dumps({"id": "m-1", "token": good["token"]}).encode(),
            json.dumps({**good, "source": {**good["source"], "offset": -1}}).encode(),
            json.dumps({**good, "token": "not-a-number"}).encode(),
            # Unknown id: no mark to hand over, and the raw record there has another id.
            json.dumps({**good, "id": "never-seen"}).encode(),
            # The raw record is gone (beyond the end of the partition).
            json.dumps(
                {**good, "id": "m-9", "source": {**good["source"], "offset": 10_000}}
            ).encode(),
        ]
        await produce(broker, topics.failures, [(b"k", v, []) for v in bad])
        await produce(broker, topics.failures, [failure_command(first, "boom")])
        await eventually(lambda: counter_value(m.retries, "2") == 1)
        expected = {"not_json": 1, "not_object": 1, "missing_field": 1, "bad_field": 2,
                    "id_mismatch": 1, "raw_record_gone": 1}  # fmt: skip
        for reason, n in expected.items():
            assert counter_value(m.invalid_commands, reason) == n, reason
