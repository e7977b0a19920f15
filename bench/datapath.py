"""`python -m bench.datapath`: the gateway's own CPU per record, without broker or Redis.

Times `Pipeline.decide` and `Pipeline.finish` (ids, tokens, `classify`, the
clean copies, the sink's partitioning and batch building) over records shaped
like the benchmark's (200-byte values, an id header, keys from a pool of
5,000), dedup off, with a producer that builds each batch and acknowledges it
at once. Process CPU time per record, median and spread over rounds.

What it is for: before/after figures of a change to the gateway's own code.
It repeats to about 1% from run to run, where the full benchmark's figures
move by up to 25% between runs on this machine; `make bench` then says what a
change buys end to end.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

from aiokafka import ConsumerRecord, TopicPartition
from aiokafka.producer.message_accumulator import BatchBuilder

from gateway.cli import configure_gc
from gateway.config import Settings
from gateway.metrics import Metrics
from gateway.pipeline import Pipeline
from gateway.sink import Sink

PARTITIONS = 4
Batch = dict[TopicPartition, list[ConsumerRecord[bytes, bytes]]]


class BuildingProducer:
    """A stand-in for the sink's producer: builds each batch (as sending does) of up
    to `batch_bytes`, acknowledges it at once, and keeps (topic, records) of each."""

    def __init__(self, partitions: int = PARTITIONS, batch_bytes: int = 1_000_000) -> None:
        self.partitions = partitions
        self.batch_bytes = batch_bytes
        self.sent: list[tuple[str, int]] = []

    def create_batch(self) -> BatchBuilder:
        return BatchBuilder(self.batch_bytes, 0)

    async def partitions_for(self, topic: str) -> set[int]:
        return set(range(self.partitions))

    async def send_batch(
        self, batch: BatchBuilder, topic: str, *, partition: int
    ) -> asyncio.Future[Any]:
        batch._build()
        self.sent.append((topic, batch.record_count()))
        acknowledged: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        acknowledged.set_result(None)
        return acknowledged


def batches(records: int, batch_records: int) -> list[Batch]:
    """`records` raw records in batches of `batch_records`, spread over the partitions."""
    out: list[Batch] = []
    per_partition = batch_records // PARTITIONS
    for start in range(0, records // PARTITIONS, per_partition):  # offsets, per partition
        out.append({
            TopicPartition("raw", p): [
                ConsumerRecord("raw", p, offset, 1_700_000_000_000 + offset, 0,
                               b"customer-%d" % (offset % 5000), b"v" * 200, None, 14, 200,
                               (("message-id", b"order-%d-%d" % (p, offset)),))
                for offset in range(start, start + per_partition)
            ]
            for p in range(PARTITIONS)
        })  # fmt: skip
    return out


async def one_round(records: int, batch_records: int) -> float:
    """µs of process CPU per record for one pass over fresh records."""
    settings = Settings.model_validate({"dedup": {"enabled": False}})
    metrics = Metrics()
    metrics.preinit(settings)
    producer: Any = BuildingProducer()
    no_quorum: Any = None  # dedup off: the pipeline calls no Redis member
    sink = Sink(producer, settings.kafka, metrics)
    pipeline = Pipeline(settings, quorum=no_quorum, sink=sink, metrics=metrics)
    work = batches(records, batch_records)
    handled = sum(len(r) for batch in work for r in batch.values())
    started = time.process_time()
    for batch in work:
        await pipeline.finish(await pipeline.decide(batch))
    cost = (time.process_time() - started) / handled * 1e6
    if metrics.forwarded_total() != handled:  # dedup off: every record is forwarded
        raise RuntimeError(f"forwarded {metrics.forwarded_total()} of {handled} records")
    return cost


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.datapath",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--records", type=int, default=200_000)
    parser.add_argument("--batch", type=int, default=2000, help="records per batch")
    parser.add_argument("--rounds", type=int, default=5)
    opts = parser.parse_args(argv)
    configure_gc()  # as `dedup-gateway run` does
    costs = [asyncio.run(one_round(opts.records, opts.batch)) for _ in range(opts.rounds)]
    print(
        f"gateway data path, dedup off: {statistics.median(costs):.3f} µs of CPU per record "
        f"(median of {opts.rounds} rounds of {opts.records:,}; "
        f"min {min(costs):.3f}, max {max(costs):.3f})"
    )


if __name__ == "__main__":
    main()
