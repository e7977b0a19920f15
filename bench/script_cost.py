"""Redis CPU per digest of the claim script, how long one call holds an instance,
and how a batch's chunks are best sent.

    python -m bench.script_cost                      # 200k new ids, batches of 2000, 3 instances
    python -m bench.script_cost --instances 1        # without 3 servers sharing 2 cores
    python -m bench.script_cost --fill 32            # steady state: ~32 marks per bucket, 3 slices
    python -m bench.script_cost --batch 100000       # the largest batch: calls stay short
    python -m bench.script_cost --warm 200000        # buckets already there (mid-slice)
    python -m bench.script_cost --compare-sending    # pipelined chunks against the others
    python -m bench.script_cost --floor --fill 32    # what each part of a new id costs

Every run also gives the claim's Redis CPU per new id over a pipelined `SET key
NX PX` on the same servers right after it (`bench/host_units.py`): the figure
that compares across hosts.

Starts its own redis-server processes on free ports and calls `Quorum.claim`
(the product's path). Redis CPU per digest is read two ways, per instance:
`INFO commandstats` (EVALSHA usec / digests: wall time inside the script,
which grows when the servers wait for a core) and `INFO cpu` (the server
process's CPU seconds / digests: includes reading the request). The longest
call comes from `LATENCY HISTOGRAM evalsha` (power-of-two buckets): what
another gateway can wait behind one call. `redis-cli --latency` on the first
instance, run alongside, shows what a plain client waited.

`--floor` shows what bounds the script: on one instance whose older slices
are full (`--fill`), the Redis CPU per id (`INFO cpu`) of a plain `SET key NX
PX` per id (pipelined, no script), then of one script call per chunk of 500
digests doing only the claim's loop (digest, bucket name), one `redis.call`
that finds no key, an `HGET` that misses in a full older bucket (one older
slice's lookup), an `HSETNX` of a new field in the current slice, and the
claim script itself: the product's cost per new id is about the loop, the
`HSETNX`, an `HGET` per older slice and the expiry ledger.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis
import uvloop
from rich.console import Console

from bench.host_units import set_nx_cost
from bench.steady import SIZING_FILL, fill_older
from devtools.localstack import ManagedProcess, redis_server
from gateway import sizing
from gateway.config import Settings, load_settings, parse_duration
from gateway.contract.tokens import mark_digest, owner_token, owner_tokens
from gateway.metrics import Metrics
from gateway.quorum.link import MemberLink
from gateway.quorum.quorum import Quorum
from gateway.quorum.scripts import SLICES_BACK
from gateway.quorum.transport import Transport

console = Console()


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.script_cost", description=__doc__)
    p.add_argument("--digests", type=int, default=200_000, help="new ids claimed (measured)")
    p.add_argument("--batch", type=int, default=2000, help="digests per Quorum.claim call")
    p.add_argument("--instances", type=int, default=3)
    p.add_argument("--buckets", type=int, default=16_384, help="[redis] buckets")
    p.add_argument("--ttl", default="24h", help="[redis] ttl")
    p.add_argument("--duplicates", type=float, default=0.0, help="share of copies in the run")
    p.add_argument(
        "--fill",
        type=int,
        default=0,
        help="marks per bucket at steady state: --buckets becomes --digests / FILL, two "
        "older slices are written full first (bench/steady.py), so every new id searches "
        "three slices of FILL-mark buckets, and the run fills the current one to FILL",
    )
    p.add_argument(
        "--warm",
        type=int,
        default=0,
        help="first claim this many other new ids in the same slice, unmeasured: the "
        "buckets exist and their expiry is set, as through most of a slice",
    )
    p.add_argument(
        "--compare-sending",
        action="store_true",
        help="time a batch's chunks sent pipelined (the product), gathered on separate "
        "connections, one after another, and the whole batch as one call (before chunks)",
    )
    p.add_argument("--rounds", type=int, default=3, help="rounds of --compare-sending / --floor")
    p.add_argument(
        "--floor",
        action="store_true",
        help="the Redis CPU per id of each part of a claim (one instance; see above)",
    )
    return p.parse_args()


class Gathered(Transport):
    """Each chunk its own call, all at once: the pool opens a connection per chunk."""

    async def run(
        self, member: MemberLink, what: str, calls: Any, group: int = 0
    ) -> list[Any | None]:
        return list(await asyncio.gather(
            *(member.timed(what, partial(member.scripts[name], keys=keys, args=args))
              for name, keys, args in calls)
        ))  # fmt: skip


class Sequential(Transport):
    """Each chunk its own call, one after another."""

    async def run(
        self, member: MemberLink, what: str, calls: Any, group: int = 0
    ) -> list[Any | None]:
        return [await member.timed(what, partial(member.scripts[name], keys=keys, args=args))
                for name, keys, args in calls]  # fmt: skip


class OneCall(Transport):
    """The whole batch in one call, as before chunks."""

    async def grouped(self, member: MemberLink, what: str, digests: Any, plan: Any) -> Any:
        chunk, sizing.CHUNK_DIGESTS = sizing.CHUNK_DIGESTS, len(digests)
        try:
            return await super().grouped(member, what, digests, plan)
        finally:
            sizing.CHUNK_DIGESTS = chunk


SENDING: dict[str, type[Transport]] = {
    "pipelined (product)": Transport,
    "gathered": Gathered,
    "sequential": Sequential,
    "one call per batch": OneCall,
}


async def server_stats(quorum: Quorum) -> Stats:
    """Per instance: EVALSHA calls and usec since CONFIG RESETSTAT, the server's CPU
    seconds, and the upper bound (usec) of the slowest EVALSHA's histogram bucket."""
    out = []
    for member in quorum.members:
        client = member.client
        assert isinstance(client, aioredis.Redis), "standalone members only"
        stats: dict[str, Any] = await client.info("commandstats")
        row = stats.get("cmdstat_evalsha", {"calls": 0, "usec": 0})
        cpu: dict[str, Any] = await client.info("cpu")
        used = float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"])
        histogram = await client.execute_command(  # type: ignore[no-untyped-call]
            "LATENCY", "HISTOGRAM", "evalsha"
        )  # {b"evalsha": {b"calls": n, b"histogram_usec": {bound: count}}}
        buckets = histogram.get(b"evalsha", {}).get(b"histogram_usec", {})
        longest = max((int(bound) for bound in buckets), default=0)
        memory: dict[str, Any] = await client.info("memory")
        out.append((int(row["calls"]), int(row["usec"]), used, longest, int(memory["used_memory"])))
    return out


async def claim_all(quorum: Quorum, ids: list[bytes], batch: int, tag: str) -> list[float]:
    """Claim `ids` batch by batch; the seconds each batch took."""
    took = []
    for start in range(0, len(ids), batch):
        chunk = ids[start : start + batch]
        # one BLAKE2b per partition batch, as the raw loop makes them
        owners = owner_tokens(tag, 0, range(start, start + len(chunk)))
        t0 = time.perf_counter()
        await quorum.claim(chunk, owners)
        took.append(time.perf_counter() - t0)
    return took


Stats = list[tuple[int, int, float, int, int]]  # per instance: see server_stats


@dataclass
class Measured:
    ids: list[bytes]
    before: Stats
    after: Stats
    seconds: float
    cpu: float  # the gateway process's


async def measure_cost(args: argparse.Namespace, settings: Settings) -> Measured:
    """Claim the run's ids, with the servers' statistics before and after."""
    quorum = Quorum(settings.redis, Metrics())
    try:
        await quorum.check()  # first contact: the instances' epochs
        if args.fill:
            ttl_ms = int(settings.redis.ttl.total_seconds() * 1000)
            for member in quorum.members:
                assert isinstance(member.client, aioredis.Redis), "standalone members only"
                await fill_older(member.client, quorum.prefix, args.buckets, args.fill, ttl_ms)
        if args.warm:
            warm = [mark_digest(f"warm-{i}".encode()) for i in range(args.warm)]
            await claim_all(quorum, warm, args.batch, "warm")
        copies = int(args.digests * args.duplicates)
        ids = [mark_digest(f"id-{i}".encode()) for i in range(args.digests - copies)]
        ids += ids[:copies]
        for member in quorum.members:
            await member.client.config_resetstat()
        before = await server_stats(quorum)
        t0, cpu0 = time.perf_counter(), time.process_time()
        await claim_all(quorum, ids, args.batch, "run")
        seconds, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        return Measured(ids, before, await server_stats(quorum), seconds, cpu)
    finally:
        await quorum.close()


async def set_nx_each(urls: list[str], ttl: str) -> list[float]:
    """Per server, Redis CPU µs per pipelined `SET key NX PX` (bench/host_units.py),
    on the data the run left: the unit every Redis figure is given in."""
    ttl_ms = int(parse_duration(ttl).total_seconds() * 1000)
    return [await set_nx_cost(url, 100_000, ttl_ms, "script-cost") for url in urls]


def report_cost(
    args: argparse.Namespace, servers: list[ManagedProcess], waited: str, measured: Measured,
    set_nx: list[float],
) -> None:  # fmt: skip
    ids, before, stats = measured.ids, measured.before, measured.after
    seconds, cpu = measured.seconds, measured.cpu
    copies = int(args.digests * args.duplicates)
    cpu_us = [(after[2] - b[2]) * 1e6 for b, after in zip(before, stats, strict=True)]
    distinct = len(ids) - copies
    grown = [(after[4] - b[4]) / distinct for b, after in zip(before, stats, strict=True)]
    for server, (calls, usec, _, longest, _), used in zip(servers, stats, cpu_us, strict=True):
        console.print(
            f"{server.name}: {calls} EVALSHA, {usec / max(calls, 1):,.0f} usec per call "
            f"(longest <= {longest:,} usec), {usec / len(ids):.2f} usec per digest "
            f"(commandstats), {used / len(ids):.2f} usec CPU per digest (used_cpu)"
        )
    mean = sum(s[1] for s in stats) / len(stats) / len(ids)
    ratios = [used / distinct / nx for used, nx in zip(cpu_us, set_nx, strict=True)]
    console.print(
        f"[bold]x SET NX per new id per instance: {', '.join(f'{r:.2f}' for r in ratios)}[/] "
        f"(SET NX {', '.join(f'{v:.2f}' for v in set_nx)} usec per key, pipelined, same servers)"
    )
    console.print(
        f"[bold]{mean:.2f} usec per digest per instance (commandstats), "
        f"{sum(cpu_us) / len(cpu_us) / len(ids):.2f} (used_cpu), "
        f"{sum(cpu_us) / len(cpu_us) / distinct:.2f} per new id (used_cpu), "
        f"{statistics.median(grown):.1f} bytes per mark (used_memory)[/] "
        f"({len(ids):,} digests, {copies:,} copies, batches of {args.batch}, "
        f"buckets {args.buckets}, ttl {args.ttl}"
        f"{f', fill {args.fill}: {SLICES_BACK + 1} live slices' if args.fill else ''}"
        f"{f', after {args.warm:,} warm-up ids' if args.warm else ''}); "
        f"{len(ids) / seconds:,.0f} digests/s, gateway CPU {cpu / len(ids) * 1e6:.1f} usec "
        f"per digest; redis-cli --latency on {servers[0].name}: {waited}"
    )


async def compare_sending(args: argparse.Namespace, settings: Settings) -> None:
    """Each way of sending claims the same number of fresh ids, rounds interleaved."""
    results: dict[str, list[tuple[float, float, float]]] = {name: [] for name in SENDING}
    for round_no in range(args.rounds):
        for name, cls in SENDING.items():
            quorum = Quorum(settings.redis, Metrics(), transport=cls)
            try:
                for member in quorum.members:
                    await member.client.flushall()
                await quorum.check()
                ids = [mark_digest(f"{round_no}-{name}-{i}".encode()) for i in range(args.digests)]
                t0, cpu0 = time.perf_counter(), time.process_time()
                took = await claim_all(quorum, ids, args.batch, name)
                wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
                results[name].append(
                    (len(ids) / wall, cpu / len(ids) * 1e6, statistics.median(took) * 1000)
                )
            finally:
                await quorum.close()
    console.print(
        f"sending {args.digests:,} new ids in batches of {args.batch} to {args.instances} "
        f"instances, chunks of {sizing.CHUNK_DIGESTS}, {sizing.CHUNKS_PER_TRIP} per round "
        f"trip; medians of {args.rounds} rounds"
    )
    for name, runs in results.items():
        console.print(
            f"  {name:22s} {statistics.median(r[0] for r in runs):>9,.0f} ids/s   gateway CPU "
            f"{statistics.median(r[1] for r in runs):5.2f} usec/id   batch "
            f"{statistics.median(r[2] for r in runs):6.1f} ms"
        )


# One call per chunk, each digest's bucket named as the claim script does (prelude.lua,
# `hash_of`, `bucket_of`); ARGV: what to do per digest, key prefix, buckets, digests.
PART = """#!lua
local what, prefix, buckets, digests = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4]
local owner = ARGV[5]
for i = 1, #digests / 12 do
  local digest = string.sub(digests, (i - 1) * 12 + 1, i * 12)
  local a, b, c = string.byte(digest, 1, 3)
  local bucket = string.format('%s%d', prefix, (a * 65536 + b * 256 + c) % buckets)
  if what == 'hget' then redis.call('HGET', bucket, digest)
  elseif what == 'hsetnx' then redis.call('HSETNX', bucket, digest, owner) end
end
return 0
"""
# (name, what, bucket prefix): `m:1:` is a full older slice, `m:9:` a slice no mark is in
# yet, `none:` names no key.
PARTS = (
    ("script loop only (digest, bucket name)", "loop", b"m:1:"),
    ("loop + one redis.call that finds no key (HGET)", "hget", b"none:"),
    ("loop + HGET missing in a full older bucket", "hget", b"m:1:"),
    ("loop + HSETNX of a new field, current slice", "hsetnx", b"m:9:"),
)


SET_NX = "SET key NX PX per id, pipelined (no script)"
PRODUCT = f"the claim script, {SLICES_BACK + 1} live slices (product)"


async def floor(args: argparse.Namespace, settings: Settings) -> None:
    """Per round, a fresh fill; each part on its own fresh ids; medians over rounds."""
    costs: dict[str, list[float]] = {}
    for round_no in range(args.rounds):
        quorum = Quorum(settings.redis, Metrics())  # a new one per round: the data is new
        try:
            await floor_round(args, settings, quorum, round_no, costs)
        finally:
            await quorum.close()
    console.print(
        f"Redis CPU per id (used_cpu), one instance, {args.digests:,} ids, {args.buckets:,} "
        f"buckets, older slices full at {args.fill} marks per bucket; medians of "
        f"{args.rounds} rounds (each round's in brackets)"
    )
    for name, values in costs.items():
        console.print(
            f"  {name:52s} {statistics.median(values):6.2f} usec   "
            f"({', '.join(f'{v:.2f}' for v in values)})"
        )
    # The same ratio on any machine: a plain SET NX's cost moves with the machine
    # (2.16 us on one, 4.05 on another), and the claim's with it.
    set_nx, product = (statistics.median(values) for values in (costs[SET_NX], costs[PRODUCT]))
    console.print(f"  claim per new id / SET NX per key, same rounds: {product / set_nx:.2f}")


async def floor_round(
    args: argparse.Namespace, settings: Settings, quorum: Quorum, round_no: int,
    costs: dict[str, list[float]],
) -> None:  # fmt: skip
    """One round of `floor`, its costs appended to `costs`."""
    client = quorum.members[0].client
    assert isinstance(client, aioredis.Redis), "standalone members only"
    prefix, owner = quorum.prefix, owner_token("raw", 0, 1)
    ttl_ms = int(settings.redis.ttl.total_seconds() * 1000)

    async def cpu() -> float:
        info: dict[str, Any] = await client.info("cpu")
        return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])

    await client.flushall()
    await quorum.check()
    await fill_older(client, prefix, args.buckets, args.fill, ttl_ms)
    sha = await client.script_load(PART)
    ids = [mark_digest(f"{round_no}-{i}".encode()) for i in range(args.digests)]
    t0 = await cpu()
    for start in range(0, len(ids), 2000):
        async with client.pipeline(transaction=False) as pipe:
            for digest in ids[start : start + 2000]:
                pipe.set(prefix + b"k:" + digest, owner, nx=True, px=ttl_ms)
            await pipe.execute()
    costs.setdefault(SET_NX, []).append((await cpu() - t0) / len(ids) * 1e6)
    for part, (name, what, keys) in enumerate(PARTS):
        part_ids = [d[:11] + bytes([part]) for d in ids]  # fresh fields, same buckets
        t0 = await cpu()
        for start in range(0, len(part_ids), 500):
            chunk = b"".join(part_ids[start : start + 500])
            await client.evalsha(sha, 0, what, prefix + keys, args.buckets, chunk, owner)
        costs.setdefault(name, []).append((await cpu() - t0) / len(ids) * 1e6)
    t0 = await cpu()
    await claim_all(quorum, ids, args.batch, f"floor-{round_no}")
    costs.setdefault(PRODUCT, []).append((await cpu() - t0) / len(ids) * 1e6)


def main() -> int:
    args = parse()
    if args.floor:
        args.instances = 1
        args.fill = args.fill or SIZING_FILL
    if args.fill:
        args.buckets = max(1, (args.digests - int(args.digests * args.duplicates)) // args.fill)
    with tempfile.TemporaryDirectory(prefix="script-cost-") as state:
        servers = [redis_server(Path(state), f"redis-{i}") for i in range(args.instances)]
        latency: subprocess.Popen[bytes] | None = None
        try:
            for server in servers:
                server.start()
            urls = [f"redis://127.0.0.1:{s.port}/0" for s in servers]
            settings = load_settings(
                redis={"nodes": urls, "buckets": args.buckets, "ttl": args.ttl, "timeout": "30s"}
            )
            if args.compare_sending:
                uvloop.run(compare_sending(args, settings))
                return 0
            if args.floor:
                uvloop.run(floor(args, settings))
                return 0
            redis_cli = shutil.which("redis-cli")
            if redis_cli:  # what a plain client on the first instance waits meanwhile
                latency = subprocess.Popen(
                    [redis_cli, "-p", str(servers[0].port), "--latency", "--raw"],
                    stdout=subprocess.PIPE, stdin=subprocess.DEVNULL,
                )  # fmt: skip
            measured = uvloop.run(measure_cost(args, settings))
            waited = "n/a"
            if latency is not None:
                latency.terminate()
                fields = latency.communicate(timeout=10)[0].decode().split()
                if len(fields) >= 4:  # min max avg samples
                    waited = f"min {fields[0]} / max {fields[1]} / avg {fields[2]} ms"
            set_nx = uvloop.run(set_nx_each(urls, args.ttl))
            report_cost(args, servers, waited, measured, set_nx)
        finally:
            if latency is not None and latency.poll() is None:
                latency.kill()
                latency.wait()
            for server in servers:
                server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
