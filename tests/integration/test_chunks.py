"""Claims travel in chunks: a batch of any allowed size is claimed in calls that
each hold an instance briefly, within `[redis] timeout`, and a chunk that fails
costs only its own digests (gateway/quorum/transport.py, gateway/quorum/scripts.py)."""

from __future__ import annotations

from typing import Any

import pytest
import redis.asyncio as aioredis

from devtools.harness import counter_value
from gateway import sizing
from gateway.config import ConfigError, KafkaSettings, load_settings
from gateway.contract.tokens import mark_digest
from gateway.rules.vote import MINE
from tests.integration.redis_marks import alone

LARGEST = KafkaSettings.model_fields["max_batch_records"].metadata[1].le  # 100,000


async def test_the_largest_batch_is_claimed_in_short_calls_within_the_timeout(
    redis_servers: Any,
) -> None:
    (server,) = redis_servers(1)
    ids = [mark_digest(f"big-{i}".encode()) for i in range(LARGEST)]
    async with alone(server, timeout="1s") as quorum, aioredis.Redis(port=server.port) as r:
        await quorum.check()
        await r.config_set("slowlog-log-slower-than", 250_000)  # usec: any call over 250 ms
        await r.slowlog_reset()
        await r.config_resetstat()
        assert await quorum.claim(ids, [str(i + 1) for i in range(LARGEST)]) == [[MINE] * LARGEST]
        stats = (await r.info("commandstats"))["cmdstat_evalsha"]
        # one per chunk (NOSCRIPT replies, before the script is loaded, fail)
        assert stats["calls"] - stats["failed_calls"] == LARGEST // sizing.CHUNK_DIGESTS
        # No call held the instance long (one call of the whole batch takes seconds).
        assert [e for e in await r.slowlog_get(128) if b"EVALSHA" in e["command"]] == []
        again = await quorum.claim(ids[:3], ["7", "8", "9"])
        assert again == [["1", "2", "3"]]
        assert counter_value(quorum.metrics.redis_errors, server.name_label, "timeout") == 0


async def test_a_chunk_that_fails_is_no_answer_for_its_own_digests_only(
    redis_servers: Any,
) -> None:
    (server,) = redis_servers(1)
    n = 20 * sizing.CHUNK_DIGESTS
    ids = [mark_digest(f"oom-{i}".encode()) for i in range(n)]
    async with alone(server, buckets=1_000_000) as quorum, aioredis.Redis(port=server.port) as r:
        await quorum.check()
        used = (await r.info("memory"))["used_memory"]
        # Full partway through the batch: the chunks that start after it fail (OOM).
        await r.config_set("maxmemory", used + 400_000)
        await r.config_set("maxmemory-policy", "noeviction")
        (replies,) = await quorum.claim(ids, [str(i + 1) for i in range(n)])
        chunks = [replies[a : a + sizing.CHUNK_DIGESTS] for a in range(0, n, sizing.CHUNK_DIGESTS)]
        answered = [c == [MINE] * len(c) for c in chunks]
        failed = [c == [None] * len(c) for c in chunks]
        assert all(a or f for a, f in zip(answered, failed, strict=True)), "a chunk split"
        assert any(answered) and any(failed)
        assert counter_value(quorum.metrics.redis_errors, server.name_label, "response") > 0
        await r.config_set("maxmemory", 0)
        (retried,) = await quorum.claim(ids, [str(i + 1) for i in range(n)])
        assert retried == [MINE] * n  # the answered ones are replays of their own claims


@pytest.mark.parametrize("timeout", ["1ms", f"{sizing.MIN_TIMEOUT_MS - 1}ms"])
def test_a_timeout_too_short_for_one_round_trip_is_refused_at_start(timeout: str) -> None:
    with pytest.raises(ConfigError) as refused:
        load_settings(redis={"timeout": timeout})
    message = str(refused.value)
    assert message.startswith("invalid setting redis.timeout:")
    assert f"{sizing.CHUNK_DIGESTS} digests" in message
    assert load_settings(redis={"timeout": f"{sizing.MIN_TIMEOUT_MS}ms"})
