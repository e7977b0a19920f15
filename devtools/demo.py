"""`make demo` (`python -m devtools.demo`): the whole pipeline on an embedded local stack.

Starts an Apache Kafka broker and three redis-server processes under `.state/`,
produces generated traffic with duplicates (across partitions) and a few bad
records, runs a plain forwarder (the gateway with dedup off) and then the
gateway on the same raw topic, checks that each id came out exactly once,
optionally runs the Spark job over the clean topic, prints a summary and
shuts everything down.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import uvloop
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from devtools.harness import run_gateway_until
from devtools.jars import KAFKA_VERSION
from devtools.localstack import LocalStack, default_state_dir
from devtools.topics import create_topics, read_topic, wait_committed
from devtools.traffic import Traffic, produce_traffic
from gateway.config import Settings, load_settings
from gateway.logs import configure
from gateway.service.app import Gateway

console = Console()


def demo_settings(stack: LocalStack, *, clean: str, group: str, enabled: bool = True) -> Settings:
    return load_settings(
        kafka={
            "bootstrap_servers": stack.bootstrap, "raw_topics": ["raw"], "clean_topic": clean,
            "group_id": group, "quarantine_topic": f"{clean}-quarantine",
            "failure_topic": "failures",
            "dead_letter_topic": "dead-letter", "exactly_once": "on",
        },
        redis={"nodes": stack.redis_urls},
        dedup={"enabled": enabled},
        metrics={"host": "127.0.0.1", "port": 0},
        log={"level": "ERROR"},
    )  # fmt: skip


async def run_gateway(settings: Settings, traffic: Traffic, label: str) -> tuple[float, Gateway]:
    """Run one gateway until it has handled every raw record; return records/s."""
    gateway = Gateway(settings)
    with Progress(
        TextColumn(f"[bold]{label}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=console, transient=True,
    ) as progress:  # fmt: skip
        bar = progress.add_task(label, total=traffic.produced)
        started: float | None = None

        def done() -> bool:
            nonlocal started
            handled = gateway.metrics.handled()
            if started is None and handled:
                started = time.perf_counter()
            progress.update(bar, completed=handled)
            return handled >= traffic.produced

        await run_gateway_until(gateway, done, poll_s=0.05)
        elapsed = time.perf_counter() - (started or time.perf_counter())
    await wait_committed(settings.kafka.bootstrap_servers, settings.kafka.group_id, "raw",
                         traffic.per_partition)  # fmt: skip
    return traffic.produced / max(elapsed, 1e-9), gateway


async def demo(args: argparse.Namespace) -> int:
    state = default_state_dir() / "demo"
    shutil.rmtree(state, ignore_errors=True)
    with LocalStack(state, redis_count=3) as stack:
        console.print(
            f"local stack: broker {stack.bootstrap}, redis {', '.join(stack.redis_urls)} "
            f"(state in {state})"
        )
        await create_topics(
            stack.bootstrap,
            {"raw": args.partitions, "clean": 4, "baseline": 4, "clean-quarantine": 1,
             "baseline-quarantine": 1,
             "failures": 2, "dead-letter": 1},
        )  # fmt: skip
        with console.status(f"producing {args.records:,} raw records"):
            traffic = await produce_traffic(
                stack.bootstrap, "raw", args.records,
                duplicate_share=args.duplicates, bad_share=0.005,
            )  # fmt: skip
        console.print(
            f"produced {traffic.produced:,} records: {len(traffic.unique_ids):,} unique ids, "
            f"{traffic.duplicates:,} duplicates, {traffic.bad:,} without an id"
        )
        baseline_rate, _ = await run_gateway(
            demo_settings(stack, clean="baseline", group="baseline", enabled=False),
            traffic, "plain forwarder",
        )  # fmt: skip
        rate, gateway = await run_gateway(
            demo_settings(stack, clean="clean", group="gateway"), traffic, "dedup gateway"
        )
        clean = await read_topic(stack.bootstrap, "clean")
        quarantine = await read_topic(stack.bootstrap, "clean-quarantine")
        counts = Counter(dict(r.headers)["dedup-id"].decode() for r in clean)
        exact = set(counts) == traffic.unique_ids and max(counts.values(), default=1) == 1
        spark: dict[str, Any] | None = None
        if not args.no_spark:
            spark = await asyncio.to_thread(_run_spark, stack, state)

    m = gateway.metrics
    table = Table(title="dedup gateway: demo summary", show_header=False)
    table.add_row("raw records in", f"{traffic.produced:,}")
    table.add_row("forwarded to clean", f"{m.forwarded_total():,}")
    table.add_row("dropped as duplicates", f"{m.duplicates_total():,}")
    table.add_row("quarantined (no id)", f"{len(quarantine):,}")
    table.add_row("gateway throughput (N=3)", f"{rate:,.0f} records/s")
    table.add_row("plain forwarder, same run", f"{baseline_rate:,.0f} records/s")
    table.add_row("ratio gateway / forwarder", f"{rate / baseline_rate:.2f}")
    table.add_row("each id exactly once", "[green]yes[/]" if exact else "[red]NO[/]")
    table.add_row("broker", f"Apache Kafka {KAFKA_VERSION} (KRaft), exactly-once output on")
    spark_ok = True
    if spark is not None:
        for key, value in spark.items():
            table.add_row(f"spark: {key}", value if isinstance(value, str) else f"{value:,}")
        table.add_row("ratio spark job / gateway", f"{spark['rows/s'] / rate:.2f}")
        spark_ok = spark["rows in the output"] == len(traffic.unique_ids)
        table.add_row("spark output: each id once", "[green]yes[/]" if spark_ok else "[red]NO[/]")
    console.print(table)
    return 0 if exact and spark_ok and len(quarantine) == traffic.bad else 1


def _run_spark(stack: LocalStack, state: Path) -> dict[str, Any]:
    """Process the clean topic once with the Spark job; what came out of it, which
    Kafka source it read with, and its rows/s (the session's start left out)."""
    from spark_sink.config import load_sink_settings
    from spark_sink.connector import choose_source
    from spark_sink.job import run_until_idle
    from spark_sink.session import build_session

    settings = load_sink_settings(
        kafka={"bootstrap_servers": stack.bootstrap, "clean_topic": "clean",
               "failure_topic": "failures"},
        spark={"checkpoint_dir": str(state / "spark" / "checkpoint"),
               "output_path": str(state / "spark" / "output"), "master": "local[2]",
               "conf": {"spark.sql.shuffle.partitions": "2", "spark.ui.enabled": "false",
                        "spark.ui.showConsoleProgress": "false"}},
    )  # fmt: skip
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")  # everything here is on loopback
    with console.status("Spark job: processing the clean topic (local[2])"):
        session = build_session(settings)
        try:
            source = choose_source(session, settings)
            started = time.perf_counter()
            report = run_until_idle(settings, spark=session)
            elapsed = time.perf_counter() - started
        finally:
            session.stop()
    return {
        "source": "Spark's Kafka connector" if source == "kafka" else "the Python source",
        "records read": report.input_rows,
        "processed": report.processed,
        "failed (release commands)": report.releases_published,
        "rows in the output": report.output_rows,
        "rows/s": round(report.input_rows / max(elapsed, 1e-9)),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m devtools.demo", description="the whole pipeline on an embedded local stack"
    )
    parser.add_argument("--records", type=int, default=200_000, help="raw records to generate")
    parser.add_argument("--duplicates", type=float, default=0.3, help="share of duplicates")
    parser.add_argument("--partitions", type=int, default=4, help="raw topic partitions")
    parser.add_argument("--no-spark", action="store_true", help="skip the Spark stage")
    args = parser.parse_args(argv)
    # Per-record warnings (quarantined records) would drown the progress display.
    configure(load_settings(log={"level": "ERROR"}).log)
    return uvloop.run(demo(args))


if __name__ == "__main__":
    sys.exit(main())
