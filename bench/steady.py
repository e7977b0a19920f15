"""A member at steady state before a measured run: its older live slices full.

A member that has run for a `ttl` searches the current slice and SLICES_BACK
older ones, each holding about `[redis] buckets` x marks per bucket. A fresh
member (what a benchmark run starts from) has one slice, nearly empty, so its
Redis CPU per new id is that of small buckets and one lookup. `fill_older`
writes SLICES_BACK full older slices into a member, in the layout the claim
script leaves (gateway/quorum/keys.py: the slice meta's `id`, `live`,
`buckets:<slice>`, `expires:<slice>`, buckets `<prefix>m:<slice>:<shard>`
with their expiry), and ends the last one: the next claim opens a new slice
that searches them, and fills its own buckets from empty to `fill` marks each
when the run claims `buckets` x `fill` new ids. Random digests, so a bucket
holds `fill` marks on average, as in production; the next slice opens with
`buckets` x `fill` / 32 buckets, as one opened after such a slice does (and
splits them as it fills past ~32 each). The marks of a (buckets,
fill) are generated once per process and written to every member, which
holds every mark in production too.
"""

from __future__ import annotations

import random
from functools import lru_cache

import redis.asyncio as aioredis

from gateway.quorum.scripts import SLICES_BACK

# The marks per bucket docs/operations.md ("Sizing Redis") recommends: what
# `python -m bench` fills members to unless `--fill` says otherwise.
SIZING_FILL = 32
# Buckets written per pipelined round trip.
_PIPELINE = 256


def shard_of(digest: bytes, buckets: int) -> int:
    """The bucket of a digest (prelude.lua, `hash_of` and `bucket_of`)."""
    return int.from_bytes(digest[:3], "big") % buckets


@lru_cache(maxsize=4)
def _older_marks(buckets: int, fill: int, slice_id: int) -> list[tuple[int, dict[bytes, int]]]:
    """(bucket, {digest: owner token}) of one older slice, sorted by bucket."""
    rng = random.Random(f"{buckets}/{fill}/{slice_id}")
    by_bucket: dict[int, dict[bytes, int]] = {}
    for _ in range(buckets * fill):
        digest = rng.randbytes(12)
        by_bucket.setdefault(shard_of(digest, buckets), {})[digest] = rng.getrandbits(63)
    return sorted(by_bucket.items())


async def fill_older(
    client: aioredis.Redis, prefix: bytes, buckets: int, fill: int, ttl_ms: int
) -> int:
    """Write SLICES_BACK older slices of `buckets` x `fill` marks into a member that
    holds none; the marks written. The member's next claim opens a new slice."""
    now_s, now_us = await client.time()
    now = now_s * 1000 + now_us // 1000
    meta = prefix + b"slice"
    written = 0
    older: list[int] = []
    for slice_id in range(1, SLICES_BACK + 1):
        expires = now + ttl_ms
        items = _older_marks(buckets, fill, slice_id)
        for start in range(0, len(items), _PIPELINE):
            async with client.pipeline(transaction=False) as pipe:
                for shard, marks in items[start : start + _PIPELINE]:
                    key = prefix + b"m:%d:%d" % (slice_id, shard)
                    pipe.hset(key, mapping=marks)  # type: ignore[arg-type]
                    pipe.pexpireat(key, expires)
                await pipe.execute()
        written += buckets * fill
        live = b"%d:" % slice_id + b"".join(b"%d," % k for k in older)
        fields = {
            "id": slice_id,
            "ends": 0,  # ended: the next claim opens the next slice
            f"buckets:{slice_id}": buckets,
            f"marks:{slice_id}": buckets * fill,  # sizes the next slice (prelude.lua)
            f"expires:{slice_id}": expires,
            "live": live,
        }
        await client.hset(meta, mapping=fields)  # type: ignore[arg-type]
        older.insert(0, slice_id)
    return written
