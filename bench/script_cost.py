"""Redis CPU per digest of the claim script, how long one call holds an instance,
and how a batch's chunks are best sent.

    python -m bench.script_cost                      # 200k new ids, batches of 2000, 3 instances
    python -m bench.script_cost --instances 1        # without 3 servers sharing 2 cores
    python -m bench.script_cost --fill 300           # steady state: ~300 marks per bucket, 3 slices
    python -m bench.script_cost --batch 100000       # the largest batch: calls stay short
    python -m bench.script_cost --warm 200000        # buckets already there (mid-slice)
    python -m bench.script_cost --compare-sending    # pipelined chunks against the others

Starts its own redis-server processes on free ports and calls `Quorum.claim`
(the product's path). Redis CPU per digest is read two ways, per instance:
`INFO commandstats` (EVALSHA usec / digests: wall time inside the script,
which grows when the servers wait for a core) and `INFO cpu` (the server
process's CPU seconds / digests: includes reading the request). The longest
call comes from `LATENCY HISTOGRAM evalsha` (power-of-two buckets): what
another gateway can wait behind one call. `redis-cli --latency` on the first
instance, run alongside, shows what a plain client waited.
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

from bench.steady import fill_older
from devtools.localstack import ManagedProcess, redis_server
from gateway import sizing
from gateway.config import Settings, load_settings
from gateway.contract.tokens import mark_digest, owner_token
from gateway.metrics import Metrics
from gateway.quorum.link import MemberLink
from gateway.quorum.quorum import Quorum
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
    p.add_argument("--rounds", type=int, default=3, help="rounds of --compare-sending")
    return p.parse_args()


class Gathered(Transport):
    """Each chunk its own call, all at once: the pool opens a connection per chunk."""

    async def run(
        self, inst: MemberLink, what: str, calls: Any, group: int = 0
    ) -> list[Any | None]:
        return list(await asyncio.gather(
            *(inst.timed(what, partial(inst.scripts[name], keys=keys, args=args))
              for name, keys, args in calls)
        ))  # fmt: skip


class Sequential(Transport):
    """Each chunk its own call, one after another."""

    async def run(
        self, inst: MemberLink, what: str, calls: Any, group: int = 0
    ) -> list[Any | None]:
        return [await inst.timed(what, partial(inst.scripts[name], keys=keys, args=args))
                for name, keys, args in calls]  # fmt: skip


class OneCall(Transport):
    """The whole batch in one call, as before chunks."""

    async def grouped(self, inst: MemberLink, what: str, digests: Any, plan: Any) -> Any:
        chunk, sizing.CHUNK_DIGESTS = sizing.CHUNK_DIGESTS, len(digests)
        try:
            return await super().grouped(inst, what, digests, plan)
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
    for inst in quorum.members:
        client = inst.client
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
        owners = [owner_token(tag, 0, start + i) for i in range(len(chunk))]
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
            for inst in quorum.members:
                await fill_older(inst.client, quorum.prefix, args.buckets, args.fill, ttl_ms)
        if args.warm:
            warm = [mark_digest(f"warm-{i}".encode()) for i in range(args.warm)]
            await claim_all(quorum, warm, args.batch, "warm")
        copies = int(args.digests * args.duplicates)
        ids = [mark_digest(f"id-{i}".encode()) for i in range(args.digests - copies)]
        ids += ids[:copies]
        for inst in quorum.members:
            await inst.client.config_resetstat()
        before = await server_stats(quorum)
        t0, cpu0 = time.perf_counter(), time.process_time()
        await claim_all(quorum, ids, args.batch, "run")
        seconds, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        return Measured(ids, before, await server_stats(quorum), seconds, cpu)
    finally:
        await quorum.close()


def report_cost(
    args: argparse.Namespace, servers: list[ManagedProcess], waited: str, measured: Measured
) -> None:
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
    console.print(
        f"[bold]{mean:.2f} usec per digest per instance (commandstats), "
        f"{sum(cpu_us) / len(cpu_us) / len(ids):.2f} (used_cpu), "
        f"{sum(cpu_us) / len(cpu_us) / distinct:.2f} per new id (used_cpu), "
        f"{statistics.median(grown):.1f} bytes per mark (used_memory)[/] "
        f"({len(ids):,} digests, {copies:,} copies, batches of {args.batch}, "
        f"buckets {args.buckets}, ttl {args.ttl}"
        f"{f', fill {args.fill}: 3 live slices' if args.fill else ''}"
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
                for inst in quorum.members:
                    await inst.client.flushall()
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


def main() -> int:
    args = parse()
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
            report_cost(args, servers, waited, measured)
        finally:
            if latency is not None and latency.poll() is None:
                latency.kill()
                latency.wait()
            for server in servers:
                server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
