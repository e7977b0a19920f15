"""Generated raw traffic with a known share of duplicates, for the demo, the
benchmark and the tests.

Each record carries its id in the `message-id` header and a JSON order as
value. A duplicate repeats an earlier id, on a random partition (so copies of
one id land on different partitions, as producer retries and re-sends do).
Records are produced with `send_batch`, one batch per partition at a time.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from aiokafka import AIOKafkaProducer

from devtools.topics import partitions_of_producer


@dataclass
class Traffic:
    """What was produced: counts, and every id that must come out exactly once."""

    produced: int = 0
    unique_ids: set[str] = field(default_factory=set)
    duplicates: int = 0
    bad: int = 0
    per_partition: dict[int, int] = field(default_factory=dict)


def order_value(message_id: str, rng: random.Random, size: int = 0) -> bytes:
    """A JSON order; padded to `size` bytes when given (the benchmark's 200 B)."""
    order = {
        "order_id": message_id,
        "customer": f"c-{rng.randrange(500)}",
        "amount": round(rng.uniform(1, 500), 2),
    }
    body = json.dumps(order).encode()
    if size > len(body):
        order["pad"] = "x" * (size - len(body) - 10)
        body = json.dumps(order).encode()
    return body


async def produce_traffic(
    bootstrap: str,
    topic: str,
    records: int,
    *,
    duplicate_share: float = 0.3,
    bad_share: float = 0.0,
    value_size: int = 0,
    seed: int = 7,
    id_prefix: str = "m",
    on_progress: Callable[[int], None] | None = None,
) -> Traffic:
    """Produce `records` raw records to `topic`; return what a correct gateway must output."""
    rng = random.Random(seed)
    traffic = Traffic()
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, linger_ms=5, max_batch_size=1_000_000)
    await producer.start()
    try:
        parts = await partitions_of_producer(producer, topic)
        traffic.per_partition = dict.fromkeys(parts, 0)
        issued: list[str] = []
        batches = {p: producer.create_batch() for p in parts}
        futures = []
        for n in range(records):
            partition = rng.choice(parts)
            roll = rng.random()
            if roll < bad_share:
                headers: list[tuple[str, bytes]] = []  # no message-id: must be quarantined
                value = b"not an order"
                traffic.bad += 1
            else:
                if issued and roll < bad_share + duplicate_share:
                    message_id = rng.choice(issued)
                    traffic.duplicates += 1
                else:
                    message_id = f"{id_prefix}-{n}"
                    issued.append(message_id)
                    traffic.unique_ids.add(message_id)
                headers = [("message-id", message_id.encode())]
                value = order_value(message_id, rng, value_size)
            key = f"k-{rng.randrange(1000)}".encode()
            batch = batches[partition]
            if batch.append(key=key, value=value, timestamp=None, headers=headers) is None:
                futures.append(await producer.send_batch(batch, topic, partition=partition))
                batch = batches[partition] = producer.create_batch()
                batch.append(key=key, value=value, timestamp=None, headers=headers)
            traffic.per_partition[partition] += 1
            traffic.produced += 1
            if on_progress is not None and n % 10_000 == 0:
                on_progress(n)
        for partition, batch in batches.items():
            if batch.record_count():
                futures.append(await producer.send_batch(batch, topic, partition=partition))
        for fut in futures:
            await fut
    finally:
        await producer.stop()
    return traffic
