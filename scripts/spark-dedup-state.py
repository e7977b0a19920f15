"""The delivery dedup's fixed cost per micro-batch against the keys in its state.

    .venv/bin/python scripts/spark-dedup-state.py --keys 0 100000 1000000 --batches 5

Starts an Apache Kafka broker (devtools.localstack) and, for each `--keys` count, fills
a clean topic with that many valid orders carrying the gateway's headers (one token
each). For each store (`--stores`: Spark's default HDFS-backed state store, RocksDB
with changelog checkpointing, or `redis`: `[spark] dedup_redis` on a redis-server the
script starts, emptied before each case) and each count, the job
(`spark_sink.job.start_query`, the delivery dedup on) reads the topic on a fresh
checkpoint with a handler that keeps no row (the state is filled, nothing is written),
then runs `--batches` one-record batches (one new record each, `bench.spark.produce_one`)
with the example handler and reports their `triggerExecution` (median, min, max) and the
state operator's metrics from the last one (keys, memory, commit time; for redis the
server's keys, checked to equal the count after the fill, and its used memory).
`--no-dedup` adds the same one-record batches with the delivery dedup off: the fixed cost
without a state store. One SparkSession (local[2]), a warm-up query first. Writes
nothing into the checkout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import redis
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from bench.spark import SESSION_CONF, produce_one
from devtools.localstack import ManagedProcess, kafka_broker, redis_server
from devtools.topics import create_topics
from spark_sink.config import SinkSettings, load_sink_settings
from spark_sink.job import make_sink, start_query
from spark_sink.session import build_session
from spark_sink.transforms import REASON

sys.path.insert(0, str(Path(__file__).resolve().parent))
fill = __import__("spark-source-ab").fill

PROVIDER = "spark.sql.streaming.stateStore.providerClass"
CHANGELOG = "spark.sql.streaming.stateStore.rocksdb.changelogCheckpointing.enabled"
STORES = {
    "hdfs": {
        PROVIDER: "org.apache.spark.sql.execution.streaming.state.HDFSBackedStateStoreProvider"
    },
    "rocksdb": {
        PROVIDER: "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider",
        CHANGELOG: "true",
    },
    "redis": {},  # no state store: `[spark] dedup_redis`
}


def keep_nothing(records: DataFrame) -> DataFrame:
    """A handler that leaves every record out: neither written nor released."""
    return records.withColumn(REASON, F.lit(None).cast("string")).where(F.lit(False))


def settings_for(
    bootstrap: str, topic: str, work: Path, store: str, dedup_redis: str = ""
) -> SinkSettings:  # fmt: skip
    return load_sink_settings(
        kafka={"bootstrap_servers": bootstrap, "clean_topic": topic, "failure_topic": "failures"},
        spark={"checkpoint_dir": str(work / "checkpoint"), "output_path": str(work / "output"),
               "master": "local[2]", "handler": "spark_sink.handlers:orders",
               "conf": {**SESSION_CONF, **STORES[store]},
               "dedup_redis": dedup_redis if store == "redis" else ""},
    )  # fmt: skip


def run(spark: SparkSession, settings: SinkSettings, dedup: bool, handler: Any = None) -> Any:
    sink = make_sink(settings, handler)
    try:
        query = start_query(spark, settings, sink, available_now=True, delivery_dedup=dedup)
        query.awaitTermination()
    finally:
        sink.close()
    if query.exception() is not None:
        raise RuntimeError(str(query.exception()))
    return [p for p in query.recentProgress if int(p["numInputRows"]) > 0]


def measure(
    spark: SparkSession, bootstrap: str, topic: str, work: Path, store: str, dedup: bool,
    batches: int, dedup_redis: str = "",
) -> dict[str, Any]:  # fmt: skip
    settings = settings_for(bootstrap, topic, work, store, dedup_redis)
    for key, value in STORES[store].items():
        spark.conf.set(key, value)  # a query's own SQL conf, taken when it starts
    in_redis = redis.Redis.from_url(dedup_redis) if store == "redis" and dedup else None
    if in_redis is not None:
        in_redis.flushall()
    filled = run(spark, settings, dedup, keep_nothing)
    filled_rows = sum(int(p["numInputRows"]) for p in filled)
    redis_keys = None if in_redis is None else in_redis.dbsize()
    if redis_keys is not None and redis_keys != filled_rows:
        raise RuntimeError(f"{redis_keys} keys in Redis after filling {filled_rows} rows")
    times, last = [], None
    for _ in range(batches):
        produce_one(bootstrap, topic)
        (last,) = run(spark, settings, dedup)
        times.append(float(last["durationMs"]["triggerExecution"]) / 1000)
    state = (last or {}).get("stateOperators") or [{}]
    if in_redis is not None:
        state = [{"numRowsTotal": in_redis.dbsize(),
                  "memoryUsedBytes": in_redis.info("memory")["used_memory"]}]  # fmt: skip
        in_redis.close()
    return {
        "store": store if dedup else "none (dedup off)", "filled_rows": filled_rows,
        "redis_keys_after_fill": redis_keys, "fill_s": sum(
            float(p["durationMs"]["triggerExecution"]) for p in filled) / 1000,
        "median_s": statistics.median(times), "min_s": min(times), "max_s": max(times),
        "state_keys": state[0].get("numRowsTotal"), "state_memory_mb": (
            state[0].get("memoryUsedBytes") or 0) / 2**20,
        "commit_ms": state[0].get("commitTimeMs"), "phases_ms": (last or {}).get("durationMs"),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--keys", type=int, nargs="+", default=[0, 100_000, 1_000_000])
    parser.add_argument("--stores", nargs="+", choices=list(STORES), default=list(STORES))
    parser.add_argument("--batches", type=int, default=5, help="one-record batches per case")
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--no-dedup", action="store_true", help="add the dedup-off case")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="spark-dedup-state-") as tmp:
        broker = kafka_broker(Path(tmp))
        broker.start()
        server: ManagedProcess | None = None
        try:
            dedup_redis = ""
            if "redis" in args.stores:
                server = redis_server(Path(tmp), "dedup-redis")
                server.start()
                dedup_redis = f"redis://127.0.0.1:{server.port}/0"
            bootstrap = f"127.0.0.1:{broker.port}"
            topics = {keys: f"clean-{keys}" for keys in [1000, *args.keys]}
            asyncio.run(create_topics(bootstrap, dict.fromkeys(topics.values(), args.partitions)))
            asyncio.run(create_topics(bootstrap, {"failures": 1}))
            for keys, topic in topics.items():
                fill(bootstrap, topic, keys, args.partitions)
            spark = build_session(settings_for(bootstrap, topics[1000], Path(tmp), "hdfs"))
            spark.sparkContext.setLogLevel("ERROR")
            cases = [(s, True) for s in args.stores] + ([("hdfs", False)] if args.no_dedup else [])
            for n, (store, dedup) in enumerate(cases):  # a warm-up per case, not reported
                measure(spark, bootstrap, topics[1000], Path(tmp, f"warm-{n}"), store, dedup, 2,
                        dedup_redis)  # fmt: skip
            for keys in args.keys:
                for n, (store, dedup) in enumerate(cases):
                    work = Path(tmp, f"{keys}-{n}")
                    result = measure(
                        spark, bootstrap, topics[keys], work, store, dedup, args.batches,
                        dedup_redis,
                    )  # fmt: skip
                    print(json.dumps({"keys": keys, **result}), flush=True)
            spark.stop()
        finally:
            if server is not None:
                server.stop()
            broker.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
