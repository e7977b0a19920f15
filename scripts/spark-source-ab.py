"""The Spark job on Spark's Kafka connector against the Python source, on one topic.

    .venv/bin/python scripts/spark-source-ab.py --records 200000 --rounds 3

Starts an Apache Kafka broker (devtools.localstack), fills one clean topic with
`--records` valid orders carrying the gateway's headers (each id once, so the job
writes every row), then runs, in each round and in alternating order, the benchmark's
`spark-job` and `spark-floor` (bench/spark.py: the job with the example handler, and a
bare query into Spark's noop sink) once with each source, in one SparkSession that has
the connector on its classpath (`[spark] source` "auto" finds it, "python" forces the
Python source). A first round is a warm-up, not counted. Prints each run and the
medians: rows/s, CPU per row (Python driver / JVM / Python workers) and a one-record
batch's time. Writes nothing into the checkout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.spark import FLOOR, JOB, SparkBench
from devtools.localstack import kafka_broker
from devtools.topics import create_topics
from gateway.contract.records import H_ATTEMPT, H_ID, H_SOURCE, H_TOKEN
from gateway.contract.tokens import owner_token

SOURCES = {"kafka": "auto", "python": "python"}


def fill(bootstrap: str, topic: str, records: int, partitions: int) -> None:
    """`records` valid orders, as the gateway forwards them (one raw record each)."""
    from confluent_kafka import Producer

    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 50, "log_level": 3})
    for n in range(records):
        partition = n % partitions
        value = json.dumps({"order_id": f"o-{n}", "customer": f"c-{n % 100}", "amount": n % 997})
        headers = [
            (H_ID, f"o-{n}".encode()), (H_SOURCE, f"raw/{partition}/{n}".encode()),
            (H_TOKEN, owner_token("raw", partition, n, 1).encode()), (H_ATTEMPT, b"1"),
        ]  # fmt: skip
        while True:
            try:
                producer.produce(topic, value=value.encode(), headers=headers, partition=partition)
                break
            except BufferError:
                producer.poll(0.1)
    if producer.flush(120):
        raise RuntimeError("the topic was not filled")


def run_once(bench: SparkBench, variant: str, source: str, topic: str) -> dict[str, Any]:
    os.environ["GATEWAY_SPARK__SOURCE"] = SOURCES[source]
    run = bench.run(variant, topic)
    per_row = 1e6 / max(run.rows, 1)
    return {
        "variant": variant, "source": source, "rows": run.rows, "written": run.written,
        "rows_per_s": run.rows / run.seconds, "batches": run.batches,
        "cpu_us_per_row": run.cpu_s * per_row, "driver_us": run.driver_cpu_s * per_row,
        "jvm_us": run.jvm_cpu_s * per_row, "workers_us": run.workers_cpu_s * per_row,
        "one_record_batch_s": run.batch_fixed_s,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--records", type=int, default=200_000)
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3, help="measured rounds")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="spark-source-ab-") as tmp:
        broker = kafka_broker(Path(tmp))
        broker.start()
        try:
            bootstrap, topic = f"127.0.0.1:{broker.port}", "clean-ab"
            asyncio.run(create_topics(bootstrap, {topic: args.partitions, "bench-failures": 1}))
            fill(bootstrap, topic, args.records, args.partitions)
            bench = SparkBench(bootstrap, Path(tmp))
            runs: list[dict[str, Any]] = []
            try:
                for round_no in range(args.rounds + 1):  # round 0: a warm-up
                    order = list(SOURCES) if round_no % 2 == 0 else list(SOURCES)[::-1]
                    for source in order:
                        for variant in (JOB, FLOOR):
                            run = run_once(bench, variant, source, topic) | {"round": round_no}
                            print(json.dumps(run), flush=True)
                            if round_no > 0:
                                runs.append(run)
            finally:
                bench.close()
        finally:
            broker.stop()
    print("\nmedians of", args.rounds, "rounds:")
    for variant in (JOB, FLOOR):
        for source in SOURCES:
            mine = [r for r in runs if r["variant"] == variant and r["source"] == source]
            med = {k: statistics.median(r[k] for r in mine)
                   for k in ("rows_per_s", "cpu_us_per_row", "driver_us", "jvm_us",
                             "workers_us", "one_record_batch_s")}  # fmt: skip
            print(f"{variant:12} {source:7} {med['rows_per_s']:9,.0f} rows/s  "
                  f"{med['cpu_us_per_row']:5.1f} us/row ({med['driver_us']:.1f} / "
                  f"{med['jvm_us']:.1f} / {med['workers_us']:.1f})  "
                  f"one-record batch {med['one_record_batch_s']:.2f} s")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
