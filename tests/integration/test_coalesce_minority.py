"""A coalescing window update that fewer than a majority of members took
(gateway/delay/coalescer.py, `_update_on_a_majority`): what the guarantee row says."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from devtools.harness import Topics, redis_urls
from gateway.delay.coalescer import UPDATE_TRIES, Coalescer, now_ms
from gateway.metrics import Metrics
from gateway.quorum.quorum import Quorum
from tests.integration.test_coalesce import coalesce_settings


async def test_a_window_update_a_minority_took_goes_on_after_its_rounds(
    redis_servers: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Two of three members refuse the update (paused between the vote and it): after
    UPDATE_TRIES rounds the record goes on with the window the one member gave, a
    WARNING per round; its close then needs a counted majority (`at_close`)."""
    servers = redis_servers(3)
    settings = coalesce_settings("127.0.0.1:1", Topics(lambda n: n), redis_urls(servers))
    quorum = Quorum(settings.redis, Metrics())
    try:
        await quorum.check()
        for member in quorum.members[1:]:
            assert await quorum.admin.pause(member, True)  # its writes are refused
        coalescer = Coalescer(settings, quorum.windows, quorum, quorum.metrics)
        ts = now_ms()
        headers = [("entity-id", b"e-1"), ("dedup-source", b"raw/0/7")]
        with caplog.at_level(logging.WARNING):
            ((row, due),) = await coalescer.update([(b"k", b"v", ts, headers, 0)])
        rounds = [r for r in caplog.records if "coalesce update taken by 1 of 3" in r.message]
        assert len(rounds) == UPDATE_TRIES
        assert any(k == "dedup-window" for k, _ in row[3])
        assert due >= ts
    finally:
        await quorum.close()
