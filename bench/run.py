"""`python -m bench`: every variant, A/B interleaved over several rounds, on the local stack.

1. Start a broker and five redis-server processes (`devtools.localstack`),
   and a 3-master Redis Cluster when a chosen variant has a cluster member.
   Before each product run its members are filled to steady state
   (`--fill` marks per bucket in two older slices, bench/steady.py).
2. Fill one raw topic per duplicate share (and a smaller one for `naive`,
   which is ~20x slower) before any variant runs.
3. Rounds: in each, every variant reads every share's topic once; the order
   of variants rotates from round to round, so no variant always runs first
   or last. Ratios compare runs of the same round.
4. Latency, at the same offered loads for every variant (20% duplicates):
   `--latency-rates` (default 5,000 records/s) and half of the forwarder's
   median maximum (gateway-3, gateway-3-eos and gateway-5 also at half their own);
   at each load also `broker-floor`, the same load read by a
   bare consumer: the part of the latency that is the broker's, the load
   generator's and the client's. The gateway's addition is its percentile
   minus the floor's at the same load.
5. Write JSON, a PNG chart and the table in `bench/RESULTS.md`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import uvloop
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)

from bench import delay as delay_bench
from bench import report
from bench.measure import (
    FLOOR,
    LatencyRun,
    PreparedTopic,
    ThroughputRun,
    clean_topic,
    delete_topics,
    floor_latency,
    latency,
    throughput,
)
from bench.steady import SIZING_FILL
from bench.variants import CLUSTER_MASTERS, FORWARDER, VARIANTS, Variant
from devtools.localstack import LocalStack, default_state_dir
from devtools.topics import create_topics
from devtools.traffic import produce_traffic
from gateway.cli import configure_gc
from gateway.config import load_settings
from gateway.logs import configure

if TYPE_CHECKING:
    from bench.spark import SparkBench

console = Console()
LATENCY_SHARE = 0.2


@dataclass
class Options:
    records: int
    naive_records: int
    shares: list[float]
    rounds: int
    latency_seconds: float
    latency_rates: list[float]
    warmup_seconds: float
    delay_records: int
    value_size: int
    partitions: int
    out: Path
    results_md: Path | None
    default_gc: bool
    variants: list[str]
    fill: int


async def prepare(stack: LocalStack, opts: Options) -> dict[tuple[str, float], PreparedTopic]:
    """One pre-filled raw topic per (size class, share): `full` and `naive`."""
    topics: dict[tuple[str, float], PreparedTopic] = {}
    for share in opts.shares:
        for kind, count in (("full", opts.records), ("naive", opts.naive_records)):
            name = f"raw-{kind}-{int(share * 100)}"
            await create_topics(stack.bootstrap, {name: opts.partitions})
            with console.status(f"filling {name} with {count:,} records"):
                traffic = await produce_traffic(
                    stack.bootstrap, name, count, duplicate_share=share,
                    value_size=opts.value_size, seed=int(share * 100) + 1,
                )  # fmt: skip
            topics[kind, share] = PreparedTopic(name, share, traffic)
    await create_topics(stack.bootstrap, {"bench-failures": 1, "bench-dead-letter": 1})
    return topics


async def bench(opts: Options) -> report.Results:
    state = default_state_dir() / "bench"
    shutil.rmtree(state, ignore_errors=True)
    load_at_start = os.getloadavg()
    most_redis = max(v.redis for v in VARIANTS)
    masters = CLUSTER_MASTERS if any(v.cluster for v in _chosen(opts)) else 0
    with LocalStack(state, redis_count=most_redis, cluster_masters=masters) as stack:
        cluster = f", a {masters}-master Redis Cluster" if masters else ""
        console.print(f"local stack: broker {stack.bootstrap}, {most_redis} redis-server{cluster}")
        topics = await prepare(stack, opts)
        runs: list[ThroughputRun] = []
        gateways = tuple(v for v in _chosen(opts) if v.kind != "spark")
        sparks = tuple(v for v in _chosen(opts) if v.kind == "spark")
        spark_share = report.TARGET_SHARE if report.TARGET_SHARE in opts.shares else opts.shares[0]
        plan = [
            (round_no, share, variant)
            for round_no in range(1, opts.rounds + 1)
            for share in opts.shares
            for variant in _rotated(gateways, round_no)
            + (_rotated(sparks, round_no) if share == spark_share else [])
        ]
        spark_bench = _spark_bench(stack) if sparks else None
        read = {v.reads for v in sparks}  # the gateway variants whose clean topics they read
        spark_rows: dict[str, int] = {}  # what each such clean topic of this round holds now
        with _progress() as progress:
            overall = progress.add_task("all runs", total=len(plan))
            for round_no, share, variant in plan:
                raw = topics["naive" if variant.naive else "full", share]
                label = f"round {round_no}: {variant.name}, {share:.0%} dups"
                current = progress.add_task(label, total=raw.traffic.produced)

                def show(done: int, task: TaskID = current) -> None:
                    progress.update(task, completed=done)

                if variant.kind == "spark":
                    assert spark_bench is not None
                    rows = spark_rows[variant.reads]
                    run = await _spark_run(spark_bench, stack, variant, share, round_no, rows)
                    spark_rows[variant.reads] += 1  # the record of its one-record batch
                    readers = [v for v in _rotated(sparks, round_no) if v.reads == variant.reads]
                    if variant == readers[-1]:  # the round's last reader of that topic
                        await delete_topics(
                            stack.bootstrap, [clean_topic(variant.reads, share, round_no)]
                        )
                else:
                    keep = variant.name in read and share == spark_share
                    run = await throughput(
                        stack, variant, raw, round_no, show, keep_clean=keep, fill=opts.fill
                    )
                    if keep:
                        spark_rows[variant.name] = run.forwarded
                progress.remove_task(current)
                progress.advance(overall)
                runs.append(run)
                if not run.correct:
                    console.print(f"[red]{label}: counts differ from the generated traffic[/]")

        latencies: list[LatencyRun] = []
        if opts.latency_seconds > 0:
            share = LATENCY_SHARE if LATENCY_SHARE in opts.shares else opts.shares[0]
            for load, rate, only in _loads(opts, runs, share):
                for variant in _chosen(opts):
                    if not variant.fixed_load or (only and variant.name != only):
                        continue
                    with console.status(f"latency: {variant.name} at {rate:,.0f} records/s"):
                        latencies.append(
                            await latency(
                                stack, variant, load, rate, opts.latency_seconds,
                                opts.warmup_seconds, share, opts.value_size,
                            )
                        )  # fmt: skip
                with console.status(f"latency: {FLOOR} at {rate:,.0f} records/s"):
                    latencies.append(
                        await floor_latency(
                            stack, load, rate, opts.latency_seconds, opts.warmup_seconds,
                            share, opts.value_size,
                        )
                    )  # fmt: skip
        delay = await delay_bench.measure(stack, opts.delay_records) if opts.delay_records else None
        if spark_bench is not None:
            spark_bench.close()
    return report.Results(
        runs=runs, latencies=latencies, options=_options_dict(opts), delay=delay,
        machine=report.machine(load_at_start),
    )  # fmt: skip


def _loads(opts: Options, runs: list[ThroughputRun], share: float) -> list[tuple[str, float, str]]:
    """The offered loads latency is measured at: (name, records/s, the one variant
    measured there, or '' for every variant that can carry it). Each load also gets
    broker-floor: `--latency-rates`, half the forwarder's median maximum, and half
    of gateway-3's, gateway-3-eos's and gateway-5's own (report.HALF_OWN): a variant at
    the same share of what it can carry, whatever the others can."""
    loads = [(f"{rate:,.0f}/s", rate, "") for rate in opts.latency_rates]
    forwarder = [r.rate for r in runs if r.variant == FORWARDER.name and r.share == share]
    if forwarder:
        loads.append((report.HALF_FORWARDER, statistics.median(forwarder) / 2, ""))
    for name in report.HALF_OWN:
        own = [r.rate for r in runs if r.variant == name and r.share == share]
        if own:
            loads.append((report.half_own(name), statistics.median(own) / 2, name))
    return loads


def _spark_bench(stack: LocalStack) -> SparkBench:
    from bench.spark import SparkBench

    return SparkBench(stack.bootstrap, stack.state_dir)


async def _spark_run(
    bench: SparkBench, stack: LocalStack, variant: Variant, share: float, round_no: int,
    rows: int,
) -> ThroughputRun:  # fmt: skip
    """A spark variant on the clean topic its gateway variant wrote in this round (`rows`
    in it)."""
    from bench.spark import measure

    assert stack.broker is not None and stack.broker.proc is not None
    topic = clean_topic(variant.reads, share, round_no)
    return await asyncio.to_thread(
        measure, bench, variant.name, topic, share, round_no, rows, stack.broker.proc.pid
    )


def _chosen(opts: Options) -> tuple[Variant, ...]:
    return tuple(v for v in VARIANTS if v.name in opts.variants)


def _rotated(variants: tuple[Variant, ...], round_no: int) -> list[Variant]:
    if not variants:
        return []
    shift = (round_no - 1) % len(variants)
    return list(variants[shift:] + variants[:shift])


def _progress() -> Progress:
    return Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
        TimeElapsedColumn(), console=console,
    )  # fmt: skip


def _options_dict(opts: Options) -> dict[str, object]:
    return {k: str(v) if isinstance(v, Path) else v for k, v in opts.__dict__.items()}


def parse_args(argv: list[str] | None = None) -> Options:
    parser = argparse.ArgumentParser(
        prog="python -m bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--records", type=int, default=200_000, help="records per raw topic")
    parser.add_argument("--naive-records", type=int, default=10_000,
                        help="records for the naive variant (it is ~20x slower)")  # fmt: skip
    parser.add_argument("--shares", type=float, nargs="+", default=[0.0, 0.2, 0.5],
                        help="duplicate shares")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--latency-seconds", type=float, default=10.0,
                        help="offered-load duration per variant; 0 skips latency")  # fmt: skip
    parser.add_argument("--latency-rates", type=float, nargs="*", default=[5000.0],
                        help="fixed offered loads (records/s), besides half the forwarder's "
                             "maximum")  # fmt: skip
    parser.add_argument("--warmup-seconds", type=float, default=1.0)
    parser.add_argument("--delay-records", type=int, default=20_000,
                        help="scheduled-delivery row (bench/delay.py); 0 skips it")  # fmt: skip
    parser.add_argument("--value-size", type=int, default=200, help="bytes per record value")
    parser.add_argument("--partitions", type=int, default=4, help="raw topic partitions")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--results-md", type=Path, default=Path("bench/RESULTS.md"),
                        help="where the table goes (between its markers)")  # fmt: skip
    parser.add_argument("--default-gc", action="store_true",
                        help="keep CPython's default garbage collection thresholds in this "
                             "process (the gateway tunes them: gateway/cli.py)")  # fmt: skip
    names = [v.name for v in VARIANTS]
    defaults = [v.name for v in VARIANTS if not v.opt_in]
    parser.add_argument("--variants", nargs="+", choices=names, default=defaults,
                        help="run only these (the targets need all of them)")  # fmt: skip
    parser.add_argument("--fill", type=int, default=SIZING_FILL,
                        help="marks per bucket the members are filled to before each run "
                             "(steady state: two full older slices, `[redis] buckets` = the "
                             "run's distinct ids / FILL; bench/steady.py); 0: fresh members, "
                             "default buckets")  # fmt: skip
    args = parser.parse_args(argv)
    if args.fill < 0:
        parser.error("--fill: marks per bucket, 0 or more")
    if any(not 0 <= s < 1 for s in args.shares):
        parser.error("--shares: each share must be in [0, 1)")
    for v in VARIANTS:
        if v.kind == "spark" and v.name in args.variants and v.reads not in args.variants:
            parser.error(f"--variants: {v.name} reads the clean topic {v.reads} writes: name it")
    return Options(**vars(args))


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    configure(load_settings(log={"level": "ERROR"}).log)
    if not opts.default_gc:
        configure_gc()  # as `dedup-gateway run` does: this process hosts the in-process variants
    results = uvloop.run(bench(opts))
    paths = report.write(results, opts.out, opts.results_md)
    console.print(report.console_table(results))
    for path in paths:
        console.print(f"wrote {path}")
    if not results.all_correct:
        console.print("[red]some runs forwarded or dropped other counts than generated[/]")
        return 1
    return 0
