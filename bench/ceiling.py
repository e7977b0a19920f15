"""`client-ceiling`: the bare aiokafka loop the gateway is measured against.

It consumes the raw topic in a consumer group and produces every record
untouched (key, value, timestamp, headers) to the same partition number of
the clean topic: `getmany`, then per partition `create_batch`/`append`/
`send_batch`, wait for the acknowledgements, commit. No id, no vote, no new
header, no pipelining: the most any aiokafka-based gateway can do with the same
broker and machine (ENVIRONMENT.md, "The client ceiling"). It is built from
the gateway's own client options (`gateway.kafka`) and counts into the same
`Metrics`, so the benchmark measures it exactly like a gateway.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from aiokafka import TopicPartition

from gateway.config import Settings
from gateway.kafka import build_consumer, build_producer
from gateway.metrics import Metrics

FETCH_TIMEOUT_MS = 100


class ClientCeiling:
    def __init__(self, settings: Settings, metrics: Metrics | None = None) -> None:
        self.settings = settings
        self.metrics = metrics or Metrics()
        self._assigned: set[TopicPartition] = set()

    def partitions(self) -> set[TopicPartition]:
        return set(self._assigned)

    async def run(self, stop: asyncio.Event) -> None:
        kafka = self.settings.kafka
        producer = build_producer(kafka)
        consumer = build_consumer(
            kafka,
            kafka.group_id,
            max_partition_fetch_bytes=4 * 1024 * 1024,
            fetch_max_wait_ms=int(kafka.fetch_max_wait.total_seconds() * 1000),
        )
        async with contextlib.AsyncExitStack() as stack:
            await producer.start()
            stack.push_async_callback(producer.stop)
            await consumer.start()
            stack.push_async_callback(consumer.stop)
            consumer.subscribe(kafka.raw_topics)
            records_in = self.metrics.records_in.labels(kafka.raw_topics[0])
            clean = kafka.clean_topic
            while not stop.is_set():
                batch = await consumer.getmany(
                    timeout_ms=FETCH_TIMEOUT_MS, max_records=kafka.max_batch_records
                )
                self._assigned = consumer.assignment()
                if not batch:
                    continue
                records_in.inc(sum(len(r) for r in batch.values()))
                futures: list[asyncio.Future[Any]] = []
                for tp, records in batch.items():
                    out = producer.create_batch()
                    for r in records:  # (the batch builder takes headers as a list only)
                        appended = out.append(
                            key=r.key, value=r.value, timestamp=r.timestamp, headers=list(r.headers)
                        )
                        if appended is None:  # full: ship it, start another
                            futures.append(
                                await producer.send_batch(out, clean, partition=tp.partition)
                            )
                            out = producer.create_batch()
                            out.append(
                                key=r.key,
                                value=r.value,
                                timestamp=r.timestamp,
                                headers=list(r.headers),
                            )
                    futures.append(await producer.send_batch(out, clean, partition=tp.partition))
                await asyncio.gather(*futures)
                now_ms = time.time() * 1000
                for records in batch.values():
                    self.metrics.observe_forward_latency(now_ms, [r.timestamp for r in records])
                await consumer.commit({tp: recs[-1].offset + 1 for tp, recs in batch.items()})
                self.metrics.forwarded.inc(sum(len(r) for r in batch.values()))
