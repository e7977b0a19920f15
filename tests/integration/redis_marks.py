"""Read marks and epochs straight from one redis-server, with the product's own
scripts (gateway/quorum/scripts.py), for tests that check what an instance holds."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import redis.asyncio as aioredis

from devtools.localstack import ManagedProcess
from gateway.config import load_settings
from gateway.metrics import Metrics
from gateway.quorum.keys import Epoch
from gateway.quorum.quorum import Quorum


@asynccontextmanager
async def alone(server: ManagedProcess, **redis: Any) -> AsyncIterator[Quorum]:
    """A quorum of just this server (what one gateway's call to it does)."""
    settings = load_settings(redis={"nodes": [f"redis://127.0.0.1:{server.port}/0"], **redis})
    quorum = Quorum(settings.redis, Metrics())
    try:
        yield quorum
    finally:
        await quorum.close()


async def owners_on(server: ManagedProcess, digests: Sequence[bytes]) -> list[str | None]:
    """The owner of each digest's live mark on `server` (None: none), default settings."""
    async with alone(server) as quorum:
        out: list[str | None] = []
        for a in range(0, len(digests), 2000):
            chunk = digests[a : a + 2000]
            reply = await quorum.admin.lookup(quorum.members[0], chunk)
            assert reply is not None, f"{server.name} does not answer"
            out.extend(owner.decode() or None for owner, _ in reply)
        return out


async def epoch_on(server: ManagedProcess, prefix: bytes = b"dd:") -> Epoch | None:
    async with aioredis.Redis(port=server.port) as client:
        raw = await client.get(prefix + b"epoch")
    return Epoch.parse(raw.decode()) if raw else None


async def noted_behind_on(server: ManagedProcess, prefix: bytes = b"dd:") -> dict[str, str]:
    """The notes that members are behind held on `server` (gateway/quorum/behind.py):
    `<member>|<run id>` -> until (ms)."""
    async with aioredis.Redis(port=server.port, decode_responses=True) as client:
        notes: dict[str, str] = await client.hgetall(prefix.decode() + "behind")
    return notes
