"""The native claim (gateway/quorum/native/dd_claim.c) on bad input: built with ASan
and UBSan (`native.build(sanitize=True)`, a UBSan report aborts) and loaded into a
real redis-server with the compiler's libasan preloaded, it gets a seeded, bounded
fuzz of DD.CLAIM calls: malformed counts, wrong key types, huge, negative, empty and
binary values, crafted slice metas. Any crash, hang (every call has a watchdog
timeout), sanitizer report in the server's log fails, and so does a divergence from
the Lua claim (gateway/quorum/lua/claim.lua) on a plain redis-server where the
module takes the input: the same reply and the same keys, an error where Lua fails.

Input the module refuses by design (a number out of its bounds, a prefix longer
than 64 bytes, fewer digests than owners) goes to the module only: it must answer
an error reply, not take its server down. The short fuzz runs in `make test`, a
long one (marked native_fuzz) in `make test-long`.

Also the regressions, on the module as `make setup` builds it: each bad input that
crashed (an allocation of 2^62 bytes, a division by zero) or hung (a loop that
never ends: a module command cannot be killed) a member, and the expiry of a new
bucket when the slice meta is gone but its expiry ledger survives."""

from __future__ import annotations

import random
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from devtools.localstack import ManagedProcess, redis_server
from gateway.quorum import native, scripts
from tests.integration.test_native_claim import TIMED, TOLERANCE_MS, Pair, run_sequence

EPOCH = b"e1"
WATCHDOG_S = 10.0  # one call; ASan's slowdown included, a claim takes milliseconds
# What a sanitizer, or Redis's own crash report, writes into the server's log.
REPORTS = re.compile(
    rb"AddressSanitizer|UndefinedBehaviorSanitizer|runtime error:|LeakSanitizer"
    rb"|crashed by signal|Guru Meditation|ASSERTION FAILED"
)
SANITIZER_ENV = (
    "ASAN_OPTIONS=detect_leaks=0:abort_on_error=1:halt_on_error=1",
    "UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1",
)
MAX_BUCKETS = scripts.MAX_BUCKETS


def sanitized_server(tmp_path: Path, name: str) -> ManagedProcess:
    """A redis-server that loads the ASan/UBSan build, libasan preloaded."""
    runtime = native.sanitizer_runtime()
    if runtime is None:
        pytest.skip("the C compiler has no libasan (gcc's: apt-get install gcc)")
    server = redis_server(tmp_path, name, module=native.build(sanitize=True))
    server.argv = ["env", f"LD_PRELOAD={runtime}", *SANITIZER_ENV, *server.argv]
    return server


def reports(server: ManagedProcess) -> bytes:
    text = server.log_path.read_bytes() if server.log_path.exists() else b""
    found = REPORTS.search(text)
    return text[max(0, found.start() - 200) : found.start() + 3000] if found else b""


class Servers:
    """The sanitized module server and a plain one for the Lua claim."""

    def __init__(self, module: ManagedProcess, lua: ManagedProcess) -> None:
        self.module_server, self.lua_server = module, lua
        self.module = redis.Redis(port=module.port, socket_timeout=WATCHDOG_S)
        self.lua = redis.Redis(port=lua.port, socket_timeout=WATCHDOG_S)
        self.claim_sha = self.lua.script_load(scripts.CLAIM)

    def healthy(self, what: object) -> None:
        """The module's server is up, answers, and logged no sanitizer report."""
        found = reports(self.module_server)
        assert not found, f"{what}: the server's log:\n{found.decode(errors='replace')}"
        assert self.module_server.running, f"{what}: the module's server died"
        assert self.module.ping(), what

    def close(self) -> None:
        self.module.close()
        self.lua.close()


@pytest.fixture
def servers(tmp_path: Path) -> Iterator[Servers]:
    module, lua = sanitized_server(tmp_path, "asan"), redis_server(tmp_path, "lua")
    started = []
    try:
        for server in (module, lua):
            server.start()
            started.append(server)
        pair = Servers(module, lua)
        yield pair
        pair.healthy("at the end")  # also a report from the last call's aftermath
        pair.close()
    finally:
        for server in started:
            server.stop()


def call(client: redis.Redis, *args: Any) -> Any:
    """A command's reply, an error reply as ResponseError; a call that overruns the
    watchdog (the server hangs) fails the test."""
    try:
        return client.execute_command(*args)
    except RedisTimeoutError:
        pytest.fail(f"no reply in {WATCHDOG_S} s (hung) to {args!r:.300}")
    except ResponseError as exc:
        return exc


def lua_claim(s: Servers, meta: bytes, args: list[Any]) -> Any:
    return call(s.lua, "EVALSHA", s.claim_sha, 1, meta, *args)


# -- the fuzz -----------------------------------------------------------------------


@dataclass
class Case:
    """One fuzz case: a state built on both servers, then one claim. `bad`: it holds
    input the module refuses by design (sent to the module only)."""

    rng: random.Random
    prefix: bytes = b"dd:"
    meta: bytes = b"dd:slice"
    bad: list[str] = field(default_factory=list)

    def pick(self, good: list[Any], bad: list[Any], p_bad: float, what: str) -> Any:
        if self.rng.random() < p_bad:
            self.bad.append(what)
            return self.rng.choice(bad)
        return self.rng.choice(good)


HUGE = [2**62, 2**63 - 1, -(2**63), 2**63, 10**20, 2**53 + 1, 4611686018427387904]
NOT_INTEGERS = [b"", b"abc", b"1.5", b"1e3", b"inf", b"-inf", b"nan", b"0x10", b" 5",
                b"+5", b"\x00\xff", b"5\x00"]  # fmt: skip
BAD_SPANS = [0, -1, -60_000, 2**42 + 1, *HUGE, *NOT_INTEGERS]
BAD_BUCKETS = [0, -1, -(2**62), MAX_BUCKETS + 1, *HUGE, *NOT_INTEGERS]
BAD_LENGTHS = [0, 1, 2, -1, -12, 2**20 + 1, *HUGE, *NOT_INTEGERS]


def binary(rng: random.Random, n: int, avoid: bytes = b"") -> bytes:
    return bytes(b for b in rng.randbytes(n) if b not in avoid)


def tokens(rng: random.Random, n: int) -> bytes:
    """`n` owner tokens, each followed by ','; some binary, some tombstone-like."""
    out = []
    for _ in range(n):
        kind = rng.random()
        if kind < 0.6:
            out.append(str(rng.choice([11, 12, 13, 77, 4099])).encode())
        elif kind < 0.75:
            out.append(b"-" + str(rng.choice([11, 12])).encode())
        elif kind < 0.9:
            out.append(binary(rng, rng.randint(1, 6), avoid=b",") or b"x")
        else:
            out.append(b"")  # an empty token: gmatch('([^,]+),') skips it
    return b"".join(t + b"," for t in out)


def claim_args(case: Case, now_ms: int, ids: list[bytes]) -> list[Any]:
    """DD.CLAIM's arguments after the meta, some of them bad."""
    rng = case.rng
    ttl = case.pick([60_000, 120_000, 1000, 2**42], BAD_SPANS, 0.06, "ttl")
    slice_ms = case.pick([60_000, 30_000, 2**41], BAD_SPANS, 0.06, "slice")
    buckets = case.pick([1, 2, 4, 16, MAX_BUCKETS], BAD_BUCKETS, 0.06, "buckets")
    length = case.pick([12], BAD_LENGTHS, 0.06, "length")
    n = rng.choice([0, 1, 3, 20, 60])
    owners = tokens(rng, n)
    count = len(re.findall(rb"[^,]+,", owners))
    digest_len = length if isinstance(length, int) and 3 <= length <= 64 else 12
    if rng.random() < 0.7:
        digests = b"".join(rng.choice(ids)[:digest_len].ljust(digest_len, b"\0")
                           for _ in range(count))  # fmt: skip
    else:
        digests = binary(rng, digest_len * count)
    if rng.random() < 0.05:  # fewer digests than owners
        digests = digests[: rng.randint(0, max(0, len(digests) - 1))]
    if len(digests) < count * (length if isinstance(length, int) and length > 0 else 0):
        case.bad.append("digests")
    elif rng.random() < 0.1:
        digests += binary(rng, rng.randint(1, 30))  # extra bytes: both ignore them
    epoch = case.pick([EPOCH, EPOCH, EPOCH, b"e0", b"", b"e1\x00"], [b"e1"], 0.0, "epoch")
    args: list[Any] = [case.prefix, ttl, slice_ms, buckets, epoch, length, digests, owners]
    if rng.random() < 0.03:  # a malformed count of arguments
        case.bad.append("arity")
        args = args[: rng.randint(0, 7)] if rng.random() < 0.5 else [*args, b"extra"]
    return args


def meta_values(case: Case, name: bytes, slice_id: int, now_ms: int) -> Any:
    """A crafted value for the meta field `name`; out of the module's bounds marked bad."""
    rng = case.rng
    future, past = now_ms + 10**9, rng.choice([0, 1, -5, now_ms - 10**9])
    field_kind = name.split(b":")[0]
    garbage = [b"", b"abc", b"\x00\xff", b"-"]  # not numbers to Lua either: absent
    if field_kind == b"id":
        good: list[Any] = [0, 1, 2, slice_id + 1, -3, 10**13, *garbage]
        bad: list[Any] = [10**13 + 1, -(10**13) - 1, *HUGE, b"1.5", b"inf", b"1e3"]
    elif field_kind in (b"ends", b"expires"):
        good, bad = [past, future, *garbage], [2**53 + 1, -(2**53) - 1, *HUGE, b"1.5", b"inf"]
    elif field_kind == b"first":
        good = [-2, 0, 1, 2, slice_id, slice_id + 1, *garbage]
        bad = [10**13 + 1, *HUGE, b"1.5", b"-inf"]
    elif field_kind in (b"buckets", b"grown"):
        good = [1, 2, 3, 5, 16, 64, MAX_BUCKETS, *garbage]
        bad = [0, -1, MAX_BUCKETS + 1, 2**31, 2**62, *HUGE, b"1.5", b"inf", b"nan"]
    elif field_kind == b"marks":
        good = [-5, 0, 31, 33, 5000, 2**62, 2**63 - 1 - rng.randint(0, 100), *garbage]
        bad = [b"1.5", b"1e3", 2**63, b"inf"]
    else:  # live
        ids = [str(rng.choice([slice_id - 1, slice_id - 2, 0, slice_id])).encode()
               for _ in range(rng.randint(0, 5))]  # fmt: skip
        head = rng.choice([str(slice_id).encode(), str(slice_id + 1).encode(), b"", b"abc"])
        good = [head + b":" + b"".join(i + b"," for i in ids),
                head + b":" + binary(rng, 20, avoid=b" .eExX+\t\n\r\v\f"), b"", b"abc",
                str(slice_id).encode() + b":1,,2a,3"]  # fmt: skip
        bad = [str(slice_id).encode() + b":" + b"1," * 2000,
               str(slice_id).encode() + b":99999999999999999999999,",
               str(slice_id).encode() + b":10000000000001,"]  # fmt: skip
    return case.pick(good, bad, 0.35, f"meta {name.decode()}")


def both(s: Servers, *command: Any) -> None:
    for client in (s.module, s.lua):
        call(client, *command)


def craft(s: Servers, case: Case, now_ms: int) -> None:
    """Change the state the same way on both servers: meta fields, wrong types."""
    rng = case.rng
    raw = s.lua.hget(case.meta, "id") if s.lua.type(case.meta) == b"hash" else None
    slice_id = int(raw) if raw and raw.isdigit() else 1
    for _ in range(rng.choice([0, 0, 1, 2, 3])):
        kind = rng.random()
        if kind < 0.55:
            name = rng.choice([b"id", b"ends", b"live", b"first"]) if rng.random() < 0.4 else (
                rng.choice([b"buckets:", b"grown:", b"marks:", b"expires:"])
                + str(slice_id + rng.choice([0, 0, -1, 1])).encode()
            )  # fmt: skip
            value = meta_values(case, name, slice_id, now_ms)
            if s.lua.type(case.meta) in (b"hash", b"none"):
                both(s, "HSET", case.meta, name, value)
        elif kind < 0.62:  # the slice meta gone; buckets and the ledger survive
            both(s, "DEL", case.meta)
        elif kind < 0.7:  # the current slice ends: the claim opens the next
            if s.lua.type(case.meta) in (b"hash", b"none"):
                both(s, "HSET", case.meta, "ends", 0)
        else:  # a key of another type where the claim reads or writes
            fmt_prefix = case.prefix.split(b"\0")[0]  # Lua's fmt('%s') stops at a NUL
            target = rng.choice([
                case.meta, fmt_prefix + b"x:" + str(slice_id).encode(),
                fmt_prefix + b"x:" + str(slice_id + 1).encode(),
                fmt_prefix + b"m:" + str(slice_id).encode() + b":0",
                fmt_prefix + b"m:" + str(slice_id - 1).encode() + b":0",
                case.prefix + b"epoch", case.prefix + b"paused",
            ])  # fmt: skip
            shape = rng.random()
            both(s, "DEL", target)
            if shape < 0.3:
                both(s, "RPUSH", target, "a")
            elif shape < 0.5:
                both(s, "SET", target, binary(rng, 3))
            elif shape < 0.7:
                both(s, "HSET", target, rng.choice([b"", b"a", b"ab"]), "x")  # short field
            elif shape < 0.85:
                both(s, "SADD", target, "a")
            else:
                both(s, "HSET", target, binary(rng, 12), "11")
        if rng.random() < 0.2:  # a bucket with a field too short to hash
            fmt_prefix = case.prefix.split(b"\0")[0]
            bucket = fmt_prefix + b"m:" + str(slice_id).encode() + b":0"
            if s.lua.type(bucket) in (b"hash", b"none"):
                both(s, "HSET", bucket, rng.choice([b"", b"a", b"ab"]), "x")


def snapshot(client: redis.Redis) -> dict[bytes, Any]:
    """Every key: type, value, ms left (-1: no expiry)."""
    out: dict[bytes, Any] = {}
    for key in sorted(client.keys("*")):
        kind = client.type(key).decode()
        readers = {"hash": client.hgetall, "string": client.get,
                   "list": lambda k: client.lrange(k, 0, -1), "set": client.smembers}  # fmt: skip
        out[key] = (kind, readers[kind](key), client.pttl(key))
    return out


def assert_same_keys(lua: dict[bytes, Any], module: dict[bytes, Any], meta: bytes) -> None:
    """test_native_claim's comparison for any meta key: times within the tolerance."""
    assert sorted(lua) == sorted(module), set(lua) ^ set(module)
    for key, (kind, value, ttl) in lua.items():
        kind_m, value_m, ttl_m = module[key]
        assert kind == kind_m, key
        assert (ttl < 0) == (ttl_m < 0) and abs(ttl - ttl_m) < TOLERANCE_MS, (key, ttl, ttl_m)
        if key != meta or kind != "hash":
            assert value == value_m, key
            continue
        assert sorted(value) == sorted(value_m), (value, value_m)
        for name, v in value.items():
            if name.startswith(TIMED) and v.lstrip(b"-").isdigit():
                assert abs(int(v) - int(value_m[name])) < TOLERANCE_MS, (name, v, value_m)
            else:
                assert v == value_m[name], (name, v, value_m[name])


def same_reply(lua: Any, module: Any) -> bool:
    if isinstance(lua, ResponseError) or isinstance(module, ResponseError):
        return isinstance(lua, ResponseError) and isinstance(module, ResponseError)
    return bool(lua == module)


def run_case(s: Servers, seed: int, number: int) -> str:
    """One case; returns how it ended (for the coverage check)."""
    rng = random.Random(seed * 1_000_003 + number)
    case = Case(rng)
    if rng.random() < 0.2:  # binary prefixes: NULs, braces, up to 64 bytes; some longer
        case.prefix = case.pick(
            [b"p\x00q:", b"{t}:", b"\xff\xfe:", b"a" * 64, b""],
            [b"a" * 65, b"b" * 300],
            0.2,
            "prefix",
        )
        case.meta = case.prefix + rng.choice([b"slice", b""]) if case.prefix else b"m"
    now_ms = int(time.time() * 1000)
    ids = [rng.randbytes(12) for _ in range(rng.choice([5, 40, 200]))]
    both(s, "FLUSHALL")
    both(s, "SET", case.prefix + b"epoch", EPOCH + b":0:trusted")
    for _ in range(rng.choice([0, 1, 2, 4])):  # a state: claims alike on both
        good = Case(random.Random(rng.random()), case.prefix, case.meta, list(case.bad))
        args = claim_args(good, now_ms, ids)
        if good.bad:
            continue
        lua, module = lua_claim(s, case.meta, args), call(s.module, "DD.CLAIM", case.meta, *args)
        assert same_reply(lua, module), ("set-up", seed, number, lua, module)
        if rng.random() < 0.2:
            both(s, "HSET", case.meta, "ends", 0)
    craft(s, case, now_ms)
    args = claim_args(case, now_ms, ids)
    module = call(s.module, "DD.CLAIM", case.meta, *args)
    s.healthy((seed, number, case.bad, args))
    if case.bad:  # refused by design: an error reply, unless the bad part was not read
        if any(not what.startswith("meta") for what in case.bad):
            assert isinstance(module, ResponseError), (seed, number, case.bad, module)
        return "refused" if isinstance(module, ResponseError) else "module only"
    lua = lua_claim(s, case.meta, args)
    where = (seed, number, args, lua, module)
    assert same_reply(lua, module), where
    if isinstance(lua, ResponseError):
        return "both failed"
    assert_same_keys(snapshot(s.lua), snapshot(s.module), case.meta)
    return "same"


def fuzz(s: Servers, seed: int, cases: int) -> dict[str, int]:
    seen: dict[str, int] = {}
    for number in range(cases):
        outcome = run_case(s, seed, number)
        seen[outcome] = seen.get(outcome, 0) + 1
    return seen


def test_a_seeded_fuzz_neither_crashes_hangs_nor_diverges_from_lua(servers: Servers) -> None:
    seen = fuzz(servers, seed=1, cases=250)
    # It reaches each kind of ending: the same keys as Lua, an error like Lua's, a
    # bad input refused, a bad meta field the call did not need.
    assert set(seen) == {"same", "both failed", "refused", "module only"}, seen
    assert seen["same"] > 50, seen


async def test_the_differential_sequences_on_the_sanitized_module(servers: Servers) -> None:
    """test_native_claim's random claims, releases and splits, on the ASan build."""
    async with (
        aioredis.Redis(port=servers.lua_server.port) as lua,
        aioredis.Redis(port=servers.module_server.port) as module,
    ):
        pair = Pair(lua, module)
        for seed in (5, 6):
            await pair.start()
            await run_sequence(pair, random.Random(seed), steps=60)
    servers.healthy("after the sequences")


@pytest.mark.native_fuzz
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("seed", [2, 3, 4])
def test_a_long_seeded_fuzz(servers: Servers, seed: int) -> None:
    seen = fuzz(servers, seed=seed, cases=6000)
    assert seen.get("same", 0) > 1000, seen


# -- the reproductions, on the module as `make setup` builds it ----------------------


@pytest.fixture
def member(redis_servers: Any) -> Iterator[redis.Redis]:
    (server,) = redis_servers(1, native=True)
    with redis.Redis(port=server.port, socket_timeout=WATCHDOG_S) as client:
        client.set(b"p:epoch", b"e1:0:trusted")
        yield client
        assert server.running, "the member died"
        assert client.ping()


def refused(client: redis.Redis, *args: Any) -> str:
    reply = call(client, "DD.CLAIM", b"p:meta", *args)
    assert isinstance(reply, ResponseError), reply
    return str(reply)


def test_a_digest_length_whose_product_wraps_is_refused(member: redis.Redis) -> None:
    """`n * len > digests_len` wrapped: Redis aborted allocating 4611686018427387922 bytes."""
    got = refused(member, b"p:", 60000, 60000, 16, b"e1", 4611686018427387904, b"", b"a,b,c,d,")
    assert "DD.CLAIM: digest length out of range" in got
    # within the bounds, a product beyond the digests is refused too (no wrap)
    got = refused(member, b"p:", 60000, 60000, 16, b"e1", 2**20, b"x" * 100, b"a," * 4)
    assert "DD.CLAIM: fewer digests than owners" in got


@pytest.mark.parametrize("buckets", [2**62, 2**63 - 1, MAX_BUCKETS + 1, 0, -1])
def test_buckets_out_of_range_as_an_argument_are_refused(member: redis.Redis, buckets: int) -> None:
    """2^62 and more looped for ever in slice_entry (`m * 2` overflowed)."""
    got = refused(member, b"p:", 60000, 60000, buckets, b"e1", 3, b"abc", b"a,")
    assert "DD.CLAIM: buckets out of range" in got


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({b"buckets:1": 2**62}, "buckets:1"),
        ({b"grown:1": 2**62}, "grown:1"),
        ({b"buckets:1": 0}, "buckets:1"),  # Lua loops for ever on it too
        ({b"grown:1": b"inf"}, "grown:1"),
        ({b"id": 2**63 - 1}, "id"),
        ({b"ends": 2**63 - 1}, "ends"),
        ({b"live": b"1:" + b"9" * 30 + b","}, "live"),
        ({b"live": b"1:" + b"1," * 5000}, "live"),  # Lua's unpack fails on it
    ],
)
def test_meta_fields_out_of_range_are_refused(
    member: redis.Redis, fields: dict[bytes, Any], named: str
) -> None:
    member.hset(b"p:meta", mapping={b"id": 1, b"ends": 2**50, **fields})
    got = refused(member, b"p:", 60000, 60000, 16, b"e1", 3, b"abc", b"a,")
    assert f"DD.CLAIM: slice meta field {named} out of range" in got


def test_a_crafted_meta_cannot_divide_by_zero_in_a_split(member: redis.Redis) -> None:
    """buckets:1 = 2^31 with grown:1 = 1 made `(uint32_t)(2 * m)` 0: SIGFPE in grow."""
    member.hset(b"p:meta", mapping={b"id": 1, b"ends": 2**50, b"buckets:1": 2**31,
                                    b"grown:1": 1, b"marks:1": 10**12})  # fmt: skip
    member.hset(b"p:m:1:-2147483647", b"abc", b"x")
    got = refused(member, b"p:", 60000, 60000, 16, b"e1", 3, b"xyz", b"a,")
    assert "DD.CLAIM: slice meta field buckets:1 out of range" in got


@pytest.mark.parametrize(
    ("position", "value", "what"),
    [
        (0, 0, "ttl"), (0, -1, "ttl"), (0, 2**62, "ttl"), (0, b"", "ttl"),
        (1, 0, "slice"), (1, -60000, "slice"), (1, 2**63 - 1, "slice"),
        (4, 2, "digest length"), (4, -12, "digest length"),
        (5, b"x" * 11, "fewer digests than owners"),
    ],
)  # fmt: skip
def test_zero_negative_and_huge_numbers_are_refused(
    member: redis.Redis, position: int, value: Any, what: str
) -> None:
    """Zero or negative ttl and slice were taken; huge ones overflowed `now + slice`."""
    args: list[Any] = [60000, 60000, 16, b"e1", 12, b"y" * 12, b"a,"]
    args[position] = value
    got = refused(member, b"p:", *args)
    assert f"DD.CLAIM: {what}" in got


def test_a_ledger_that_outlived_its_meta_gives_a_new_bucket_luas_expiry(
    redis_servers: Any,
) -> None:
    """The meta deleted, the slice's expiry ledger left: the module trusted its bits
    and the new bucket got no expiry (PTTL -1: never reclaimed); Lua, which reads no
    bits for a slice without `expires:`, gives it ttl + slice (119,999 ms)."""
    (module_server,) = redis_servers(1, native=True)
    (lua_server,) = redis_servers(1)
    digest = b"\x00\x00\x05" + b"d" * 9  # bucket 5 of 16
    args = [b"p:", 60000, 60000, 16, b"e1", 12, digest, b"11,"]
    pttl = []
    with (
        redis.Redis(port=module_server.port, socket_timeout=WATCHDOG_S) as module,
        redis.Redis(port=lua_server.port, socket_timeout=WATCHDOG_S) as lua,
    ):
        sha = lua.script_load(scripts.CLAIM)
        for client in (module, lua):
            client.set(b"p:epoch", b"e1:0:trusted")
            client.setbit(b"p:x:1", 5, 1)  # a ledger vouching for bucket 5
        assert module.execute_command("DD.CLAIM", b"p:meta", *args) == [1]
        assert lua.evalsha(sha, 1, b"p:meta", *args) == [1]
        for client in (module, lua):
            pttl.append(client.pttl(b"p:m:1:5"))
            assert 118_000 < client.pttl(b"p:x:1") <= 120_000  # the ledger's own, as Lua
        assert_same_keys(snapshot(lua), snapshot(module), b"p:meta")
    assert all(118_000 < left <= 120_000 for left in pttl), pttl
