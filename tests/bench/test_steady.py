"""The benchmark's steady state (bench/steady.py) is the product's own layout: after
`fill_older`, a real redis-server's next claim opens a new slice that searches
the older ones written, finds their marks, and fills its own buckets."""

from __future__ import annotations

from typing import Any

import redis.asyncio as aioredis

from bench.steady import _older_marks, fill_older
from devtools.harness import redis_urls
from gateway.config import load_settings
from gateway.contract.tokens import mark_digest
from gateway.metrics import Metrics
from gateway.quorum.quorum import Quorum
from gateway.quorum.scripts import SLICES_BACK
from gateway.rules.vote import MINE


async def test_filled_older_slices_are_searched_by_the_next_claim(redis_servers: Any) -> None:
    (server,) = redis_servers(1)
    buckets, fill = 50, 32
    settings = load_settings(redis={"nodes": redis_urls([server]), "buckets": buckets})
    quorum = Quorum(settings.redis, Metrics())
    try:
        await quorum.check()
        client = quorum.members[0].client
        assert isinstance(client, aioredis.Redis)
        ttl_ms = int(settings.redis.ttl.total_seconds() * 1000)
        written = await fill_older(client, quorum.prefix, buckets, fill, ttl_ms)
        assert written == SLICES_BACK * buckets * fill
        # SLICES_BACK slices of `buckets` buckets, `fill` marks each on average, all expiring.
        for slice_id in range(1, SLICES_BACK + 1):
            keys = await client.keys(f"dd:m:{slice_id}:*")
            sizes = [await client.hlen(key) for key in keys]
            assert len(keys) == buckets and sum(sizes) == buckets * fill
            expiries = [await client.pttl(key) for key in keys]
            assert min(expiries) > ttl_ms - 60_000
        old = [next(iter(marks.items())) for _, marks in _older_marks(buckets, fill, 1)[:3]]
        new = [mark_digest(f"new-{i}".encode()) for i in range(3)]
        replies = await quorum.claim([d for d, _ in old] + new, ["7"] * 6)
        assert replies == [[str(owner) for _, owner in old] + [MINE] * 3]
        current = SLICES_BACK + 1
        older = "".join(f"{k}," for k in range(SLICES_BACK, 0, -1))
        assert await client.hget("dd:slice", "live") == f"{current}:{older}".encode()
        # Sized from the slice before: buckets x fill / 32.
        assert await client.hget("dd:slice", f"buckets:{current}") == str(buckets).encode()
    finally:
        await quorum.close()
