"""The mark scripts against a real redis-server: claim, expiry by time slice,
compare-and-delete, memory per mark, settings changes (gateway/quorum/scripts.py).
Epochs, fills and rebuilds: test_epochs.py, test_repair_queue.py."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import redis.asyncio as aioredis

from devtools.harness import redis_urls
from gateway.config import load_settings
from gateway.contract.tokens import mark_digest, owner_token
from gateway.metrics import Metrics
from gateway.quorum.admin import MarkView
from gateway.quorum.keys import handover_key
from gateway.quorum.quorum import Quorum
from gateway.rules.commands import Handover
from gateway.rules.vote import MINE

QuorumFactory = Callable[..., Quorum]


@pytest.fixture
async def quorum_on(redis_servers: Any, claim_path: str) -> AsyncIterator[QuorumFactory]:
    """Quorums over one fresh redis-server, with the given `[redis]` settings; every
    test here runs with the Lua claim and with the native one (`claim_path`)."""
    (server,) = redis_servers(1, native=claim_path == "module")
    made: list[Quorum] = []

    def make(**redis: Any) -> Quorum:
        settings = load_settings(redis={"nodes": redis_urls([server]), "claim": claim_path,
                                        **redis})  # fmt: skip
        made.append(Quorum(settings.redis, Metrics()))
        return made[-1]

    yield make
    for quorum in made:
        await quorum.close()
    for quorum in made:  # the path asked for is the one that ran (or none: no claim made)
        assert {m.claim_path for m in quorum.members} <= {"", claim_path}


def digests(prefix: str, n: int) -> list[bytes]:
    return [mark_digest(f"{prefix}-{i}".encode()) for i in range(n)]


async def test_a_new_id_is_claimed_a_replay_is_its_owner_and_a_copy_sees_the_owner(
    quorum_on: QuorumFactory,
) -> None:
    quorum = quorum_on()
    a, b = digests("id", 2)
    assert await quorum.claim([a, b], ["11", "12"]) == [[MINE, MINE]]
    assert await quorum.claim([a], ["11"]) == [[MINE]]  # the same source record again
    assert await quorum.claim([a, b], ["21", "22"]) == [["11", "12"]]
    # Two copies in one batch: the first claims, the second sees it.
    c = mark_digest(b"id-c")
    assert await quorum.claim([c, c], ["31", "32"]) == [[MINE, "31"]]


async def test_a_mark_lives_at_least_the_ttl_across_slices_then_expires(
    quorum_on: QuorumFactory,
) -> None:
    quorum = quorum_on(ttl="2s")  # slices of 2 s: the mark lives 2 to 4 s
    (mark,) = digests("expiring", 1)
    claimed_at = time.monotonic()
    assert await quorum.claim([mark], ["7"]) == [[MINE]]
    filler = iter(digests("filler", 1000))
    seen_after: list[float] = []
    while (elapsed := time.monotonic() - claimed_at) < 5:
        # Other claims keep opening new slices while time passes.
        await quorum.claim([next(filler)], ["8"])
        (view,) = await quorum.admin.inspect(mark)
        assert view is not None
        if view.owner == "7":
            seen_after.append(time.monotonic() - claimed_at)
        else:
            assert elapsed >= 2, f"the mark vanished {elapsed:.2f}s after its claim"
        await asyncio.sleep(0.1)  # time passing is what is under test
    assert seen_after and max(seen_after) > 1.5, "the mark was not found in a later slice"
    assert max(seen_after) < 4.2, "the mark outlived ttl + one slice"
    assert await quorum.claim([mark], ["9"]) == [[MINE]]  # expired: new again


async def test_lowering_ttl_keeps_a_mark_searchable_for_the_ttl_it_was_claimed_under(
    quorum_on: QuorumFactory,
) -> None:
    before, after = quorum_on(ttl="4s"), quorum_on(ttl="1s")  # slices of 4 s, then 1 s
    meta, client = after.prefix + b"slice", after.members[0].client
    filler = iter(digests("lowered-filler", 1000))
    await before.claim([next(filler)], ["8"])  # opens a 4 s slice
    ends = int(await client.hget(meta, "ends") or 0)
    now_s, now_us = await client.time()
    # Claimed near the end of its slice, so the lower ttl's slices open soon after.
    await asyncio.sleep(max(0.0, (ends - now_s * 1000 - now_us // 1000) / 1000 - 0.3))
    (mark,) = digests("lowered", 1)
    claimed_at = time.monotonic()
    assert await before.claim([mark], ["7"]) == [[MINE]]
    opened_from = int(await client.hget(meta, "id") or 0)
    while time.monotonic() - claimed_at < 3.4:
        # The lower ttl's short slices open one after another while time passes.
        await after.claim([next(filler)], ["8"])
        await asyncio.sleep(0.05)  # time passing is what is under test
    assert int(await client.hget(meta, "id") or 0) - opened_from > 2, "too few slices opened"
    # 3.4 s after its claim under a 4 s ttl, past more than SLICES_BACK newer slices.
    assert await after.claim([mark], ["9"]) == [["7"]]
    (view,) = await after.admin.inspect(mark)
    assert view is not None and view.owner == "7"
    while time.monotonic() - claimed_at < 4.8:  # its slice's buckets expired (end + 4 s)
        await after.claim([next(filler)], ["8"])
        await asyncio.sleep(0.05)
    # The old slice left the search: only the short slices still alive are searched.
    live = (await client.hget(meta, "live") or b"").decode()
    assert live.count(",") <= 3, live
    assert await after.claim([mark], ["9"]) == [[MINE]]


async def test_release_frees_the_id_for_another_copy_but_not_for_a_replay_of_the_released_record(
    quorum_on: QuorumFactory,
) -> None:
    quorum = quorum_on()
    a, b, c = digests("rel", 3)
    await quorum.claim([a, b, c], ["1", "2", "5"])
    assert await quorum.release([a, b, c], ["1", "999", "5"]) == [[1, 0, 1]]
    assert await quorum.release([a], ["1"]) == [[2]]  # a second copy: released already
    assert await quorum.release(digests("never-claimed", 1), ["1"]) == [[3]]  # no live mark
    # The released record replayed (a gateway re-reading an uncommitted batch) stays a
    # duplicate of the release, so it cannot take the id back under its old token.
    assert await quorum.claim([a], ["1"]) == [["-1"]]
    (view,) = await quorum.admin.inspect(a)
    assert view is not None and view.owner == "-1"
    # The producer's next copy takes it, and is told whose release it took over.
    assert await quorum.claim([a, b], ["3", "4"]) == [["=1", "2"]]
    assert await quorum.claim([a], ["1"]) == [["3"]]
    assert await quorum.release([a], ["1"]) == [[0]]  # stale: the id is held again
    # A released mark is handed to a retry's next attempt like an absent one.
    assert await quorum.handover([Handover(c, "5", "6", "failures/0/1")]) == [[1]]
    assert await quorum.claim([c], ["5"]) == [["6"]]


async def test_a_released_mark_in_an_older_slice_frees_the_id_the_same_way(
    quorum_on: QuorumFactory,
) -> None:
    quorum = quorum_on(ttl="2s")  # slices of 1 s
    (mark,) = digests("rel-old", 1)
    assert await quorum.claim([mark], ["1"]) == [[MINE]]
    assert await quorum.release([mark], ["1"]) == [[1]]
    filler = iter(digests("rel-filler", 100))
    meta, client = quorum.prefix + b"slice", quorum.members[0].client
    slice_of_release = await client.hget(meta, "id")
    assert slice_of_release is not None
    while await client.hget(meta, "id") == slice_of_release:
        await quorum.claim([next(filler)], ["8"])  # opens the next slice once 1 s passed
        await asyncio.sleep(0.05)
    assert await quorum.claim([mark], ["1"]) == [["-1"]]
    assert await quorum.claim([mark], ["3"]) == [["=1"]]  # taken over the older slice's tombstone
    assert await quorum.claim([mark], ["1"]) == [["3"]]


async def test_a_handover_moves_the_mark_and_a_second_copy_of_the_command_does_nothing(
    quorum_on: QuorumFactory,
) -> None:
    quorum = quorum_on()
    (mark,) = digests("hand", 1)
    await quorum.claim([mark], ["1"])

    def command(ref: str, failed: str = "1", nxt: str = "2") -> list[Handover]:
        return [Handover(mark, failed, nxt, ref)]

    assert await quorum.handover(command("failures/0/5")) == [[1]]
    assert await quorum.handover(command("failures/0/5")) == [[2]]  # crash replay
    # Another copy of the command is answered the ref of the copy that moved the mark.
    assert await quorum.handover(command("failures/1/9")) == [["failures/0/5"]]
    assert await quorum.handover(command("failures/0/1")) == [["failures/0/5"]]
    await quorum.mark_done([mark], ["failures/0/5"])
    assert await quorum.handover(command("failures/0/5")) == [[4]]
    assert await quorum.handover(command("failures/1/9")) == [["failures/0/5"]]
    assert await quorum.handover(command("failures/0/6", "77", "78")) == [[0]]  # stale
    assert await quorum.claim([mark], ["5"]) == [["2"]]


async def test_a_member_still_holding_an_earlier_attempt_is_handed_over_another_owner_is_not(
    quorum_on: QuorumFactory,
) -> None:
    """A member that missed the handover to attempt 2 still holds attempt 1's token
    when attempt 2's command comes: it is brought to attempt 3 with the others."""
    quorum = quorum_on()
    behind, other = digests("behind", 2)
    await quorum.claim([behind, other], ["11", "99"])
    attempt_2_failed = Handover(behind, "12", "13", "failures/0/7", earlier=("11",))
    assert await quorum.handover([attempt_2_failed]) == [[1]]
    assert await quorum.claim([behind], ["5"]) == [["13"]]
    # A copy of attempt 1's command, late: a later attempt holds the mark (5), unchanged.
    late = Handover(behind, "11", "12", "failures/0/2", later=("13", "14"))
    assert await quorum.handover([late]) == [[5]]
    assert await quorum.claim([behind], ["5"]) == [["13"]]
    # A source's earlier tokens never name another source's owner: stale, unchanged.
    assert await quorum.handover([Handover(other, "12", "13", "failures/0/8", ("11",))]) == [[0]]
    assert await quorum.claim([other], ["5"]) == [["99"]]


async def test_a_replay_of_a_handover_finds_its_note_for_as_long_as_the_mark_lives(
    quorum_on: QuorumFactory,
) -> None:
    """The note naming the command that handed a mark over lives as long as the mark
    (up to a slice past `ttl`). It used to live `ttl`: a replay of the command after
    that, the mark still held by the next attempt, read as another copy's handover and
    was skipped, so the retry was never done (chaos seed 9510: a gateway killed
    before its retry, replayed 108 s later under a 75 s ttl)."""
    quorum = quorum_on(ttl="4s")  # slices of 2 s: a mark lives 4 to 6 s
    (mark,) = digests("noted", 1)
    assert await quorum.claim([mark], ["1"]) == [[MINE]]
    meta, client = quorum.prefix + b"slice", quorum.members[0].client
    opened = int(await client.hget(meta, "id") or 0)
    filler = iter(digests("noted-filler", 1000))
    while int(await client.hget(meta, "id") or 0) == opened:  # a slice opens: the
        await quorum.claim([next(filler)], ["8"])  # handover lands early in it
        await asyncio.sleep(0.02)
    command = [Handover(mark, "1", "2", "failures/0/5")]
    assert await quorum.handover(command) == [[1]]
    handed_at = time.monotonic()
    (view,) = await quorum.admin.inspect(mark)
    note = await client.pttl(handover_key(quorum.prefix, mark))
    assert view is not None and view.owner == "2"
    assert note >= view.ttl_ms - 50, (note, view.ttl_ms)
    while time.monotonic() - handed_at < 4.3:  # past `ttl`, within the mark's life
        await quorum.claim([next(filler)], ["8"])
        await asyncio.sleep(0.05)  # time passing is what is under test
    (view,) = await quorum.admin.inspect(mark)
    assert view is not None and view.owner == "2", "the mark expired: the slice opened late"
    assert await quorum.handover(command) == [[2]]  # a crash replay: redo the retry
    another_copy = [Handover(mark, "1", "2", "failures/1/9")]
    assert await quorum.handover(another_copy) == [["failures/0/5"]]


async def test_changing_ttl_or_bucket_count_keeps_the_marks_already_claimed(
    quorum_on: QuorumFactory,
) -> None:
    ids = digests("kept", 50)
    assert await quorum_on(ttl="24h").claim(ids, ["1"] * 50) == [[MINE] * 50]
    assert await quorum_on(ttl="12h").claim(ids, ["2"] * 50) == [["1"] * 50]
    # Each slice keeps the bucket count it opened with.
    assert await quorum_on(ttl="24h", buckets=7).claim(ids, ["3"] * 50) == [["1"] * 50]


async def test_a_claim_after_raising_ttl_lives_the_new_ttl_and_lowering_shortens_nothing(
    quorum_on: QuorumFactory,
) -> None:
    hour = 3600 * 1000
    a, b, c = digests("ttl", 3)
    # One bucket per slice, so that every claim below lands in the same bucket.
    assert await quorum_on(ttl="1h", buckets=1).claim([a], ["1"]) == [[MINE]]
    (view,) = await quorum_on(ttl="1h", buckets=1).admin.inspect(a)
    assert view is not None and view.ttl_ms <= 2 * hour
    # Raised: the slice keeps its length, but what is claimed now lives 24 h at least.
    assert await quorum_on(ttl="24h", buckets=1).claim([b], ["2"]) == [[MINE]]
    (view,) = await quorum_on(ttl="24h", buckets=1).admin.inspect(b)
    assert view is not None and 24 * hour - 5000 <= view.ttl_ms <= 25 * hour
    # Lowered again: marks already there keep their longer life.
    assert await quorum_on(ttl="1h", buckets=1).claim([c], ["3"]) == [[MINE]]
    (view,) = await quorum_on(ttl="1h", buckets=1).admin.inspect(a)
    assert view is not None and view.ttl_ms >= 24 * hour - 5000


async def test_a_bucket_expiry_is_read_once_per_slice_and_every_bucket_expires(
    quorum_on: QuorumFactory,
) -> None:
    """The expiry ledger (scripts.ledger_of): a bucket's PTTL is read the first time
    the slice writes to it, not once per call; every bucket still has an expiry."""
    quorum = quorum_on(buckets=16)  # 400 marks: no bucket past 32, none split
    redis: aioredis.Redis = quorum.members[0].client

    async def pttl_calls() -> int:
        """Expiry reads: the Lua claim's PTTL calls, the native claim's own count."""
        lua = (await redis.info("commandstats")).get("cmdstat_pttl", {}).get("calls", 0)
        return int(lua) + int((await redis.info("dedup")).get("dedup_expiry_reads", 0))

    assert await quorum.claim(digests("first", 200), ["1"] * 200) == [[MINE] * 200]
    assert await pttl_calls() == 16  # one per bucket
    assert await quorum.claim(digests("second", 200), ["2"] * 200) == [[MINE] * 200]
    assert await pttl_calls() == 16  # the ledger knows all of them
    buckets = await redis.keys("dd:m:*")
    assert len(buckets) == 16
    expiries = [await redis.pttl(key) for key in buckets]
    assert all(0 < left <= 48 * 3600 * 1000 for left in expiries), expiries
    (ledger,) = await redis.keys("dd:x:*")
    assert abs(await redis.pttl(ledger) - expiries[0]) < 5000  # it goes with them


async def ledger_bits(redis: aioredis.Redis, key: bytes, buckets: int) -> list[int]:
    """The expiry ledger's bit per bucket (prelude.lua, `ledger_of`)."""
    raw = await redis.get(key) or b""
    return [(raw[i // 8] >> (7 - i % 8)) & 1 if i // 8 < len(raw) else 0 for i in range(buckets)]


async def test_a_slice_splits_its_buckets_to_about_32_marks_each_and_finds_every_mark(
    quorum_on: QuorumFactory,
) -> None:
    """Linear hashing (prelude.lua, `grow`): one bucket set in `buckets` ends at ~32
    marks per bucket; every mark is found where it moved, every bucket expires, and
    the ledger has a bit for every bucket there is."""
    quorum = quorum_on(buckets=1)
    redis: aioredis.Redis = quorum.members[0].client
    ids = digests("split", 6000)
    for start in range(0, len(ids), 1000):
        chunk = ids[start : start + 1000]
        assert await quorum.claim(chunk, ["1"] * len(chunk)) == [[MINE] * len(chunk)]
    ((marks, buckets),) = await quorum.slice_fill()  # type: ignore[misc]
    assert (marks, buckets) == (6000, 188)  # 6000 / 32 = 187.5
    assert await quorum.claim(ids, ["2"] * len(ids)) == [["1"] * len(ids)]
    keys = await redis.keys("dd:m:1:*")
    sizes = [await redis.hlen(key) for key in keys]
    assert len(keys) == buckets and sum(sizes) == 6000 and max(sizes) <= 96, max(sizes)
    assert all([await redis.pttl(key) > 0 for key in keys])
    bits = await ledger_bits(redis, b"dd:x:1", buckets)
    assert bits == [1] * buckets
    assert int(await redis.hget("dd:slice", "grown:1") or 0) == buckets


async def test_a_split_that_empties_its_bucket_clears_its_ledger_bit(
    quorum_on: QuorumFactory,
) -> None:
    """Every mark of bucket 0 moves to bucket 1 (odd hashes): Redis deletes bucket 0,
    so its ledger bit is cleared and the next mark there gives it an expiry again."""
    quorum = quorum_on(buckets=1)
    redis: aioredis.Redis = quorum.members[0].client
    odd = [bytes([0, 0, 2 * i + 1]) + b"o" * 9 for i in range(33)]  # hash_of: first 3 bytes
    assert await quorum.claim(odd, ["1"] * 33) == [[MINE] * 33]
    assert await redis.exists("dd:m:1:0") == 0 and await redis.hlen("dd:m:1:1") == 33
    assert await ledger_bits(redis, b"dd:x:1", 2) == [0, 1]
    even = bytes([0, 0, 2]) + b"e" * 9
    assert await quorum.claim([even], ["2"]) == [[MINE]]
    assert await redis.pttl("dd:m:1:0") > 0
    assert await ledger_bits(redis, b"dd:x:1", 2) == [1, 1]
    assert await quorum.claim([*odd, even], ["3"] * 34) == [["1"] * 33 + ["2"]]


async def test_a_rebuild_import_splits_the_buckets_it_fills(quorum_on: QuorumFactory) -> None:
    """A member rebuilt from empty opens its slices with `buckets` (here 1): the import
    splits them as it writes, as claims do, so no bucket ends at thousands of marks."""
    quorum = quorum_on(buckets=1)
    redis: aioredis.Redis = quorum.members[0].client
    await quorum.check()  # its epoch, which import expects
    member = quorum.members[0]
    assert member.epoch is not None
    day = 24 * 3600 * 1000
    current, older = digests("in-current", 2000), digests("in-older", 2000)
    marks = [(d, "5", 2 * day - 2000, "-", 0, "", "") for d in current]  # lives past this slice
    marks += [(d, "5", day - 2000, "-", 0, "", "") for d in older]  # into the slice before
    for start in range(0, len(marks), 500):
        chunk = marks[start : start + 500]
        assert await quorum.admin.import_marks(member, member.epoch.id, chunk) == [1] * len(chunk)
    for slice_id in (1, 0):
        keys = await redis.keys(f"dd:m:{slice_id}:*")
        sizes = [await redis.hlen(key) for key in keys]
        assert sum(sizes) == 2000 and len(keys) >= 2000 // 32 and max(sizes) <= 96, max(sizes)
        assert all([await redis.pttl(key) > 0 for key in keys])
    assert await quorum.claim(current + older, ["6"] * 4000) == [["5"] * 4000]


async def test_a_new_slice_is_sized_from_the_marks_of_the_one_before(
    quorum_on: QuorumFactory,
) -> None:
    quorum = quorum_on(ttl="1s", buckets=3)  # slices of 1 s
    redis: aioredis.Redis = quorum.members[0].client
    ids = digests("sized", 3200)
    assert await quorum.claim(ids, ["1"] * 3200) == [[MINE] * 3200]
    first = int(await redis.hget("dd:slice", "id") or 0)
    filler = iter(digests("sized-filler", 100))
    while int(await redis.hget("dd:slice", "id") or 0) == first:
        await quorum.claim([next(filler)], ["2"])
        await asyncio.sleep(0.05)  # time passing is what is under test
    # Opened after a slice of 3,200 marks (and a few fillers): 3,2xx / 32 buckets.
    marks = int(await redis.hget("dd:slice", f"marks:{first}") or 0)
    assert 3200 <= marks < 3300
    assert int(await redis.hget("dd:slice", f"buckets:{first + 1}") or 0) == -(-marks // 32)


async def test_a_handover_in_the_current_slice_keeps_its_bucket_expiry(
    quorum_on: QuorumFactory,
) -> None:
    """A mark alone in its bucket, handed over in the slice that holds it: the
    bucket is rewritten, never emptied and created again without an expiry while
    the ledger says it has one."""
    quorum = quorum_on()  # 16,384 buckets: the mark is alone in its bucket
    (mark,) = digests("alone", 1)
    assert await quorum.claim([mark], ["1"]) == [[MINE]]
    assert await quorum.handover([Handover(mark, "1", "2", "failures/0/1")]) == [[1]]
    (view,) = await quorum.admin.inspect(mark)
    assert view is not None and view.owner == "2" and view.ttl_ms > 0


async def test_a_mark_costs_a_fraction_of_a_key_per_id_whatever_the_bucket_setting(
    quorum_on: QuorumFactory,
) -> None:
    # The numbers quoted in docs/operations.md ("Sizing Redis") come from here. A
    # slice splits its buckets as it fills (prelude.lua, `grow`), so `buckets` set
    # for ~32 marks each, for ~300 or to 1 ends at ~32 per bucket all the same
    # (bench/RESULTS.md, "The mark store, round 2"); ~300 cost about twice the Redis
    # CPU per new id.
    sized = await bytes_per_mark(quorum_on(buckets=625), digests("mem", 20_000), "listpack")
    low = await bytes_per_mark(quorum_on(buckets=64), digests("low", 20_000), "listpack")
    one = await bytes_per_mark(quorum_on(buckets=1), digests("one", 20_000), "listpack")
    assert max(sized, low, one) < 45, f"{sized:.1f} sized, {low:.1f} from 64, {one:.1f} from 1"


async def held(redis: aioredis.Redis) -> int:
    """Redis memory less its clients' buffers: a claim call's arguments stay in the
    connection's query buffer until Redis trims it (when the connection idles), which
    otherwise counted ~3 bytes per mark in some runs and not in others."""
    stats = await redis.memory_stats()
    return int(stats["total.allocated"]) - int(stats["clients.normal"])


async def bytes_per_mark(quorum: Quorum, ids: list[bytes], encoding: str) -> float:
    """Claim `ids` with realistic owner tokens on an empty instance; Redis memory
    growth per mark. Checks every claim, a lookup, and the buckets' encoding.

    One batch of other ids goes first, so that what is allocated once (the
    connection's buffers, the script cache, the slice meta, the epoch) is not
    counted per mark."""
    redis: aioredis.Redis = quorum.members[0].client
    await redis.flushall()
    owner = owner_token("raw", 0, 1)  # 19 digits, as in production
    warm = digests("warm-up", 2000)
    assert await quorum.claim(warm, [owner] * len(warm)) == [[MINE] * len(warm)]
    before = await held(redis)
    for start in range(0, len(ids), 2000):
        batch = ids[start : start + 2000]
        assert await quorum.claim(batch, [owner] * len(batch)) == [[MINE] * len(batch)]
    grown = await held(redis) - before
    assert await quorum.claim(ids[:100], ["2"] * 100) == [[owner] * 100]
    (view,) = await quorum.admin.inspect(ids[-1])
    assert view == MarkView(owner, view.ttl_ms, encoding, None) and view.ttl_ms > 0
    ((marks, buckets),) = await quorum.slice_fill()  # type: ignore[misc]
    assert marks == len(warm) + len(ids) and 16 <= marks / buckets <= 32, (marks, buckets)
    return grown / len(ids)
