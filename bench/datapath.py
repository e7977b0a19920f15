"""`python -m bench.datapath`: the gateway's own CPU per record, without broker or Redis.

Times `Pipeline.decide` and `Pipeline.finish` (ids, tokens, `classify`, the
clean copies, the sink's partitioning and batch building) over records shaped
like the benchmark's (200-byte values, an id header, keys from a pool of
5,000), dedup off, with a producer that builds each batch and acknowledges it
at once. Process CPU time per record, median and spread over rounds.
`--duplicates SHARE` switches dedup on, with three members that answer every
claim at once (that share of each batch held by another owner on all three):
the vote's own cost (digests, the replies, counting) is then included, the
claim calls' encoding and Redis are not.

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
from gateway.kafka.sink import Sink
from gateway.metrics import Metrics
from gateway.raw.pipeline import Pipeline
from gateway.rules.vote import MINE, Reply

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


class AnsweringMembers:
    """A stand-in for the quorum: three members, all counted, answering each claim at
    once, the same on every member: every `every`-th record of a batch is held by
    another owner (0: none), the others are new."""

    majority = 2

    def __init__(self, every: int) -> None:
        self.every = every

    async def claim(self, digests: list[bytes], owners: list[str]) -> list[list[Reply]]:
        every = self.every
        row: list[Reply] = ["1" if every and k % every == 0 else MINE for k in range(len(digests))]
        return [row, row, row]

    def counted(self) -> list[bool]:
        return [True, True, True]

    async def settle(self, repairs: object, fills: object) -> bool:
        """Every member answered alike: nothing to repair or fill (Quorum.settle)."""
        return True


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


async def one_round(records: int, batch_records: int, duplicates: float | None) -> float:
    """µs of process CPU per record for one pass over fresh records."""
    settings = Settings.model_validate({"dedup": {"enabled": duplicates is not None}})
    metrics = Metrics()
    metrics.preinit(settings)
    producer: Any = BuildingProducer()
    every = round(1 / duplicates) if duplicates else 0
    members: Any = AnsweringMembers(every) if duplicates is not None else None
    sink = Sink(producer, settings.kafka, metrics)
    pipeline = Pipeline(settings, quorum=members, sink=sink, metrics=metrics)
    work = batches(records, batch_records)
    handled = sum(len(r) for batch in work for r in batch.values())
    started = time.process_time()
    for batch in work:
        await pipeline.finish(await pipeline.decide(batch))
    cost = (time.process_time() - started) / handled * 1e6
    held = sum(-(-sum(map(len, batch.values())) // every) for batch in work) if every else 0
    counts = (metrics.forwarded_total(), metrics.duplicates_total())
    if counts != (handled - held, held):
        raise RuntimeError(f"forwarded, duplicates: {counts}, not {(handled - held, held)}")
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
    parser.add_argument(
        "--duplicates", type=float, default=None, metavar="SHARE",
        help="dedup on, members answering at once, this share held by another owner",
    )  # fmt: skip
    opts = parser.parse_args(argv)
    if opts.duplicates is not None and not 0 <= opts.duplicates <= 1:
        parser.error("--duplicates: a share between 0 and 1")
    configure_gc()  # as `dedup-gateway run` does
    costs = [
        asyncio.run(one_round(opts.records, opts.batch, opts.duplicates))
        for _ in range(opts.rounds)
    ]
    mode = (
        "dedup off" if opts.duplicates is None
        else f"dedup on, {opts.duplicates:.0%} held by another owner, Redis not included"
    )  # fmt: skip
    print(
        f"gateway data path, {mode}: {statistics.median(costs):.3f} µs of CPU per record "
        f"(median of {opts.rounds} rounds of {opts.records:,}; "
        f"min {min(costs):.3f}, max {max(costs):.3f})"
    )


if __name__ == "__main__":
    main()
