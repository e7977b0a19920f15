"""The clean-record contract: header names, the outgoing record, source references.

Every record the gateway writes (clean, quarantine, dead letter) is built
here, so the pipeline, the failure loop, the operator commands and the Spark
job share one vocabulary. Header values are bytes; `dedup-id` holds the id's
exact bytes (not necessarily UTF-8), the others are ASCII.

Sizes: the broker refuses a record batch over its limit (`[kafka]
max_request_bytes`, the producer's `max_request_size` too). `record_size` is
aiokafka's own upper bound for one record alone in a batch; quarantine copies
are cut down to fit it (`dedup-dropped` says what was left out).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple, TypeAlias

from aiokafka import ConsumerRecord
from aiokafka.record.default_records import DefaultRecordBatchBuilder

Record: TypeAlias = ConsumerRecord[bytes, bytes]
Headers: TypeAlias = Sequence[tuple[str, bytes]]

PREFIX = "dedup-"
H_ID = "dedup-id"  # the message id, exact bytes
H_SOURCE = "dedup-source"  # topic/partition/offset of the raw record
H_TOKEN = "dedup-token"  # owner token of the mark: what a release presents
H_ATTEMPT = "dedup-attempt"  # retry attempt, absent on the first
H_REASONS = "dedup-reasons"  # JSON list of the last failure reasons (retries, dead letters)
H_REASON = "dedup-reason"  # the last failure reason (dead letters)
H_UNCERTAIN = "dedup-uncertain"  # "1": forwarded without a majority (on_no_quorum = forward)
H_ERROR = "dedup-error"  # why a record was quarantined
H_DROPPED = "dedup-dropped"  # parts left out of a quarantine copy to fit: "value,headers,key"
# Scheduled delivery (gateway/delay/loop.py): epoch milliseconds, ASCII decimal.
H_DELIVER_AT = "dedup-deliver-at"  # when the record is due on the clean topic
H_TIER_AT = "dedup-tier-at"  # when it entered its delay tier (tier copies only)
H_WINDOW = "dedup-window"  # coalescing: <start>/<close> of the record's window, epoch ms
H_COALESCED = "dedup-coalesced"  # coalescing: updates the emitted window took
H_LANE = "dedup-lane"  # the priority lane of the raw topic (only with `[[lanes]]` configured)

KEEP_REASONS = 5  # reasons carried on retried and dead-lettered records
# What a copy the gateway writes for a decided record adds besides the id, at most.
# clean_headers: four names (46 bytes), their length varints, a source reference
# (topic names are at most 249 characters), a 63-bit token and the uncertain flag.
# A tier copy (scheduled delivery, coalescing) and a lane's copy add these, each
# with its varints: epoch milliseconds and counts (20 digits), a window (two of
# them and a slash), a lane name (64 characters). The id check counts them all, so
# a record it lets through is never too large for a tier after its id was claimed.
_ADDED_LATER = (
    (H_DELIVER_AT, 20),
    (H_TIER_AT, 20),
    (H_WINDOW, 41),
    (H_COALESCED, 20),
    (H_LANE, 64),
)
CLEAN_HEADERS_BOUND = (
    46 + 4 * 10 + (249 + 1 + 10 + 1 + 19) + 19 + 1
    + sum(len(name) + 10 + size for name, size in _ADDED_LATER)
)  # fmt: skip

# The Cython builder wants a list of (str, bytes | None): typed loosely here.
_estimate: Callable[..., int] = DefaultRecordBatchBuilder.estimate_size_in_bytes


class OutRecord(NamedTuple):  # a tuple: built once per forwarded record
    key: bytes | None
    value: bytes | None
    timestamp_ms: int | None
    headers: Headers
    source_partition: int


# What the sink takes: an OutRecord, or a plain tuple in the same order (the data
# path builds those: a NamedTuple's constructor is a Python call per record).
OutRow: TypeAlias = tuple[bytes | None, bytes | None, int | None, Headers, int]


def source_ref(topic: str, partition: int, offset: int) -> str:
    """The `dedup-source` header value (and how logs name a record)."""
    return f"{topic}/{partition}/{offset}"


def coordinates(topic: str, partition: int, offset: int) -> dict[str, str | int]:
    """A record's coordinates as log fields (`extra=`): top-level keys of JSON log lines."""
    return {"topic": topic, "partition": partition, "offset": offset}


def parse_source_ref(ref: str) -> tuple[str, int, int]:
    """Inverse of `source_ref`; raises ValueError on anything else."""
    topic, partition, offset = ref.rsplit("/", 2)
    if not topic:
        raise ValueError(f"no topic in source reference {ref!r}")
    return topic, int(partition), int(offset)


def own_headers(headers: Headers) -> list[tuple[str, bytes]]:
    """The raw headers minus any `dedup-*` (a producer cannot forge ours)."""
    if any(k.startswith(PREFIX) for k, _ in headers):
        return [(k, v) for k, v in headers if not k.startswith(PREFIX)]
    return list(headers)


def clean_headers(
    record: Record, message_id: bytes, token: str, extra: Headers = ()
) -> list[tuple[str, bytes]]:
    """The raw headers (minus any stale dedup-*) plus this gateway's own."""
    return list(clean_rows([record], [message_id], [token], extra)[0][3])


def clean_rows(
    records: Sequence[Record],
    message_ids: Iterable[bytes],
    tokens: Iterable[str],
    extra: Headers = (),
) -> list[OutRow]:
    """The clean copies of raw records of ONE partition, with their ids and owner tokens.

    The one definition of the clean headers (`clean_headers` is this for one
    record). Built in bulk: the `dedup-*` check and the source prefix are
    done once per batch, not per record.
    """
    if not records:
        return []
    first = records[0]
    prefix = f"{first.topic}/{first.partition}/".encode()  # + offset: `source_ref`
    if any(k.startswith(PREFIX) for k in {k for r in records for k, _ in r.headers}):
        raw_headers = [own_headers(r.headers) for r in records]
    else:
        raw_headers = [r.headers for r in records]
    return [
        (r.key, r.value, r.timestamp,
         [*raw, (H_ID, mid), (H_SOURCE, b"%b%d" % (prefix, r.offset)), (H_TOKEN, token.encode()),
          *extra],
         r.partition)
        for r, raw, mid, token in zip(records, raw_headers, message_ids, tokens, strict=True)
    ]  # fmt: skip


def clean_record(record: Record, headers: Headers) -> OutRecord:
    """`record`'s key, value and timestamp with `headers`, keeping its partition number."""
    return OutRecord(record.key, record.value, record.timestamp, headers, record.partition)


def record_size(key: bytes | None, value: bytes | None, headers: Headers) -> int:
    """Upper bound of the bytes of one record alone in a batch: aiokafka's own
    estimate, the one its `send` checks against `max_request_size`."""
    return _estimate(key, value, headers if type(headers) is list else list(headers))


def quarantine_record(record: Record, reason: str, max_bytes: int) -> OutRecord:
    """The quarantine copy: the raw record plus why, and where it came from, within
    `max_bytes` (see `fitted`)."""
    ours = [
        (H_ERROR, reason.encode("utf-8", "backslashreplace")),
        (H_SOURCE, source_ref(record.topic, record.partition, record.offset).encode()),
    ]
    # A producer cannot forge ours: raw `dedup-*` headers are left out (own_headers).
    headers = own_headers(record.headers)
    raw = OutRecord(record.key, record.value, record.timestamp, headers, record.partition)
    return fitted(raw, ours, max_bytes)


def refused_record(out: OutRecord, reason: str, max_bytes: int) -> OutRecord:
    """The quarantine copy of an outgoing record the broker would refuse: its key,
    value and non-dedup headers, why, and its `dedup-source`."""
    carried = [(k, v) for k, v in out.headers if k == H_SOURCE]
    raw = out._replace(headers=own_headers(out.headers))
    return fitted(raw, [(H_ERROR, reason.encode("utf-8", "backslashreplace")), *carried], max_bytes)


def fitted(raw: OutRecord, ours: Headers, max_bytes: int) -> OutRecord:
    """`raw` with headers `ours` added, leaving out its value, then its headers, then
    its key until the record fits `max_bytes`; `dedup-dropped` names what was left
    out (the whole record stays where `dedup-source` points)."""
    key, value, headers = raw.key, raw.value, list(raw.headers)
    dropped: list[str] = []
    for part in ("", "value", "headers", "key"):
        if part == "value" and value:
            value = None
        elif part == "headers" and headers:
            headers = []
        elif part == "key" and key:
            key = None
        elif part:
            continue  # nothing of that part to leave out
        if part:
            dropped.append(part)
        out = [*headers, *ours, *([(H_DROPPED, ",".join(dropped).encode())] if dropped else [])]
        if record_size(key, value, out) <= max_bytes:
            break
    return OutRecord(key, value, raw.timestamp_ms, out, raw.source_partition)
