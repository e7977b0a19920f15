"""The older-slice filter (gateway/quorum/lua/prelude.lua, gateway/quorum/keys.py): a
new id whose bits are not in its bucket's filter is not searched for in the older
slices, and no id an older slice holds is ever claimed again: not after a rebuild
adds marks to an older slice, not when the older slices have another bucket
count. Older slices are written as a member that ran for a `ttl` holds them
(bench/steady.py)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis.asyncio as aioredis

from bench.steady import _older_marks, fill_older
from devtools.localstack import ManagedProcess
from gateway.config import Settings, load_settings
from gateway.contract.tokens import mark_digest
from gateway.metrics import Metrics
from gateway.ops.rebuild import rebuild
from gateway.quorum.quorum import Quorum
from gateway.rules.vote import MINE
from tests.conftest import redis_urls
from tests.integration.redis_marks import owners_on

FILTER = b"~"


def filter_bits(digest: bytes) -> list[tuple[int, int]]:
    """A digest's two bits in a filter, as (byte, mask) (prelude.lua, `FILTER_AT`)."""
    return [
        (v % 64, 1 << (v // 64 + (4 if top >= 128 else 0)))
        for v, top in ((digest[3], digest[4]), (digest[5], digest[6]))
    ]


def in_filter(bits: bytes, digest: bytes) -> bool:
    return all(bits[at] & mask for at, mask in filter_bits(digest))


def older(buckets: int, fill: int) -> dict[bytes, str]:
    """The marks fill_older writes: digest -> owner token, both older slices."""
    return {
        digest: str(owner)
        for slice_id in (1, 2)
        for _, marks in _older_marks(buckets, fill, slice_id)
        for digest, owner in marks.items()
    }


async def filled(server: ManagedProcess, buckets: int, fill: int, **redis: Any) -> Quorum:
    """A quorum of `server` whose member holds two full older slices."""
    settings = load_settings(redis={"nodes": redis_urls([server]), "buckets": buckets, **redis})
    quorum = Quorum(settings.redis, Metrics())
    await quorum.check()
    client = quorum.members[0].client
    assert isinstance(client, aioredis.Redis)
    ttl_ms = int(settings.redis.ttl.total_seconds() * 1000)
    await fill_older(client, quorum.prefix, buckets, fill, ttl_ms)
    return quorum


@pytest.fixture
async def one_server(redis_servers: Any) -> AsyncIterator[ManagedProcess]:
    (server,) = redis_servers(1)
    yield server


async def hget_calls(client: aioredis.Redis) -> int:
    return int((await client.info("commandstats")).get("cmdstat_hget", {}).get("calls", 0))


async def test_a_new_id_outside_its_buckets_filter_skips_the_older_slices(
    one_server: ManagedProcess,
) -> None:
    quorum = await filled(one_server, buckets=1, fill=5)
    try:
        client = quorum.members[0].client
        new = [mark_digest(f"new-{i}".encode()) for i in range(300)]
        before = await hget_calls(client)
        assert await quorum.claim(new, ["7"] * 300) == [[MINE] * 300]
        hgets = await hget_calls(client) - before
        bits = await client.hget("dd:m:3:0", FILTER)
        assert bits is not None and len(bits) == 64
        assert all(in_filter(bits, d) for d in older(1, 5))  # every older mark is in
        # One filter read per new id, and the two older lookups only for the ids
        # whose bits are all set (ten marks in 512 bits: nearly none).
        passing = sum(in_filter(bits, d) for d in new)
        assert hgets == 300 + 2 * passing and passing < 30, (hgets, passing)
    finally:
        await quorum.close()


async def test_no_id_an_older_slice_holds_is_claimed_again(
    one_server: ManagedProcess,
) -> None:
    quorum = await filled(one_server, buckets=20, fill=32)
    try:
        held = older(20, 32)
        new = [mark_digest(f"new-{i}".encode()) for i in range(2000)]
        ids = list(held) + new
        (replies,) = await quorum.claim(ids, ["7"] * len(ids))
        assert replies == list(held.values()) + [MINE] * 2000
        # The buckets written to by the claims all have their filter.
        client = quorum.members[0].client
        assert all([await client.hexists(f"dd:m:3:{k}", FILTER) for k in range(20)])
    finally:
        await quorum.close()


async def test_a_mark_a_rebuild_adds_to_an_older_slice_is_found_though_the_filters_missed_it(
    one_server: ManagedProcess,
) -> None:
    quorum = await filled(one_server, buckets=1, fill=5)
    try:
        assert await quorum.claim([mark_digest(b"first")], ["7"]) == [[MINE]]  # filter built
        late = mark_digest(b"copied-late")
        (inst,) = quorum.members
        assert inst.epoch is not None
        # A copy with a few hours left goes into an older slice (scripts.IMPORT).
        assert await quorum.import_marks(inst, inst.epoch.id, [(late, "5", 3 * 3600_000, "-", 0)]) == [1]
        client = quorum.members[0].client
        assert await client.hlen("dd:m:3:0") == 2  # not into the current slice
        assert await client.hget("dd:slice", "unfiltered:3") == b"1"
        assert await quorum.claim([late], ["8"]) == [["5"]]
    finally:
        await quorum.close()


async def test_older_slices_with_another_bucket_count_are_always_searched(
    one_server: ManagedProcess,
) -> None:
    quorum = await filled(one_server, buckets=4, fill=20)
    try:
        held = older(4, 20)
        changed = Quorum(
            load_settings(redis={"nodes": redis_urls([one_server]), "buckets": 8}).redis, Metrics()
        )
        try:
            (replies,) = await changed.claim(list(held), ["7"] * len(held))
            assert replies == list(held.values())
            client = changed.members[0].client
            filters = {await client.hget(key, FILTER) for key in await client.keys("dd:m:3:*")}
            assert filters == {b"*"}
        finally:
            await changed.close()
    finally:
        await quorum.close()


async def test_a_rebuild_copies_marks_not_filters(
    redis_servers: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    servers = redis_servers(3)
    settings: Settings = load_settings(
        redis={"nodes": redis_urls(servers), "buckets": 2, "timeout": "2s"}
    )
    quorum = Quorum(settings.redis, Metrics())
    try:
        await quorum.check()
        ttl_ms = int(settings.redis.ttl.total_seconds() * 1000)
        for inst in quorum.members:
            assert isinstance(inst.client, aioredis.Redis)
            await fill_older(inst.client, quorum.prefix, 2, 10, ttl_ms)
        new = [mark_digest(f"new-{i}".encode()) for i in range(50)]
        assert await quorum.claim(new, ["7"] * 50) == [[MINE] * 50] * 3
        servers[0].stop()
        servers[0].start()  # empty
        await quorum.check()
        await quorum.check()
        assert await rebuild(settings, servers[0].name_label, source=servers[2].name_label,
                             dry_run=False, output="json") == 0  # fmt: skip
        report = json.loads(capsys.readouterr().out)
        held = older(2, 10)
        assert report["written"] == len(held) + 50
        assert await owners_on(servers[0], list(held) + new) == list(held.values()) + ["7"] * 50
    finally:
        await quorum.close()


async def test_a_call_builds_at_most_48_filters_and_searches_for_the_rest(
    one_server: ManagedProcess,
) -> None:
    quorum = await filled(one_server, buckets=100, fill=4)
    try:
        client = quorum.members[0].client
        new = [mark_digest(f"new-{i}".encode()) for i in range(400)]  # one call, ~98 buckets
        assert await quorum.claim(new, ["7"] * 400) == [[MINE] * 400]
        stats = await client.info("commandstats")
        assert stats["cmdstat_hkeys"]["calls"] == 2 * 48  # two older buckets per build
        built = [await client.hexists(f"dd:m:3:{k}", FILTER) for k in range(100)]
        assert sum(built) == 48
        held = older(100, 4)
        (replies,) = await quorum.claim(list(held), ["8"] * len(held))
        assert replies == list(held.values())
    finally:
        await quorum.close()
