"""The native claim (gateway/quorum/native, `DD.CLAIM`) against the Lua claim
(gateway/quorum/lua/claim.lua): random sequences of claims, releases, new slices,
slices aging out, `ttl` and `buckets` changes, other epochs and pauses, sent alike
to a redis-server that runs the script and one that runs the module, give the same
replies and leave the same keys; its writes reach a replica and the AOF as the
script's do; `[redis] claim` picks the path per member and says so.

tests/integration/test_marks.py runs every claim test on both paths as well."""

from __future__ import annotations

import asyncio
import logging
import random
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from devtools.harness import redis_urls
from gateway.config import load_settings
from gateway.contract.tokens import mark_digest
from gateway.errors import ConfigError
from gateway.metrics import Metrics
from gateway.quorum import native, scripts
from gateway.quorum.quorum import Quorum
from gateway.rules.vote import MINE

PREFIX, META, EPOCH = b"dd:", b"dd:slice", "e1"
# Fields of the slice meta that hold a time: each server reads its own clock, a
# millisecond or so apart.
TIMED = (b"ends", b"expires:")
TOLERANCE_MS = 1500
TOKENS = ["11", "12", "13", "4099", "77"]
MINUTE_MS = 60_000


class Pair:
    """A Lua server and a module server, sent the same commands."""

    def __init__(self, lua: aioredis.Redis, module: aioredis.Redis) -> None:
        self.lua, self.module, self.both = lua, module, (lua, module)
        self.claim_sha = self.release_sha = ""

    async def start(self) -> None:
        for client in self.both:
            await client.flushall()
            await client.set(PREFIX + b"epoch", f"{EPOCH}:0:trusted")
        self.claim_sha = await self.lua.script_load(scripts.CLAIM)
        self.release_sha = await self.module.script_load(scripts.RELEASE)
        await self.lua.script_load(scripts.RELEASE)

    async def claim(self, args: list[Any]) -> tuple[Any, Any]:
        """The same claim on both: (Lua's reply, the module's); an error as its type."""

        async def run(call: Any) -> Any:
            try:
                return await call
            except ResponseError as exc:
                return type(exc)

        lua = await run(self.lua.evalsha(self.claim_sha, 1, META, *args))
        module = await run(self.module.execute_command(native.COMMAND, META, *args))
        return lua, module

    async def each(self, *command: Any) -> None:
        for client in self.both:
            await client.execute_command(*command)


async def key_contents(client: aioredis.Redis) -> dict[bytes, Any]:
    """Every key: its type, value and expiry (ms left, -1 none)."""
    out: dict[bytes, Any] = {}
    for key in sorted(await client.keys("*")):
        kind = (await client.type(key)).decode()
        value = await client.hgetall(key) if kind == "hash" else await client.get(key)
        out[key] = (kind, value, await client.pttl(key))
    return out


def assert_same_keys(lua: dict[bytes, Any], module: dict[bytes, Any]) -> None:
    assert sorted(lua) == sorted(module), set(lua) ^ set(module)
    for key, (kind, value, ttl) in lua.items():
        kind_m, value_m, ttl_m = module[key]
        assert kind == kind_m, key
        assert (ttl < 0) == (ttl_m < 0) and abs(ttl - ttl_m) < TOLERANCE_MS, (key, ttl, ttl_m)
        if key != META:
            assert value == value_m, key
            continue
        assert sorted(value) == sorted(value_m), (value, value_m)
        for field, v in value.items():
            if field.startswith(TIMED):
                assert abs(int(v) - int(value_m[field])) < TOLERANCE_MS, (field, v, value_m)
            else:
                assert v == value_m[field], (field, v, value_m[field])


@pytest.fixture
async def pair(redis_servers: Any) -> Any:
    (lua,) = redis_servers(1)
    (module,) = redis_servers(1, native=True)
    async with (
        aioredis.Redis(port=lua.port) as a,
        aioredis.Redis(port=module.port) as b,
    ):
        yield Pair(a, b)


async def run_sequence(pair: Pair, rng: random.Random, steps: int) -> list[Any]:
    """`steps` random operations on both servers; every claim's replies compared."""
    ids = [mark_digest(f"id-{i}".encode()) for i in range(rng.choice([20, 120, 400]))]
    ttl, buckets, replies = MINUTE_MS * rng.choice([1, 2, 5]), rng.choice([1, 2, 4, 16]), []
    for step in range(steps):
        op = rng.random()
        if op < 0.55:  # a claim call: copies, replays, ids in one call twice
            n = rng.randint(1, 80)
            digests = [rng.choice(ids) for _ in range(n)]
            owners = [rng.choice(TOKENS) for _ in range(n)]
            epoch = EPOCH if rng.random() > 0.05 else "e0"
            args = [PREFIX, ttl, ttl // scripts.SLICES_BACK, buckets, epoch, 12,
                    b"".join(digests), ",".join(owners) + ","]  # fmt: skip
            lua, module = await pair.claim(args)
            assert lua == module, (step, lua, module)
            replies.append(lua)
        elif op < 0.7:  # releases (tombstones), some of the current owner's
            marks: list[Any] = []
            for _ in range(rng.randint(1, 10)):
                marks += [rng.choice(ids), rng.choice(TOKENS)]
            layout = [PREFIX, ttl, ttl // scripts.SLICES_BACK, buckets]
            got = [await c.evalsha(pair.release_sha, 1, META, *layout, *marks) for c in pair.both]
            assert got[0] == got[1], (step, got)
        elif op < 0.8:  # the current slice ends: the next claim opens one
            await pair.each("HSET", META, "ends", 0)
        elif op < 0.85:  # an older slice's buckets expire (time passing, by hand)
            live = (await pair.lua.hget(META, "live") or b"").decode()
            older = [s for s in live.partition(":")[2].split(",") if s]
            if older:
                gone = rng.choice(older)
                await pair.each("HSET", META, f"expires:{gone}", 1)
                for client in pair.both:
                    for key in await client.keys(f"dd:m:{gone}:*"):
                        await client.delete(key)
        elif op < 0.92:  # `ttl` raised or lowered
            ttl = MINUTE_MS * rng.choice([1, 2, 5, 10])
        elif op < 0.97:  # `buckets`: a member's first slice only
            buckets = rng.choice([1, 2, 4, 16, 64])
        else:  # paused, then resumed
            await pair.each("SET", PREFIX + b"paused", 1)
            args = [PREFIX, ttl, ttl, buckets, EPOCH, 12, ids[0], "11,"]
            lua, module = await pair.claim(args)
            assert lua == module == b"paused:"
            await pair.each("DEL", PREFIX + b"paused")
    return replies


@pytest.mark.parametrize("seeds", [range(0, 4), range(4, 8), range(8, 12)])
async def test_random_claims_releases_and_ttl_changes_give_the_same_replies_and_keys(
    pair: Pair, seeds: range
) -> None:
    flat: list[Any] = []
    grown = 0
    for seed in seeds:
        await pair.start()
        replies = await run_sequence(pair, random.Random(seed), steps=60)
        assert_same_keys(await key_contents(pair.lua), await key_contents(pair.module))
        flat += [r for reply in replies if isinstance(reply, list) for r in reply]
        grown += any(f.startswith(b"grown:") for f in await pair.lua.hkeys(META))
    # The sequences reach what they are meant to: new ids, replays, copies, tombstones
    # claimed over and replayed, other epochs, split buckets.
    kinds = {r if isinstance(r, int) else r[:1] if r[:1] in (b"=", b"-") else b"owner"
             for r in flat}  # fmt: skip
    assert kinds == {1, b"=", b"-", b"owner"}, kinds
    assert grown > 0


async def test_a_split_heavy_sequence_from_one_bucket_gives_the_same_keys(pair: Pair) -> None:
    """2,000 new ids into a first slice of one bucket: ~60 splits, as claims arrive."""
    await pair.start()
    ids = [mark_digest(f"split-{i}".encode()) for i in range(2000)]
    for start in range(0, len(ids), 250):
        chunk = ids[start : start + 250]
        args = [PREFIX, MINUTE_MS, MINUTE_MS, 1, EPOCH, 12, b"".join(chunk), "5," * len(chunk)]
        lua, module = await pair.claim(args)
        assert lua == module == [1] * len(chunk)
    assert int(await pair.module.hget(META, "grown:1") or 0) > 32
    assert_same_keys(await key_contents(pair.lua), await key_contents(pair.module))


async def test_bad_arguments_are_an_error_reply_not_a_crash(pair: Pair) -> None:
    await pair.start()
    with pytest.raises(ResponseError):
        await pair.module.execute_command(native.COMMAND, META, PREFIX, 1000)
    with pytest.raises(ResponseError):  # more owners than digests
        await pair.module.execute_command(
            native.COMMAND, META, PREFIX, MINUTE_MS, MINUTE_MS, 4, EPOCH, 12, b"x" * 12, "1,2,"
        )
    assert await pair.module.ping()


async def test_its_writes_reach_a_replica_and_the_aof_as_the_scripts_do(
    redis_servers: Any,
) -> None:
    """Effects are replicated (the call reads the clock: never the call itself), so a
    replica without the module and an AOF reload hold what the master does."""
    (master,) = redis_servers(1, aof=True, native=True)
    (replica,) = redis_servers(1)
    ids = [mark_digest(f"rep-{i}".encode()) for i in range(600)]
    async with aioredis.Redis(port=master.port) as m, aioredis.Redis(port=replica.port) as r:
        await r.replicaof("127.0.0.1", master.port)
        await m.set(PREFIX + b"epoch", f"{EPOCH}:0:trusted")
        assert await m.wait(1, 10_000) == 1  # the replica is attached
        for start in range(0, len(ids), 200):
            chunk = ids[start : start + 200] + ids[:5]  # new ids and copies
            args = [PREFIX, MINUTE_MS, MINUTE_MS, 2, EPOCH, 12, b"".join(chunk),
                    ",".join(["7"] * 200 + ["8"] * 5) + ","]  # fmt: skip
            await m.execute_command(native.COMMAND, META, *args)
        await m.execute_command("HSET", META, "ends", 0)  # a second slice, from 600 marks
        await m.execute_command(native.COMMAND, META, *args)
        assert await m.wait(1, 10_000) == 1
        before = await key_contents(m)
        assert_same_keys(before, await key_contents(r))
    master.stop()
    master.start()  # from the AOF
    async with aioredis.Redis(port=master.port) as m:
        assert_same_keys(before, await key_contents(m))


def quorum_for(servers: list[Any], claim: str) -> Quorum:
    settings = load_settings(redis={"nodes": redis_urls(servers), "claim": claim})
    return Quorum(settings.redis, Metrics())


async def test_auto_uses_the_module_where_loaded_and_lua_elsewhere_and_logs_each(
    redis_servers: Any, caplog: pytest.LogCaptureFixture
) -> None:
    servers = [*redis_servers(1, native=True), *redis_servers(2)]
    quorum = quorum_for(servers, "auto")
    try:
        with caplog.at_level(logging.INFO, logger="gateway.quorum.claim_path"):
            a, b = mark_digest(b"auto-a"), mark_digest(b"auto-b")
            assert await quorum.claim([a, b, a], ["1", "2", "3"]) == [[MINE, MINE, "1"]] * 3
        assert [m.claim_path for m in quorum.members] == ["module", "lua", "lua"]
        # The members connect concurrently: their lines come in any order.
        lines = [r.getMessage() for r in caplog.records if "claims run as" in r.getMessage()]
        assert len(lines) == 3
        by_member = {s.name_label: [ln for ln in lines if s.name_label in ln] for s in servers}
        assert all(len(found) == 1 for found in by_member.values()), by_member
        assert "claims run as the native module command" in by_member[servers[0].name_label][0]
        for server in servers[1:]:
            line = by_member[server.name_label][0]
            assert "the Lua script" in line and "no `dedup` module" in line
        async with aioredis.Redis(port=servers[0].port) as r:
            stats = await r.info("commandstats")
            assert stats["cmdstat_dd.claim"]["calls"] == 1  # the claim; epochs are scripts
    finally:
        await quorum.close()


async def test_lua_never_asks_for_modules_and_module_stops_start_up_naming_the_member(
    redis_servers: Any,
) -> None:
    with_module, without = redis_servers(1, native=True)[0], redis_servers(1)[0]
    quorum = quorum_for([with_module], "lua")
    try:
        assert await quorum.claim([mark_digest(b"lua")], ["1"]) == [[MINE]]
        assert quorum.members[0].claim_path == "lua"
        async with aioredis.Redis(port=with_module.port) as r:
            assert "cmdstat_module|list" not in await r.info("commandstats")
    finally:
        await quorum.close()
    quorum = quorum_for([without], "module")
    try:
        with pytest.raises(ConfigError) as err:
            await quorum.wait_for_majority(asyncio.Event())
        assert without.name_label in str(err.value) and 'claim = "module"' in str(err.value)
    finally:
        await quorum.close()


async def test_a_member_restarted_without_the_module_falls_back_to_lua(
    redis_servers: Any, caplog: pytest.LogCaptureFixture
) -> None:
    (server,) = redis_servers(1, aof=True, native=True)
    quorum = quorum_for([server], "auto")
    try:
        assert await quorum.claim([mark_digest(b"before")], ["1"]) == [[MINE]]
        assert quorum.members[0].claim_path == "module"
        server.stop()
        server.argv = server.argv[: server.argv.index("--loadmodule")]
        server.start()
        await quorum.refresh_epochs()
        # The first call after is refused as an unknown command: no answer, then Lua.
        assert await quorum.claim([mark_digest(b"during")], ["2"]) == [[None]]
        assert await quorum.claim([mark_digest(b"before")], ["3"]) == [["1"]]
        assert await quorum.claim([mark_digest(b"during")], ["2"]) == [[MINE]]
        assert quorum.members[0].claim_path == "lua"  # asked again once it answered
    finally:
        await quorum.close()
