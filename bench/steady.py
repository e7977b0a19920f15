"""A member at steady state before a measured run: its older live slices full.

A member that has run for a `ttl` searches the current slice and SLICES_BACK
older ones, each holding about `[redis] buckets` x marks per bucket. A fresh
member (what a benchmark run starts from) has one slice, nearly empty, so its
Redis CPU per new id is that of small buckets and one lookup. `fill_older`
writes SLICES_BACK full older slices into a member, in the layout the claim
script leaves (gateway/quorum/keys.py: the slice meta's `id`, `live`,
`buckets:<slice>`, `expires:<slice>`, `filter:<slice>`, buckets
`<prefix>m:<slice>:<shard>` and the mark filter `<prefix>f:<slice>` with
their expiry; `filtered=False`: the layout before mark filters, none), and
ends the last one: the next claim opens a new slice
that searches them, and fills its own buckets from empty to `fill` marks each
when the run claims `buckets` x `fill` new ids. Random digests, so a bucket
holds `fill` marks on average, as in production.
"""

from __future__ import annotations

import os
import random

import redis.asyncio as aioredis

from gateway.quorum.scripts import FILTER_BITS_PER_BUCKET, FILTER_MAX_BITS, SLICES_BACK

# Buckets written per pipelined round trip.
_PIPELINE = 256


def shard_of(digest: bytes, buckets: int) -> int:
    """The bucket of a digest (prelude.lua, `hash_of` and `bucket_of`)."""
    return int.from_bytes(digest[:3], "big") % buckets


def filter_bits(buckets: int) -> int:
    """The size of a slice's mark filter (prelude.lua, `open_slice`)."""
    return min(buckets * FILTER_BITS_PER_BUCKET, FILTER_MAX_BITS)


def filter_pos(digest: bytes, bits: int) -> int:
    """A digest's bit in a mark filter (prelude.lua, `filter_pos`)."""
    return int.from_bytes(digest[8:12], "big") % bits


def filter_bytes(digests: list[bytes], bits: int) -> bytes:
    """A mark filter holding `digests`, as Redis stores a bitmap (bit 0: the first
    byte's highest bit)."""
    out = bytearray((bits + 7) // 8)
    for digest in digests:
        pos = filter_pos(digest, bits)
        out[pos // 8] |= 128 >> (pos % 8)
    return bytes(out)


async def fill_older(
    client: aioredis.Redis, prefix: bytes, buckets: int, fill: int, ttl_ms: int,
    filtered: bool = True,
) -> int:  # fmt: skip
    """Write SLICES_BACK older slices of `buckets` x `fill` marks into a member that
    holds none; the marks written. The member's next claim opens a new slice."""
    now_s, now_us = await client.time()
    now = now_s * 1000 + now_us // 1000
    meta = prefix + b"slice"
    rng = random.Random(0)
    written = 0
    older: list[int] = []
    for slice_id in range(1, SLICES_BACK + 1):
        expires = now + ttl_ms
        by_bucket: dict[int, dict[bytes, int]] = {}
        for _ in range(buckets * fill):
            digest = os.urandom(12)
            by_bucket.setdefault(shard_of(digest, buckets), {})[digest] = rng.getrandbits(63)
        items = sorted(by_bucket.items())
        for start in range(0, len(items), _PIPELINE):
            async with client.pipeline(transaction=False) as pipe:
                for shard, marks in items[start : start + _PIPELINE]:
                    key = prefix + b"m:%d:%d" % (slice_id, shard)
                    pipe.hset(key, mapping=marks)  # type: ignore[arg-type]
                    pipe.pexpireat(key, expires)
                await pipe.execute()
        written += buckets * fill
        live = b"%d:" % slice_id + b"".join(b"%d," % k for k in older)
        fields: dict[str, int | bytes] = {
            "id": slice_id,
            "ends": 0,  # ended: the next claim opens the next slice
            f"buckets:{slice_id}": buckets,
            f"expires:{slice_id}": expires,
            "live": live,
        }
        if filtered:
            bits = filter_bits(buckets)
            fields[f"filter:{slice_id}"] = bits
            every = [d for _, marks in items for d in marks]
            await client.set(prefix + b"f:%d" % slice_id, filter_bytes(every, bits), pxat=expires)
        await client.hset(meta, mapping=fields)  # type: ignore[arg-type]
        older.insert(0, slice_id)
    return written
