"""A new id's Redis CPU through a real `dedup-gateway run`, in units of a pipelined
`SET key NX PX` measured on the same server in the same round.

    python -m bench.host_units                         # 5,000 new ids/s + 20% copies, 3 rounds
    python -m bench.host_units --rate 5000 --seconds 40 --fill 32 --rounds 3
    python -m bench.host_units --fill 0 --buckets 1    # fresh members, a first slice of 1 bucket
    python -m bench.host_units --claims lua            # the Lua claim only (default: lua,module)

Absolute µs differ from host to host by 1.5-2x (a SET NX costs 2.2 µs on one
machine and 4.0 on another), so every Redis figure here is also given over a SET
NX of the same server, measured right after the gateway's run, on the data the
run left (same memory, same round). Per round:

1. Every member flushed, then filled to steady state (bench/steady.py: the older
   live slices full at `--fill` marks per bucket, `[redis] buckets` = the run's
   new ids ÷ fill, so the current slice fills from empty to `--fill` too).
2. A real gateway process (`python -m gateway run`, bench/processes.py) on the
   local broker, the load generator (bench/loader.py) offering `--rate` new ids/s
   plus `--duplicates` copies from its own process; after `--warmup` s, each
   member's `used_cpu_user + used_cpu_sys` (INFO cpu: CPU time, not wall time,
   so a loaded host slows it less than it slows a wall clock) and the gateway's
   counters are read, and again `--seconds` later.
3. On each member, `--set-nx` fresh keys with `SET key NX PX ttl`, pipelined 2,000
   per round trip (no script): its CPU per key.

Printed per round and as medians: Redis CPU per new id per member (µs and x SET
NX; and less what the member burns idle, its cron and active expiry, read for
5 s after the load: at 5,000 ids/s that is a share of a new id's cost a benchmark
at full speed never sees), ids per script call (`INFO commandstats`),
bytes per mark (`used_memory` growth over the run ÷ new ids, clients' buffers
included) and the gateway process's CPU per record. `--out FILE` writes every
round as JSON.

Each round measures every claim path of `--claims` in turn (`[redis] claim`: the Lua
script, and the native claim, a Redis module every member loads,
gateway/quorum/native), each with its own fill, gateway run and SET NX, and then
each path's claim alone: on one member, filled the same way, `Quorum.claim` over
`--alone` fresh new ids in batches of 2,000 (chunks of 500, no copies, no gateway
process), its CPU per new id beside a SET NX measured right after on that member.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis
import uvloop
from rich.console import Console

from bench.measure import REPO, bench_config, flush, prefill, redis_cpu, redis_info
from bench.processes import GatewayProcesses, write_config
from bench.steady import SIZING_FILL
from bench.variants import Variant
from devtools.localstack import LocalStack, free_port
from devtools.topics import create_topics
from gateway.config import load_settings
from gateway.contract.tokens import mark_digest, owner_tokens
from gateway.metrics import Metrics
from gateway.quorum import native
from gateway.quorum.quorum import Quorum
from gateway.quorum.scripts import SLICES_BACK

console = Console()
GATEWAY_3 = Variant("gateway-3", redis=3)
SET_NX_PIPELINE = 2000
IDLE_S = 5.0  # how long each member's idle CPU is read after the run
ALONE_BATCH = 2000  # ids per Quorum.claim of the claim alone (4 chunks of 500)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.host_units", description=__doc__)
    p.add_argument("--rate", type=float, default=5000, help="new ids per second offered")
    p.add_argument("--duplicates", type=float, default=0.2, help="share of copies in the load")
    p.add_argument("--seconds", type=float, default=40, help="measured seconds per round")
    p.add_argument("--warmup", type=float, default=10, help="seconds before the measurement")
    p.add_argument(
        "--fill", type=int, default=SIZING_FILL,
        help="marks per bucket of the older live slices written first (steady state); 0: "
        "none, fresh members whose first slice starts from --buckets",
    )  # fmt: skip
    p.add_argument("--buckets", type=int, default=0, help="[redis] buckets (0: the default)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--set-nx", type=int, default=100_000, help="SET NX keys per member")
    p.add_argument(
        "--claims", default="lua,module",
        help="claim paths to measure, in turn each round: lua, module (the native claim)",
    )  # fmt: skip
    p.add_argument("--alone", type=int, default=100_000, help="new ids of the claim alone")
    p.add_argument("--paced", type=int, default=20_000, help="SET NX keys at the run's pace")
    p.add_argument("--out", type=Path, help="write every round as JSON here")
    return p.parse_args(argv)


@dataclass
class Round:
    round: int
    new_ids: int  # forwarded in the measured window
    records: int  # handled in the measured window (new ids and copies)
    redis_us_per_new_id: list[float]  # per member
    set_nx_us: list[float]  # per member, same round
    paced_set_nx_us: list[float]  # per member: SET NX at the run's pace (trips, their rate)
    ids_per_call: list[float]  # per member: records per script call (EVALSHA, DD.CLAIM)
    bytes_per_mark: list[float]  # per member, over the whole run
    idle_us_per_s: list[float]  # per member: its CPU with no load, after the run
    gateway_us_per_record: float
    live_slices: int
    fill: int

    seconds: float = 0.0  # the measured window
    claim: str = "lua"  # `[redis] claim`: lua, or module (the native claim)
    alone_us: float = 0.0  # the claim alone: Redis CPU per new id, one member
    alone_set_nx_us: float = 0.0  # a SET NX on that member right after
    # The first member: µs per new id inside each command (INFO commandstats) over the window
    commands_us: dict[str, float] = field(default_factory=dict)

    @property
    def paced_ratio(self) -> list[float]:
        """Redis CPU per new id over a SET NX sent at the run's pace."""
        pairs = zip(self.redis_us_per_new_id, self.paced_set_nx_us, strict=True)
        return [r / s for r, s in pairs]

    @property
    def alone_ratio(self) -> float:
        return self.alone_us / self.alone_set_nx_us if self.alone_set_nx_us else 0.0

    @property
    def ratio(self) -> list[float]:
        return [r / s for r, s in zip(self.redis_us_per_new_id, self.set_nx_us, strict=True)]

    @property
    def net_ratio(self) -> list[float]:
        """`ratio` less what the member spends idle (its cron, active expiry) over the
        window: the claims' own cost per new id."""
        return [
            (r - idle * self.seconds / self.new_ids) / s
            for r, s, idle in zip(
                self.redis_us_per_new_id, self.set_nx_us, self.idle_us_per_s, strict=True
            )
        ]


async def command_stats(urls: list[str]) -> list[dict[str, tuple[int, int]]]:
    """Per server, (calls, µs inside the command) so far per command (`INFO commandstats`)."""
    out = []
    for url in urls:
        async with aioredis.Redis.from_url(url) as client:
            stats: dict[str, Any] = await client.info("commandstats")
            out.append({name.removeprefix("cmdstat_"): (int(v["calls"]), int(v["usec"]))
                        for name, v in stats.items()})  # fmt: skip
    return out


def script_calls(stats: dict[str, tuple[int, int]]) -> int:
    """Script calls, the native claim's included (one per chunk either way)."""
    return sum(stats.get(name, (0, 0))[0] for name in ("evalsha", native.COMMAND.lower()))


async def set_nx_cost(
    url: str, keys: int, ttl_ms: int, tag: str, per_trip: int = SET_NX_PIPELINE,
    every_s: float = 0.0,
) -> float:  # fmt: skip
    """Redis CPU (µs) per pipelined `SET key NX PX` of fresh keys on one server,
    `per_trip` per round trip, one trip every `every_s` (0: back to back)."""
    async with aioredis.Redis.from_url(url) as client:

        async def cpu() -> float:
            return redis_cpu([await client.info("cpu")])

        value = b"%d" % (2**62 + 12345)  # an owner token's size
        t0 = await cpu()
        for start in range(0, keys, per_trip):
            async with client.pipeline(transaction=False) as pipe:
                for i in range(start, min(start + per_trip, keys)):
                    pipe.set(b"setnx:%s:%012d" % (tag.encode(), i), value, nx=True, px=ttl_ms)
                await pipe.execute()
            if every_s:
                await asyncio.sleep(every_s)  # the gateway's pace, not a wait for anything
        return (await cpu() - t0) / keys * 1e6


async def alone_cost(
    url: str, claim: str, args: argparse.Namespace, round_no: int
) -> tuple[float, float]:
    """The claim alone on one member filled as the gateway's run was: Redis CPU per
    new id of `Quorum.claim` over `--alone` fresh ids, and a SET NX right after (µs)."""
    await flush([url])
    n = args.alone
    if args.fill:
        await prefill([url], max(1, n // args.fill), args.fill)
    redis: dict[str, Any] = {"nodes": [url], "claim": claim}
    if args.buckets or args.fill:
        redis["buckets"] = args.buckets or max(1, n // args.fill)
    settings = load_settings(redis=redis).redis
    quorum = Quorum(settings, Metrics())
    try:
        ids = [mark_digest(f"alone-{round_no}-{claim}-{i}".encode()) for i in range(n + 1)]
        await quorum.claim(ids[:1], ["1"])  # the epoch, the path, the slice opened
        assert quorum.members[0].claim_path == claim, quorum.members[0].claim_path
        async with aioredis.Redis.from_url(url) as client:
            t0 = redis_cpu([await client.info("cpu")])
            for start in range(1, n + 1, ALONE_BATCH):
                chunk = ids[start : start + ALONE_BATCH]
                owners = owner_tokens(f"alone-{round_no}", 0, range(start, start + len(chunk)))
                await quorum.claim(chunk, owners)
            used = redis_cpu([await client.info("cpu")]) - t0
    finally:
        await quorum.close()
    ttl_ms = int(settings.ttl.total_seconds() * 1000)
    return used / n * 1e6, await set_nx_cost(url, args.set_nx, ttl_ms, f"alone-{round_no}-{claim}")


async def one_round(
    stack: LocalStack, args: argparse.Namespace, round_no: int, claim: str = "lua"
) -> Round:
    urls = stack.redis_urls[:3]
    await flush(urls)
    run_ids = int(args.rate * (args.warmup + args.seconds))
    if args.fill:
        await prefill(urls, max(1, run_ids // args.fill), args.fill)
    # Once an older slice is there, the new one is sized from its marks: the setting
    # counts for a member's first slice only.
    buckets = args.buckets or (max(1, run_ids // args.fill) if args.fill else 0)
    raw, clean = f"hu-raw-{round_no}-{claim}", f"hu-clean-{round_no}-{claim}"
    await create_topics(
        stack.bootstrap,
        {raw: 4, clean: 4, f"{clean}-quarantine": 1, "bench-failures": 1, "bench-dead-letter": 1},
    )  # the gateway creates no topic: it waits, unready, for a missing one
    port = free_port()
    config = bench_config(stack, GATEWAY_3, raw, clean, port, buckets)
    config["redis"]["claim"] = claim
    path = write_config(stack.state_dir / f"{clean}.toml", config)
    gateway = GatewayProcesses(path, 1, port, stack.state_dir / f"{clean}.log")
    counts = gateway.metrics
    stop = asyncio.Event()
    task = asyncio.create_task(gateway.run(stop))
    before = await redis_info(urls)
    offered = args.rate / (1 - args.duplicates)
    loader = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "bench.loader", "--bootstrap", stack.bootstrap, "--topic", raw,
        "--rate", str(offered), "--seconds", str(args.warmup + args.seconds + 2),
        "--duplicates", str(args.duplicates), "--seed", str(round_no),
        stdout=asyncio.subprocess.PIPE, cwd=REPO,
    )  # fmt: skip
    try:
        await asyncio.sleep(args.warmup)  # the load's own pace: the window is wall time
        if task.done():
            task.result()
        info0, cpu0, calls0 = await redis_info(urls), gateway.cpu_s(), await command_stats(urls)
        forwarded0, handled0 = counts.forwarded_total(), counts.handled()
        await asyncio.sleep(args.seconds)
        info1, cpu1, calls1 = await redis_info(urls), gateway.cpu_s(), await command_stats(urls)
        forwarded1, handled1 = counts.forwarded_total(), counts.handled()
        await loader.communicate()
    finally:
        if loader.returncode is None:
            loader.kill()
            await loader.wait()
        stop.set()
        await task
    after = await redis_info(urls)
    ttl_ms = int(load_settings(redis={"nodes": urls}).redis.ttl.total_seconds() * 1000)
    idle0 = [redis_cpu([i]) for i in await redis_info(urls)]
    await asyncio.sleep(IDLE_S)
    idle1 = [redis_cpu([i]) for i in await redis_info(urls)]
    idle = [(b - a) / IDLE_S * 1e6 for a, b in zip(idle0, idle1, strict=True)]
    set_nx = [await set_nx_cost(url, args.set_nx, ttl_ms, f"{round_no}-{claim}") for url in urls]
    new_ids, records = forwarded1 - forwarded0, handled1 - handled0
    calls = [script_calls(b) - script_calls(a) for a, b in zip(calls0, calls1, strict=True)]
    # The same SET NX at the run's pace: a trip of the run's new ids per claim call, as
    # often as its claim calls came, the members side by side (what the claims paid for
    # cold caches and round trips, a pipelined SET NX back to back does not).
    per_trip = max(1, round(new_ids / max(calls[0], 1)))
    pace = await asyncio.gather(*(
        set_nx_cost(url, args.paced, ttl_ms, f"{round_no}-{claim}-paced", per_trip,
                    args.seconds / max(calls[0], 1))
        for url in urls
    ))  # fmt: skip
    # Where the first member's CPU went: µs inside each command per new id (the rest of
    # its CPU is reading requests, writing replies, its event loop and expiry).
    inside = {name: (usec - calls0[0].get(name, (0, 0))[1]) / max(new_ids, 1)
              for name, (_, usec) in calls1[0].items()}  # fmt: skip
    distinct = counts.forwarded_total()
    return Round(
        round=round_no, new_ids=new_ids, records=records,
        redis_us_per_new_id=[
            (redis_cpu([b]) - redis_cpu([a])) / new_ids * 1e6
            for a, b in zip(info0, info1, strict=True)
        ],
        set_nx_us=set_nx, paced_set_nx_us=list(pace),
        ids_per_call=[records / max(c, 1) for c in calls],
        bytes_per_mark=[
            (float(b["used_memory"]) - float(a["used_memory"])) / distinct
            for a, b in zip(before, after, strict=True)
        ],
        gateway_us_per_record=(cpu1 - cpu0) / records * 1e6,
        idle_us_per_s=idle, seconds=args.seconds,
        live_slices=SLICES_BACK + 1 if args.fill else 1, fill=args.fill, claim=claim,
        commands_us={k: round(v, 3) for k, v in sorted(inside.items(), key=lambda kv: -kv[1])
                     if v > 0.005},
    )  # fmt: skip


def show(r: Round) -> None:
    console.print(
        f"round {r.round}, {r.claim} claim: the claim alone {r.alone_us:.2f} µs per new id, "
        f"SET NX {r.alone_set_nx_us:.2f} µs: x SET NX {r.alone_ratio:.2f}; through the gateway: "
        f"{r.new_ids:,} new ids of {r.records:,} records measured; Redis CPU "
        f"per new id per member {', '.join(f'{v:.2f}' for v in r.redis_us_per_new_id)} µs; "
        f"SET NX {', '.join(f'{v:.2f}' for v in r.set_nx_us)} µs; "
        f"x SET NX {', '.join(f'{v:.2f}' for v in r.ratio)} (at the run's pace: "
        f"{', '.join(f'{v:.2f}' for v in r.paced_ratio)}; less idle: "
        f"{', '.join(f'{v:.2f}' for v in r.net_ratio)}; idle "
        f"{', '.join(f'{v / 1000:.1f}' for v in r.idle_us_per_s)} ms/s); ids per call "
        f"{', '.join(f'{v:.0f}' for v in r.ids_per_call)}; bytes per mark "
        f"{', '.join(f'{v:.1f}' for v in r.bytes_per_mark)}; gateway CPU "
        f"{r.gateway_us_per_record:.2f} µs per record; inside commands (first member, µs per "
        f"new id): {', '.join(f'{k} {v:.2f}' for k, v in list(r.commands_us.items())[:6])}"
    )


async def main_async(args: argparse.Namespace) -> list[Round]:
    rounds: list[Round] = []
    claims = [c.strip() for c in args.claims.split(",") if c.strip()]
    module = native.build() if "module" in claims else None
    with tempfile.TemporaryDirectory(prefix="host-units-") as state:
        stack = LocalStack(Path(state), redis_count=3, redis_module=module).start()
        try:
            for round_no in range(args.rounds):
                for claim in claims:
                    r = await one_round(stack, args, round_no, claim)
                    r.alone_us, r.alone_set_nx_us = await alone_cost(
                        stack.redis_urls[0], claim, args, round_no
                    )
                    rounds.append(r)
                    show(r)
        finally:
            stack.stop()
    for claim in claims:
        summary(args, claim, [r for r in rounds if r.claim == claim])
    return rounds


def summary(args: argparse.Namespace, claim: str, rounds: list[Round]) -> None:
    ratios = [x for r in rounds for x in r.ratio]
    net = [x for r in rounds for x in r.net_ratio]
    alone = [r.alone_ratio for r in rounds]
    paced = [x for r in rounds for x in r.paced_ratio]
    console.print(
        f"[bold]{claim} claim, median of {len(rounds)} rounds: alone "
        f"{statistics.median(alone):.2f} x SET NX per new id "
        f"({', '.join(f'{v:.2f}' for v in alone)}); through the gateway, x 3 members: "
        f"{statistics.median(ratios):.2f} x SET NX per new id per member "
        f"({min(ratios):.2f}-{max(ratios):.2f}; over a SET NX at the run's pace "
        f"{statistics.median(paced):.2f}; less the members' "
        f"idle CPU {statistics.median(net):.2f}); "
        f"{statistics.median(x for r in rounds for x in r.redis_us_per_new_id):.2f} µs against "
        f"{statistics.median(x for r in rounds for x in r.set_nx_us):.2f}; "
        f"{statistics.median(x for r in rounds for x in r.bytes_per_mark):.1f} bytes per mark[/] "
        f"({args.rate:,.0f} new ids/s + {args.duplicates:.0%} copies, fill {args.fill}, "
        f"{SLICES_BACK + 1 if args.fill else 1} live slices, buckets {args.buckets or 'sized'}, "
        f"{args.seconds:.0f} s measured after {args.warmup:.0f} s)"
    )


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    rounds = uvloop.run(main_async(args))
    if args.out:
        args.out.write_text(json.dumps(
            {"started": started, "args": {k: str(v) for k, v in vars(args).items()},
             "rounds": [{**asdict(r), "ratio": r.ratio, "net_ratio": r.net_ratio,
                         "alone_ratio": r.alone_ratio, "paced_ratio": r.paced_ratio}
                        for r in rounds]}, indent=1
        ))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
