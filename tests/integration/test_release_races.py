"""A release runs on each member in turn, so claims and repairs race it: whatever
the order, a released token never owns its id again, and the next copy is new.

Three redis-servers, the third restarted empty (recovering, not counted), as in
chaos seed 19, where the two trusted members split 1:1 and the tie rule had the
last word: a replay of the released record was forwarded under the token the
job had already processed, and every later copy was a duplicate of it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from devtools.harness import redis_urls
from devtools.localstack import ManagedProcess
from gateway.config import load_settings
from gateway.contract.tokens import mark_digest
from gateway.metrics import Metrics
from gateway.quorum.quorum import Quorum
from gateway.raw.pipeline import Pipeline
from gateway.rules.vote import Outcome
from tests.integration.redis_marks import alone, owners_on
from tests.integration.test_epochs import restart_empty, vote

Servers = list[ManagedProcess]
# Owner tokens: the failed record's, then two later copies' (all 19 digits, T the
# smallest, so the tie rule alone would pick T).
T, U1, U2 = "4000000000000000000", "5000000000000000000", "6000000000000000000"


@pytest.fixture
async def recovering_third(
    redis_servers: Any, claim_path: str
) -> AsyncIterator[tuple[Servers, Pipeline]]:
    """Three members, the third restarted empty: two trusted members decide; with the
    Lua claim and with the native one (`claim_path`)."""
    servers = redis_servers(3, native=claim_path == "module")
    # Every call here must be answered: one timed out on a loaded machine would queue
    # its repair as a fill, and the race each test stages would not be the one it says.
    settings = load_settings(
        redis={"nodes": redis_urls(servers), "timeout": "10s", "claim": claim_path}
    )
    quorum = Quorum(settings.redis, Metrics())
    await quorum.check()
    await quorum.claim([mark_digest(b"before")], ["1"])  # the members hold marks
    restart_empty(servers[2])
    for _ in range(2):  # the first read meets the closed connection
        await quorum.check()
    assert quorum.counted() == [True, True, False]
    try:
        yield servers, Pipeline(settings, quorum, None, quorum.metrics)  # type: ignore[arg-type]
    finally:
        await quorum.close()
        assert {m.claim_path for m in quorum.members} <= {"", claim_path}


async def release_on(server: ManagedProcess, digest: bytes, token: str) -> list[list[int | None]]:
    """The release command's call to one member (a gateway calls each in turn)."""
    async with alone(server) as one:
        return await one.release([digest], [token])


async def released_on_the_first(servers: Servers, pipeline: Pipeline, message_id: bytes) -> bytes:
    """T forwarded (the job then failed it), its release done on the first member only:
    the release command's second call has not run yet. The id's digest."""
    digest = mark_digest(message_id)
    assert await vote(pipeline, message_id, T) is Outcome.FORWARD
    assert await release_on(servers[0], digest, T) == [[1]]
    return digest


async def test_a_replay_of_the_released_record_racing_its_release_is_a_duplicate(
    recovering_third: tuple[Servers, Pipeline],
) -> None:
    servers, pipeline = recovering_third
    digest = await released_on_the_first(servers, pipeline, b"id-19")
    # The record is read again (a rebalance) between the release's two calls.
    assert await vote(pipeline, b"id-19", T) is Outcome.DUPLICATE
    assert await release_on(servers[1], digest, T) == [[2]]  # released there already (the repair)
    assert await owners_on(servers[0], [digest]) == ["-" + T]
    assert await owners_on(servers[1], [digest]) == ["-" + T]
    # The producer's next copy is new, and the one after it a duplicate of it.
    assert await vote(pipeline, b"id-19", U2) is Outcome.FORWARD
    assert await vote(pipeline, b"id-19", U1) is Outcome.DUPLICATE


async def test_a_copy_racing_the_release_is_forwarded_once(
    recovering_third: tuple[Servers, Pipeline],
) -> None:
    servers, pipeline = recovering_third
    digest = await released_on_the_first(servers, pipeline, b"id-20")
    # The next copy claims between the release's two calls: it takes the tombstone
    # on the first member and meets T, not yet released, on the second.
    assert await vote(pipeline, b"id-20", U2) is Outcome.FORWARD
    await release_on(servers[1], digest, T)
    assert await vote(pipeline, b"id-20", U1) is Outcome.DUPLICATE
    assert await owners_on(servers[0], [digest]) == [U2]
    assert await owners_on(servers[1], [digest]) == [U2]  # repaired over T or its tombstone


async def test_a_release_redone_after_only_one_member_answered_is_released(
    recovering_third: tuple[Servers, Pipeline],
) -> None:
    servers, pipeline = recovering_third
    digest = await released_on_the_first(servers, pipeline, b"id-21")  # one answer
    # The command is tried again: the member that released already says so.
    assert await pipeline.quorum.release([digest], [T]) == [[2], [1], [None]]


async def test_a_fill_queued_before_the_release_does_not_undo_it(
    redis_servers: Any, claim_path: str
) -> None:
    (server,) = redis_servers(1, native=claim_path == "module")  # `alone`: claim = "auto"
    digest = mark_digest(b"id-22")
    async with alone(server) as one:
        assert await one.claim([digest], [T]) == [[1]]
        assert await one.release([digest], [T]) == [[1]]
        # A vote from before the release, whose claim this member did not answer,
        # queued T (the winner) to be completed here; it is sent with the next claim.
        one.queue_fills([[(digest, T, U1)]])
        await one.claim([mark_digest(b"another")], [U2])
    assert await owners_on(server, [digest]) == ["-" + T]
