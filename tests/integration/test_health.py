"""The HTTP endpoints of a running gateway, hit over real HTTP."""

from __future__ import annotations

import aiohttp

from devtools.harness import eventually, produce, running
from devtools.topics import wait_committed


async def _status(session: aiohttp.ClientSession, port: int, path: str) -> tuple[int, str]:
    async with session.get(f"http://127.0.0.1:{port}{path}") as response:
        return response.status, await response.text()


async def test_a_gateway_without_partitions_is_ready_when_the_group_outnumbers_them(broker, stack):
    s = await stack(raw_partitions=1)
    topics, settings = s.topics, s.settings
    async with running(settings) as one, running(settings) as two:
        # The group settles: one member owns the single partition, the other none.
        await eventually(
            lambda: len(one.partitions()) + len(two.partitions()) == 1
            and one.source is not None and two.source is not None,
            what="the partition assigned to one of two members",
        )  # fmt: skip
        await produce(broker, topics.raw, [(b"k", b"v", [("message-id", b"m-1")])])
        await wait_committed(broker, topics.group, topics.raw, {0: 1})  # the owner serves
        idle = one if not one.partitions() else two
        assert not idle.partitions()
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
            for gateway in (one, two):
                assert await _status(session, gateway.health.port, "/readyz") == (
                    200,
                    "ready\n",
                )
                assert await _status(session, gateway.health.port, "/healthz") == (
                    200,
                    "ok\n",
                )
