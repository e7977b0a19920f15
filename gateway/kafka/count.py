"""How many records a partition holds between two offsets: read, not subtracted.

An offset is not a record: a transaction's commit or abort marker takes an offset
of its own (with `[kafka] exactly_once` every write ends in one, so a drained
delay tier's end offset is one past its group's commit), and a `read_committed`
reader never sees an aborted transaction's records. So the records are counted
by reading them (gateway/delay/leftovers.py: `[delay]` off while a tier holds
records).
"""

from __future__ import annotations

import contextlib
import time

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import KafkaError

COUNT_RECORDS = 100_000  # records read at most, all partitions together
COUNT_WITHIN_S = 10.0  # and for at most this long


async def count_records(
    consumer: AIOKafkaConsumer, spans: dict[TopicPartition, tuple[int, int]]
) -> dict[TopicPartition, int]:
    """How many records `consumer` (`read_committed`, not subscribed; left with no
    assignment) reads in each partition's [start, end) span: the module docstring.

    What is not read within `COUNT_RECORDS` records or `COUNT_WITHIN_S` (or that
    cannot be read: no right to, a header name that is not UTF-8) counts by its
    offsets, markers included: the count is never 0 while a record is there."""
    counted = dict.fromkeys(spans, 0)
    consumer.assign(list(spans))
    try:
        for tp, (start, _) in spans.items():
            consumer.seek(tp, start)
        deadline = time.monotonic() + COUNT_WITHIN_S
        with contextlib.suppress(KafkaError, UnicodeDecodeError):
            while sum(counted.values()) < COUNT_RECORDS and time.monotonic() < deadline:
                left = [tp for tp, (_, end) in spans.items() if await consumer.position(tp) < end]
                if not left:
                    break
                batch = await consumer.getmany(*left, timeout_ms=200)
                for tp, records in batch.items():
                    counted[tp] += sum(1 for rec in records if rec.offset < spans[tp][1])
        return {
            tp: counted[tp] + max(0, end - await consumer.position(tp))
            for tp, (_, end) in spans.items()
        }
    finally:
        consumer.assign([])
