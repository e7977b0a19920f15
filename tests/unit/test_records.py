"""The clean-record contract: size bounds and quarantine copies that always fit."""

from __future__ import annotations

from aiokafka import ConsumerRecord
from aiokafka.record.default_records import DefaultRecordBatchBuilder

from gateway.contract.records import (
    H_DROPPED,
    H_ERROR,
    H_ID,
    H_SOURCE,
    H_TOKEN,
    OutRecord,
    quarantine_record,
    record_size,
    refused_record,
)

LIMIT = 4096


def raw(key: bytes | None, value: bytes | None, headers: list[tuple[str, bytes]]):
    return ConsumerRecord("raw", 3, 17, 1_700_000_000_000, 0, key, value, None, 0, 0, headers)


def batch_bytes(out: OutRecord) -> int:
    """What the producer really sends for `out` alone in a batch."""
    builder = DefaultRecordBatchBuilder(2, 0, 0, -1, -1, -1, 10**7)
    builder.append(0, out.timestamp_ms, out.key, out.value, list(out.headers))
    return len(builder.build())


def test_record_size_bounds_the_bytes_a_record_takes_alone_in_a_batch():
    for value in (b"", b"v" * 100, b"v" * 100_000):
        out = OutRecord(b"k", value, 1, [("a", b"x" * 300), ("dedup-id", b"i")], 0)
        assert batch_bytes(out) <= record_size(out.key, out.value, out.headers)
        assert record_size(out.key, out.value, out.headers) - batch_bytes(out) < 40


def test_a_quarantine_copy_that_fits_keeps_the_whole_record():
    rec = raw(b"k", b"v" * 1000, [("h", b"1")])
    copy = quarantine_record(rec, "missing_header: no header 'message-id'", LIMIT)
    assert (copy.key, copy.value, copy.timestamp_ms) == (b"k", b"v" * 1000, rec.timestamp)
    headers = dict(copy.headers)
    assert headers["h"] == b"1"
    assert headers[H_ERROR] == b"missing_header: no header 'message-id'"
    assert headers[H_SOURCE] == b"raw/3/17"
    assert H_DROPPED not in headers


def test_a_quarantine_copy_carries_only_the_gateways_own_dedup_headers():
    """A producer cannot forge where a quarantined record came from (found by tests/chaos)."""
    forged = [("h", b"1"), (H_SOURCE, b"elsewhere/0/0"), (H_ID, b"forged"), (H_TOKEN, b"1")]
    copy = quarantine_record(raw(None, b"v", forged), "missing_header: no id", LIMIT)
    assert [v for k, v in copy.headers if k == H_SOURCE] == [b"raw/3/17"]
    assert not {H_ID, H_TOKEN} & {k for k, _ in copy.headers}
    assert ("h", b"1") in copy.headers


def test_a_quarantine_copy_leaves_out_the_value_then_headers_then_key_until_it_fits():
    just_fits = LIMIT - record_size(b"k", b"", [("h", b"1")])
    cases = [
        (raw(b"k", b"v" * just_fits, [("h", b"1")]), b"value"),  # fits raw, not with ours
        (raw(b"k", b"", [("h", b"x" * LIMIT)]), b"headers"),
        (raw(b"k" * LIMIT, b"v" * 10, [("h", b"x" * 10)]), b"value,headers,key"),
    ]
    for rec, dropped in cases:
        copy = quarantine_record(rec, "too_large: the clean copy would be too large", LIMIT)
        assert record_size(copy.key, copy.value, copy.headers) <= LIMIT
        headers = dict(copy.headers)
        assert headers[H_DROPPED] == dropped
        assert headers[H_SOURCE] == b"raw/3/17"  # where the whole record still is
        assert headers[H_ERROR].startswith(b"too_large:")


def test_a_refused_outgoing_record_becomes_a_fitting_copy_naming_its_source():
    out = OutRecord(
        b"k", b"v" * 2 * LIMIT, 5,
        [("h", b"1"), (H_ID, b"m-1"), (H_SOURCE, b"raw/0/9"), (H_TOKEN, b"123")], 0,
    )  # fmt: skip
    copy = refused_record(out, "too_large: 8300 bytes for clean, limit 4096", LIMIT)
    assert record_size(copy.key, copy.value, copy.headers) <= LIMIT
    assert copy.value is None and copy.key == b"k"
    assert copy.headers == [
        ("h", b"1"),
        (H_ERROR, b"too_large: 8300 bytes for clean, limit 4096"),
        (H_SOURCE, b"raw/0/9"),
        (H_DROPPED, b"value"),
    ]


def test_a_tier_copy_of_a_lane_record_with_every_header_at_its_largest_fits_the_bound():
    """The id check adds CLEAN_HEADERS_BOUND to the raw record's size: every header a
    decided record's copy can gain (clean, delay tier, coalescing window, lane) fits."""
    from gateway.contract.records import (
        CLEAN_HEADERS_BOUND,
        H_COALESCED,
        H_DELIVER_AT,
        H_LANE,
        H_TIER_AT,
        H_UNCERTAIN,
        H_WINDOW,
        source_ref,
    )

    message_id = b"m" * 100
    record = raw(b"k", b"v" * 1000, [("message-id", message_id)])
    largest_ms = str(2**63 - 1).encode()  # 19 digits
    copy_headers = [
        *record.headers,
        (H_ID, message_id),
        (H_SOURCE, source_ref("t" * 249, 2**31 - 1, 2**63 - 1).encode()),
        (H_TOKEN, largest_ms),
        (H_UNCERTAIN, b"1"),
        (H_DELIVER_AT, largest_ms),
        (H_TIER_AT, largest_ms),
        (H_WINDOW, largest_ms + b"/" + largest_ms),
        (H_COALESCED, largest_ms),
        (H_LANE, b"l" * 64),
    ]
    allowed = record_size(record.key, record.value, record.headers) + len(message_id)
    assert record_size(record.key, record.value, copy_headers) <= allowed + CLEAN_HEADERS_BOUND
