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
