"""`client-ceiling`: the bare aiokafka loop the gateway is measured against.

It consumes the raw topic in a consumer group and produces every record
untouched (key, value, timestamp, headers) to the same partition number of
the clean topic: `getmany`, then per partition `create_batch`/`append`/
`send_batch`, wait for the acknowledgements, commit. No id, no vote, no new
header, no pipelining: the most any aiokafka-based gateway can do with the same
broker and machine. It is built from
the gateway's own client options (`gateway.kafka.clients`) and counts into the same
`Metrics`, so the benchmark measures it exactly like a gateway.

`client-ceiling-headers` (opt-in: `--variants client-ceiling-headers ...`) is
the same loop adding three headers the size of the gateway's `dedup-id`,
`dedup-source` and `dedup-token` to every record, built in one comprehension
per partition batch: what the clean-record contract costs the client and the
broker, apart from everything else the gateway does.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from aiokafka import ConsumerRecord, TopicPartition

from gateway.config import Settings
from gateway.kafka.clients import build_consumer, build_producer
from gateway.metrics import Metrics

FETCH_TIMEOUT_MS = 100


class ClientCeiling:
    def __init__(
        self, settings: Settings, metrics: Metrics | None = None, headers: bool = False
    ) -> None:
        self.settings = settings
        self.metrics = metrics or Metrics()
        self.headers = headers  # add three headers like the gateway's (client-ceiling-headers)
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
                    headers = self._headers(tp, records)
                    for r, h in zip(records, headers, strict=True):
                        appended = out.append(key=r.key, value=r.value, timestamp=r.timestamp,
                                              headers=h)  # fmt: skip
                        if appended is None:  # full: ship it, start another
                            futures.append(
                                await producer.send_batch(out, clean, partition=tp.partition)
                            )
                            out = producer.create_batch()
                            out.append(key=r.key, value=r.value, timestamp=r.timestamp,
                                       headers=h)  # fmt: skip
                    futures.append(await producer.send_batch(out, clean, partition=tp.partition))
                await asyncio.gather(*futures)
                now_ms = time.time() * 1000
                for records in batch.values():
                    self.metrics.observe_forward_latency(now_ms, [r.timestamp for r in records])
                await consumer.commit({tp: recs[-1].offset + 1 for tp, recs in batch.items()})
                self.metrics.forwarded.inc(sum(len(r) for r in batch.values()))

    def _headers(
        self, tp: TopicPartition, records: list[ConsumerRecord[bytes, bytes]]
    ) -> list[list[tuple[str, bytes]]]:
        """Each record's headers as the list the batch builder takes; with `headers`,
        plus an id (the first header's value), a source reference and a 19-digit token."""
        if not self.headers:
            return [list(r.headers) for r in records]
        prefix = f"{tp.topic}/{tp.partition}/".encode()
        return [
            [*r.headers, ("dedup-id", r.headers[0][1] if r.headers else b""),
             ("dedup-source", b"%b%d" % (prefix, r.offset)),
             ("dedup-token", b"%019d" % (r.offset * 7919))]
            for r in records
        ]  # fmt: skip
