"""Read raw records aiokafka cannot parse: a header name that is not UTF-8.

aiokafka decodes every header name as UTF-8 while it unpacks a fetched batch
(`DefaultRecordBatch._read_msg`, in its C extension `_crecords` that is used
here and in its Python fallback alike), lazily, inside `consumer.getmany`. The
UnicodeDecodeError names no partition and no offset. The failing partition
keeps its position, so every later `getmany`, and every restart, meets the same
record again; partitions unpacked before it in the same call have advanced
past records that call never returned.

`read_leniently` reads a partition's record batches from the broker itself (a
Fetch request on a client of its own, read_committed like the consumers) and
parses them as aiokafka does, except that a header name that is not UTF-8 is
dropped and counted instead of failing. Message format v2 only (Kafka 0.11+):
older batches cannot carry headers, and a scan stops at one.

`Salvage` is the one way every consumer loop gets past such a record (the raw, delay
and failure loops through gateway/kafka/loop.py): rewind, read
leniently, hand what was read to the loop as one batch, read on after it.
"""

from __future__ import annotations

import contextlib
import logging
import struct
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from aiokafka import AIOKafkaConsumer, ConsumerRecord, TopicPartition
from aiokafka.client import AIOKafkaClient
from aiokafka.codec import gzip_decode, lz4_decode, snappy_decode, zstd_decode
from aiokafka.errors import KafkaError, for_code
from aiokafka.protocol.fetch import FetchRequest

from gateway.config import KafkaSettings
from gateway.contract.records import Record
from gateway.kafka.clients import aiokafka_options
from gateway.kafka.transactions import Member, group_member
from gateway.rules.backoff import backoff_delay

logger = logging.getLogger(__name__)

# The v2 record batch header: base offset, length, leader epoch, magic, crc,
# attributes, last offset delta, first and max timestamp, producer id and
# epoch, base sequence, record count.
_BATCH = struct.Struct(">qiibIhiqqqhii")
_LENGTH_END = 12  # base offset and length: `length` counts the bytes after them
_CODEC, _LOG_APPEND_TIME, _TRANSACTIONAL, _CONTROL = 0x07, 0x08, 0x10, 0x20
_DECOMPRESS: dict[int, Callable[[bytes], bytes]] = {
    1: gzip_decode, 2: snappy_decode, 3: lz4_decode, 4: zstd_decode,
}  # fmt: skip
_ABORT = 0  # control record type of a transaction's abort marker
READ_COMMITTED = 1
FETCH_WAIT_MS = 100  # not 0: the test broker answers a Fetch with max wait 0 with no data
# A salvage that found nothing to take waits before the next fetch, doubling from the
# first to the last: never long, so a partition a block paused meanwhile (read on when
# it resumes) or a broker back from an election holds the whole loop back little.
EMPTY_WAIT_S = (0.1, 1.0)


@dataclass
class Salvaged:
    """A partition read leniently from a position: the good records, and those with
    header names that are not UTF-8 (with how many were dropped), up to the end of
    the first batch holding one of those."""

    next_offset: int  # where reading goes on
    records: list[Record] = field(default_factory=list)
    bad: list[tuple[Record, int]] = field(default_factory=list)

    def in_order(self) -> list[Record]:
        """Every record read, good and bad, in offset order."""
        return sorted([*self.records, *(rec for rec, _ in self.bad)], key=lambda r: r.offset)

    def dropped(self) -> dict[int, int]:
        """Per bad record's offset, how many header names that are not UTF-8 it lost."""
        return {rec.offset: count for rec, count in self.bad}


@dataclass
class Fetched:
    """What a loop is handed to take: records per partition in offset order, who the
    consumer was in its group when they were fetched and, when read leniently, the
    records with header names that are not UTF-8 (offset -> names dropped)."""

    records: Mapping[TopicPartition, list[Record]]
    member: Member
    bad: Mapping[TopicPartition, Mapping[int, int]] = field(default_factory=dict)
    next_offsets: Mapping[TopicPartition, int] = field(default_factory=dict)  # read on there

    @property
    def salvaged(self) -> bool:
        """Read leniently, past records aiokafka cannot parse (`Salvage`)."""
        return bool(self.next_offsets)


# Takes a batch; returns the partitions that stop where they are (paused, rewound,
# blocked, or all of them after an aborted transaction): those are not read on.
Take = Callable[[Fetched], Awaitable[set[TopicPartition]]]


class Salvage:
    """Gets a loop past records aiokafka cannot parse (call it under the loop's lock).

    `position(tp)`: where the loop stands in `tp` (None: at its committed offset);
    `read_on(tp, offset)`: told where a partition reads on after a salvage.
    """

    def __init__(
        self,
        consumer: AIOKafkaConsumer,
        kafka: KafkaSettings,
        what: str,
        position: Callable[[TopicPartition], int | None] = lambda tp: None,
        read_on: Callable[[TopicPartition, int], None] = lambda tp, offset: None,
    ) -> None:
        self.consumer = consumer
        self.kafka = kafka
        self.what = what  # "raw", "delay tier", "failure command"
        self.position = position
        self.read_on = read_on
        self.empty = 0  # salvages in a row that found nothing to take

    async def __call__(self, error: UnicodeDecodeError, max_records: int, take: Take) -> float:
        """Read every assigned, unpaused partition leniently from where the loop stands
        and hand `take` one batch: the partitions holding unparseable records, else
        (they lie more than `max_records` ahead) those with records, so the loop gets
        nearer. A partition `take` does not stop reads on after what it was handed.
        Returns how long the loop waits before it fetches again: 0 when it took
        something, else a short backoff (the partition may be paused, or moved)."""
        logger.warning("a %s record cannot be parsed (%s): reading past it", self.what, error)
        member = group_member(self.consumer)
        found = await read_past_bad_headers(self.consumer, self.kafka, max_records, self.position)
        taken = {tp: f for tp, f in (found or {}).items() if f.bad}
        taken = taken or {tp: f for tp, f in (found or {}).items() if f.records}
        if not taken:
            self.empty += 1
            if found is not None:
                paused = self.consumer.paused()
                logger.warning(
                    "no %s record found to read past in %s%s: fetching again",
                    self.what,
                    ", ".join(f"{tp.topic}/{tp.partition}" for tp in sorted(found))
                    or "no partition",
                    f" (paused, read when resumed: {len(paused)})" if paused else "",
                )
            return backoff_delay(*EMPTY_WAIT_S, self.empty)
        self.empty = 0
        stopped = await take(
            Fetched(
                {tp: f.in_order() for tp, f in taken.items()},
                member,
                {tp: f.dropped() for tp, f in taken.items()},
                {tp: f.next_offset for tp, f in taken.items()},
            )
        )
        assigned = self.consumer.assignment()
        for tp, f in taken.items():
            if tp not in stopped and tp in assigned:  # aiokafka cannot read the rest of the batch
                self.consumer.seek(tp, f.next_offset)
                self.read_on(tp, f.next_offset)
        return 0.0


async def read_past_bad_headers(
    consumer: AIOKafkaConsumer,
    kafka: KafkaSettings,
    max_records: int,
    position: Callable[[TopicPartition], int | None] = lambda tp: None,
) -> dict[TopicPartition, Salvaged] | None:
    """Read the assigned, unpaused partitions leniently after `getmany` raised
    UnicodeDecodeError; None when the broker could not be read (try again later).

    The failed `getmany` may have moved partitions past records it never returned,
    so each one is rewound first: to `position(tp)` (where the loop stands), else
    to its committed offset, else to its beginning. Each partition is asked for as
    many bytes as the consumer's own fetches ask (`max_partition_fetch_bytes`).
    """
    assigned = consumer.assignment()
    for tp in assigned:
        at = position(tp)
        if at is None:
            at = await consumer.committed(tp)
        if at is None:
            await consumer.seek_to_beginning(tp)
        else:
            consumer.seek(tp, at)
    fetch_bytes: int = consumer._max_partition_fetch_bytes
    client = AIOKafkaClient(**aiokafka_options(kafka))
    try:
        await client.bootstrap()
        return {
            tp: await read_leniently(
                client, tp, await consumer.position(tp), max_records, fetch_bytes
            )
            for tp in sorted(assigned - consumer.paused())
        }
    except (KafkaError, OSError, TimeoutError) as exc:  # e.g. a leader election
        logger.warning("reading past a record that cannot be parsed failed (%r): trying again", exc)
        return None
    finally:
        await client.close()


async def read_leniently(
    client: AIOKafkaClient, tp: TopicPartition, offset: int, max_records: int, fetch_bytes: int
) -> Salvaged:
    """`tp` from `offset` to the end of its first batch that holds a record with a
    header name that is not UTF-8: aiokafka cannot read any record of that batch
    after it. Gives up (`bad` empty) after about `max_records` good records, or at
    the end of the partition. Each Fetch asks `fetch_bytes` (a larger first batch
    still comes whole: the broker returns one batch at least).
    """
    found = Salvaged(offset)
    while len(found.records) < max_records:
        buffer, aborted = await _fetch(client, tp, found.next_offset, fetch_bytes)
        batches = 0
        for batch in _batches(buffer, aborted):
            batches += 1
            for rec, dropped in batch.records(tp):
                if rec.offset < found.next_offset:
                    continue  # a batch may start before the position
                if dropped:
                    found.bad.append((rec, dropped))
                else:
                    found.records.append(rec)
            found.next_offset = max(found.next_offset, batch.next_offset)
            if found.bad or len(found.records) >= max_records:
                return found
        if not batches:  # the end of what is readable (high watermark, or last stable offset)
            return found
    return found


async def _fetch(
    client: AIOKafkaClient, tp: TopicPartition, offset: int, fetch_bytes: int
) -> tuple[bytes, list[tuple[int, int]]]:
    """The record batches at `offset` and the aborted transactions among them."""
    leader = client.cluster.leader_for_partition(tp)
    if leader is None or leader == -1:
        await client.force_metadata_update()
        leader = client.cluster.leader_for_partition(tp)
    wanted = [(tp.topic, [(tp.partition, offset, fetch_bytes)])]
    request = FetchRequest(FETCH_WAIT_MS, 1, fetch_bytes, READ_COMMITTED, wanted)
    response: Any = await client.send(leader, request)
    ((_, partitions),) = response.topics
    ((_, error_code, _highwater, *data),) = partitions
    if error_code:
        raise for_code(error_code)(f"fetching {tp} at {offset}")
    # v4: [lso, aborted, records]; v5+: [lso, log start, aborted, ...], records last.
    aborted = data[1] if response.API_VERSION == 4 else data[2]
    return data[-1] or b"", aborted or []


@dataclass
class _Batch:
    base_offset: int
    next_offset: int
    attributes: int
    first_timestamp: int
    max_timestamp: int
    count: int
    body: bytes  # the records, decompressed

    def records(self, tp: TopicPartition) -> Iterator[tuple[Record, int]]:
        """Each record, and how many of its header names were dropped as not UTF-8."""
        body, pos = self.body, 0
        log_append = self.attributes & _LOG_APPEND_TIME
        for _ in range(self.count):
            length, pos = _varint(body, pos)
            end = pos + length
            pos += 1  # attributes: unused
            timestamp_delta, pos = _varint(body, pos)
            offset_delta, pos = _varint(body, pos)
            key, pos = _bytes(body, pos)
            value, pos = _bytes(body, pos)
            count, pos = _varint(body, pos)
            headers: list[tuple[str, bytes | None]] = []
            for _ in range(count):
                name, pos = _bytes(body, pos)
                header_value, pos = _bytes(body, pos)
                with contextlib.suppress(UnicodeDecodeError):  # dropped, and counted below
                    headers.append(((name or b"").decode("utf-8"), header_value))
            pos = end
            timestamp = self.max_timestamp if log_append else self.first_timestamp + timestamp_delta
            yield (
                ConsumerRecord(
                    tp.topic, tp.partition, self.base_offset + offset_delta, timestamp,
                    1 if log_append else 0, key, value, None,
                    -1 if key is None else len(key), -1 if value is None else len(value),
                    tuple(headers),
                ),
                count - len(headers),
            )  # fmt: skip


def _batches(buffer: bytes, aborted: list[tuple[int, int]]) -> Iterator[_Batch]:
    """The complete v2 batches of a fetch response, without control batches and
    batches of aborted transactions (aiokafka's read_committed rule)."""
    pending = sorted(aborted, key=lambda a: a[1])  # (producer id, first offset)
    aborting: set[int] = set()
    pos = 0
    while pos + _BATCH.size <= len(buffer):
        (base, length, _, magic, _, attributes, last_delta, first_ts, max_ts,
         producer_id, _, _, count) = _BATCH.unpack_from(buffer, pos)  # fmt: skip
        end = pos + _LENGTH_END + length
        if end > len(buffer) or magic != 2:
            return  # cut short by the fetch size, or an old message format
        body = buffer[pos + _BATCH.size : end]
        pos = end
        while pending and pending[0][1] <= base:
            aborting.add(pending.pop(0)[0])
        codec = attributes & _CODEC
        if codec:
            body = _DECOMPRESS[codec](body)
        batch = _Batch(base, base + last_delta + 1, attributes, first_ts, max_ts, count, body)
        if attributes & _CONTROL:
            marker = next(batch.records(TopicPartition("", 0)), None)
            key = marker[0].key if marker is not None else None
            if key is not None and len(key) >= 4 and struct.unpack_from(">hh", key)[1] == _ABORT:
                aborting.discard(producer_id)
        skip = attributes & _CONTROL or (attributes & _TRANSACTIONAL and producer_id in aborting)
        yield replace(batch, count=0) if skip else batch  # a skipped batch still moves the offset


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    """A zigzag varint at `pos`, and the position after it."""
    value = shift = 0
    while True:
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return (value >> 1) ^ -(value & 1), pos
        shift += 7


def _bytes(buf: bytes, pos: int) -> tuple[bytes | None, int]:
    """Length-prefixed bytes at `pos` (None for a negative length), and the position after."""
    length, pos = _varint(buf, pos)
    if length < 0:
        return None, pos
    return buf[pos : pos + length], pos + length
