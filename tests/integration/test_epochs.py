"""An instance that lost its marks never tips a vote: epochs, recovering, rebuild,
and the background ping that notices instances while no batch flows
(gateway/quorum/keys.py "Epochs", gateway/quorum/quorum.py, gateway/ops/rebuild.py)."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Any

import pytest
import redis.asyncio as aioredis

from devtools.harness import eventually, redis_urls, running
from devtools.localstack import ManagedProcess
from gateway.config import Settings, load_settings
from gateway.contract.tokens import mark_digest
from gateway.metrics import Metrics
from gateway.ops.rebuild import rebuild
from gateway.quorum import native
from gateway.quorum.keys import EPOCH_RECOVERING, EPOCH_TRUSTED
from gateway.quorum.quorum import Quorum, scripts
from gateway.raw.pipeline import Pipeline
from gateway.rules.commands import Handover
from gateway.rules.vote import MINE, Outcome
from tests.integration.conftest import StackFactory
from tests.integration.redis_marks import alone, epoch_on, owners_on

Servers = list[ManagedProcess]


@pytest.fixture
async def three(
    redis_servers: Any, claim_path: str
) -> AsyncIterator[tuple[Servers, Settings, Quorum]]:
    """Three fresh redis-servers and a gateway's quorum over them, epochs read; with
    the Lua claim and with the native one (`claim_path`)."""
    servers = redis_servers(3, native=claim_path == "module")
    settings = load_settings(
        redis={"nodes": redis_urls(servers), "timeout": "2s", "claim": claim_path}
    )
    quorum = Quorum(settings.redis, Metrics())
    await quorum.check()
    try:
        yield servers, settings, quorum
    finally:
        await quorum.close()
        assert {m.claim_path for m in quorum.members} <= {"", claim_path}


def restart_empty(server: ManagedProcess) -> None:
    server.stop()
    server.start()  # same port, no persistence: every mark and the epoch are gone


async def ping_twice(quorum: Quorum) -> None:
    """Two background pings: the first meets the connection a restart closed."""
    for _ in range(2):
        await quorum.check()


async def vote(pipeline: Pipeline, message_id: bytes, owner: str) -> Outcome:
    """The data path's decision for one record (claim, count, repair, fill)."""
    (outcome,) = await pipeline.vote([message_id], [owner])
    return outcome


async def test_a_copy_split_x_y_x_rebuilt_after_the_third_restarted_empty_is_a_duplicate(
    three: tuple[Servers, Settings, Quorum], capsys: pytest.CaptureFixture[str]
) -> None:
    servers, settings, quorum = three
    pipeline = Pipeline(settings, quorum, None, quorum.metrics)  # type: ignore[arg-type]
    digest = mark_digest(b"order-7")
    x, y = "1001", "2002"  # two copies' owner tokens; on a 1:1 split the smaller wins
    # y's claim reached only the second instance (its gateway died there)...
    async with alone(servers[1]) as second:
        assert await second.claim([digest], [y]) == [[MINE]]
    # ...then x's claim took the other two: (x, y, x), decided for x, the second's
    # repair not done yet.
    assert await quorum.claim([digest], [x]) == [[MINE], [y], [MINE]]
    restart_empty(servers[2])
    # y is replayed: the first call meets the closed connection (no answer from an
    # instance still counted: undecided); counting the empty instance would give
    # (x, MINE, MINE), y forwarded twice.
    assert await vote(pipeline, b"order-7", y) is Outcome.UNDECIDED
    await quorum.check()  # what the background ping does: the lost epoch is seen
    assert quorum.counted() == [True, True, False]
    assert (await epoch_on(servers[2])).state == EPOCH_RECOVERING  # type: ignore[union-attr]

    member = servers[2].name_label
    code = await rebuild(settings, member, source=None, dry_run=False, output="json")
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert code == 0, report
    # Progress on stderr (no terminal: JSON lines), the last when it ended: every
    # source read whole (marks counted per source, so at least those copied).
    last = json.loads(captured.err.splitlines()[-1])
    assert (last["progress"], last["eta_s"]) == ("rebuild", 0.0)
    assert last["done"] >= report["marks_read"] > 0
    assert report["ties"] == 1 and report["epoch_after"].endswith(":trusted")
    await quorum.check()
    assert quorum.counted() == [True, True, True]
    assert await owners_on(servers[2], [digest]) == [x]
    assert await vote(pipeline, b"order-7", y) is Outcome.DUPLICATE
    assert await owners_on(servers[1], [digest]) == [x]  # the vote repaired the split


async def test_copies_splitting_the_two_trusted_instances_while_the_third_recovers_are_decided(
    three: tuple[Servers, Settings, Quorum],
) -> None:
    """Two gateways claim copies of one id at the same moment, each reaching one
    trusted instance first, while the third recovers: one is forwarded, the other a
    duplicate, and the split is repaired (before, both stayed undecided until a
    rebuild and blocked their partitions: chaos seed 37)."""
    servers, settings, quorum = three
    pipeline = Pipeline(settings, quorum, None, quorum.metrics)  # type: ignore[arg-type]
    await quorum.claim([mark_digest(b"before")], ["1"])  # the instances hold marks
    restart_empty(servers[2])
    for _ in range(2):  # the first read meets the closed connection
        await quorum.check()
    assert quorum.counted() == [True, True, False]
    digest = mark_digest(b"order-8")
    x, y = "1001", "2002"
    for server, token in ((servers[0], x), (servers[1], y)):
        async with alone(server) as one:
            assert await one.claim([digest], [token]) == [[MINE]]
    outcomes = {token: await vote(pipeline, b"order-8", token) for token in (y, x)}
    assert outcomes == {x: Outcome.FORWARD, y: Outcome.DUPLICATE}
    assert await owners_on(servers[0], [digest]) == [x]
    assert await owners_on(servers[1], [digest]) == [x]  # repaired towards the winner
    assert await owners_on(servers[2], [digest]) == [x]  # the recovering one too


async def test_a_fresh_deployment_starts_trusted_and_every_gateway_agrees_on_a_restart(
    three: tuple[Servers, Settings, Quorum],
) -> None:
    servers, settings, first = three
    epochs = [await epoch_on(s) for s in servers]
    assert [e.state for e in epochs if e] == [EPOCH_TRUSTED] * 3  # nothing could be lost
    assert first.healthy and first.counted() == [True, True, True]
    await first.claim([mark_digest(b"a")], ["1"])  # the instances now hold marks
    restart_empty(servers[0])
    second = Quorum(settings.redis, Metrics())  # another gateway, started after the restart
    try:
        await second.check()
        await ping_twice(first)
        lost = await epoch_on(servers[0])
        assert lost is not None and lost.state == EPOCH_RECOVERING
        assert lost.id != epochs[0].id  # type: ignore[union-attr]
        for quorum in (first, second):
            assert quorum.members[0].epoch == lost
            assert quorum.counted() == [False, True, True]
            assert quorum.healthy  # two of three trusted
            assert quorum.metrics.redis_recovering.labels(servers[0].name_label)._value.get() == 1
        servers[1].stop()
        await first.check()
        assert not first.healthy
        why = first.why_unhealthy()
        assert servers[1].name_label in why and "recovering" in why
        assert servers[0].name_label in why
    finally:
        await second.close()


async def test_a_claim_that_expects_another_epoch_writes_nothing(
    redis_servers: Any, claim_path: str
) -> None:
    (server,) = redis_servers(1, native=claim_path == "module")
    async with alone(server) as quorum, aioredis.Redis(port=server.port) as client:
        await quorum.check()
        epoch = quorum.members[0].epoch
        assert epoch is not None
        script = client.register_script(scripts.CLAIM)
        digest = mark_digest(b"m")

        async def claim(expected: str, owner: str) -> Any:
            args = [*quorum.layout, expected, 12, digest, owner]
            if claim_path == "module":
                return await client.execute_command(native.COMMAND, b"dd:slice", *args)
            return await script(keys=[b"dd:slice"], args=args)

        for expected in ("", "not-" + epoch.id, epoch.id[:-1]):
            assert await claim(expected, "5,") == b"epoch:" + epoch.raw.encode()
        assert await client.keys("dd:m:*") == [] and not await client.exists("dd:slice")
        assert await claim(epoch.id, "5,") == [1]
        await client.delete("dd:epoch")
        assert await claim(epoch.id, "6,") == b"epoch:"


async def test_a_recovering_instance_is_trusted_again_after_a_whole_mark_lifetime(
    redis_servers: Any,
) -> None:
    servers = redis_servers(3)
    settings = load_settings(redis={"nodes": redis_urls(servers), "ttl": "2s"})
    quorum = Quorum(settings.redis, Metrics())
    try:
        await quorum.check()
        await quorum.claim([mark_digest(b"a")], ["1"])
        restart_empty(servers[1])
        await ping_twice(quorum)
        since = time.monotonic()
        assert quorum.counted() == [True, False, True]

        async def trusted() -> bool:
            await quorum.check()
            return quorum.counted() == [True, True, True]

        while not await trusted():
            assert time.monotonic() - since < 10, "still recovering"
        # marks live at most 2 x ttl = 4 s: not trusted before that
        assert time.monotonic() - since > 3.5
        assert (await epoch_on(servers[1])).state == EPOCH_TRUSTED  # type: ignore[union-attr]
    finally:
        await quorum.close()


async def test_a_rebuild_copies_the_live_marks_with_their_lifetime_and_a_dry_run_writes_nothing(
    three: tuple[Servers, Settings, Quorum], capsys: pytest.CaptureFixture[str]
) -> None:
    servers, settings, quorum = three
    ids = [mark_digest(f"r-{i}".encode()) for i in range(3000)]
    tokens = [str(100 + i) for i in range(3000)]
    await quorum.claim(ids, tokens)
    restart_empty(servers[0])
    await ping_twice(quorum)
    member = servers[0].name_label

    assert await rebuild(settings, member, source=None, dry_run=True, output="json") == 0
    dry = json.loads(capsys.readouterr().out)
    assert (dry["marks_read"], dry["written"], dry["dry_run"]) == (3000, 3000, True)
    assert await owners_on(servers[0], ids[:5]) == [None] * 5
    assert (await epoch_on(servers[0])).state == EPOCH_RECOVERING  # type: ignore[union-attr]

    assert await rebuild(settings, member, source=servers[2].name_label, dry_run=False,
                         output="text") == 0  # fmt: skip
    text = capsys.readouterr().out
    assert f"rebuild {member} from {servers[2].name_label}" in text
    assert "written 3000" in text
    assert await owners_on(servers[0], ids) == tokens
    async with (
        aioredis.Redis(port=servers[0].port) as target,
        aioredis.Redis(port=servers[2].port) as source,
    ):
        shard = int.from_bytes(ids[0][:3], "big") % 16_384  # ids[0]'s bucket, on each side
        (bucket,) = await source.keys(f"dd:m:*:{shard}")
        (copied,) = await target.keys(f"dd:m:*:{shard}")
        # the copy lives as long as the original, at most one slice (ttl) longer
        left, kept = await source.pttl(bucket), await target.pttl(copied)
        assert left - 5000 <= kept <= left + 24 * 3600 * 1000 + 5000
    await quorum.check()
    assert quorum.counted() == [True, True, True]

    assert await rebuild(settings, "nowhere:1/0", source=None, dry_run=False, output="json") == 2
    assert "members" in json.loads(capsys.readouterr().out)["error"]


async def test_an_idle_gateway_notices_a_dead_member_and_its_empty_restart(
    stack: StackFactory,
) -> None:
    s = await stack()
    servers, settings = s.servers, s.settings
    settings.redis.ping_interval = timedelta(milliseconds=200)
    async with running(settings) as gateway:
        m, label = gateway.metrics, servers[1].name_label
        up = m.redis_up.labels(label)._value
        recovering = m.redis_recovering.labels(label)._value
        await eventually(lambda: gateway.readiness()[0], what="ready")
        async with alone(servers[0]) as q:  # an instance that holds marks
            await q.claim([mark_digest(b"z")], ["9"])
        assert (up.get(), recovering.get()) == (1, 0)
        servers[1].kill()
        killed = time.monotonic()
        await eventually(lambda: up.get() == 0, timeout_s=5, what="redis_up 0")
        assert time.monotonic() - killed < 0.2 + 0.3 + 1  # interval + timeout + slack
        servers[1].start()  # empty
        await eventually(lambda: up.get() == 1 and recovering.get() == 1, timeout_s=5)
        assert gateway.readiness()[0]  # still two trusted of three
        assert m.quorum_healthy._value.get() == 1
        servers[2].stop()
        await eventually(lambda: not gateway.readiness()[0], timeout_s=5)
        assert m.quorum_healthy._value.get() == 0
        why = gateway.readiness()[1]
        assert "recovering" in why and label in why and servers[2].name_label in why


async def test_a_rebuild_copies_handover_notes_so_a_replayed_command_is_redone_everywhere(
    three: tuple[Servers, Settings, Quorum], capsys: pytest.CaptureFixture[str]
) -> None:
    """Without the note, the rebuilt member would call a replay of the command that
    handed the mark over "another copy" (3) while the others say "redo" (2): with
    two members emptied, that tie blocked the command partition (chaos seed 732)."""
    servers, settings, quorum = three
    digest = mark_digest(b"failed-1")
    await quorum.claim([digest], ["1"])
    command = Handover(digest, "1", "2", "failures/0/5")
    assert await quorum.handover([command]) == [[1], [1], [1]]
    restart_empty(servers[1])
    await ping_twice(quorum)
    assert quorum.counted() == [True, False, True]
    assert await rebuild(settings, servers[1].name_label, source=servers[0].name_label,
                         dry_run=False, output="json") == 0  # fmt: skip
    capsys.readouterr()
    await quorum.check()
    assert await quorum.handover([command]) == [[2], [2], [2]]  # a replay: redo, on each
    (view, *_) = await quorum.admin.inspect(digest)
    note = b"dd:h:" + digest
    async with aioredis.Redis(port=servers[1].port) as rebuilt:
        assert await rebuilt.get(note) == b"failures/0/5"
        # It lives as long as the mark: up to one slice (the ttl) past the ttl.
        assert 0 < await rebuilt.pttl(note) <= settings.redis.ttl.total_seconds() * 2000
    assert view is not None and view.handed_over_by == "failures/0/5"
