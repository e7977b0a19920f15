"""The lenient record-batch parser: what aiokafka reads, plus what it cannot."""

from __future__ import annotations

import struct

from aiokafka import TopicPartition
from aiokafka.codec import gzip_encode
from aiokafka.record.default_records import DefaultRecordBatchBuilder
from aiokafka.record.memory_records import MemoryRecords
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.kafka.salvage import _batches

TP = TopicPartition("raw", 3)
GZIP = 1
_ATTRIBUTES_AT = 21  # in the batch header: base offset, length, epoch, magic, crc
PLACEHOLDER = "\x01\x02\x03\x04\x05\x06"

RECORDS = st.lists(
    st.tuples(
        st.none() | st.binary(max_size=20),
        st.none() | st.binary(max_size=50),
        st.lists(st.tuples(st.text(max_size=8), st.none() | st.binary(max_size=8)), max_size=3),
    ),
    min_size=1,
    max_size=8,
)


def build(records, base_offset=0, codec=0, producer_id=-1, transactional=False) -> bytearray:
    builder = DefaultRecordBatchBuilder(2, codec, int(transactional), producer_id, 0, 0, 10**6)
    for i, (key, value, headers) in enumerate(records):
        builder.append(i, 1_700_000_000_000 + i, key, value, headers)
    data = bytearray(builder.build())
    struct.pack_into(">q", data, 0, base_offset)
    return data


def parsed(buffer: bytes, aborted=()):
    return [
        (rec.offset, rec.timestamp, rec.key, rec.value, rec.headers, dropped)
        for batch in _batches(bytes(buffer), list(aborted))
        for rec, dropped in batch.records(TP)
    ]


@settings(max_examples=150, deadline=None)
@given(records=RECORDS, base=st.integers(0, 2**40), codec=st.sampled_from([0, GZIP]))
def test_it_reads_what_aiokafka_reads(records, base, codec):
    buffer = bytes(build(records, base, codec))
    theirs = MemoryRecords(buffer).next_batch()
    expected = [(r.offset, r.timestamp, r.key, r.value, tuple(r.headers), 0) for r in theirs]
    assert parsed(buffer) == expected


def test_a_header_name_that_is_not_utf8_is_dropped_and_counted_in_a_compressed_batch():
    records = [(b"k0", b"v0", [("id", b"0")]),
               (b"k1", b"v1", [("id", b"1"), (PLACEHOLDER, b"x"), ("\x07", b"y")])]  # fmt: skip
    plain = build(records, base_offset=40)
    at = plain.index(PLACEHOLDER.encode())
    plain[at : at + len(PLACEHOLDER)] = b"\xff" * len(PLACEHOLDER)
    # The same records compressed, as a producer with compression would send them.
    body = bytes(plain[61:])
    compressed = bytearray(plain[:61]) + gzip_encode(body)
    struct.pack_into(">i", compressed, 8, len(compressed) - 12)
    struct.pack_into(">h", compressed, _ATTRIBUTES_AT, GZIP)
    for buffer in (plain, compressed):
        assert parsed(buffer) == [
            (40, 1_700_000_000_000, b"k0", b"v0", (("id", b"0"),), 0),
            (41, 1_700_000_000_001, b"k1", b"v1", (("id", b"1"), ("\x07", b"y")), 1),
        ]


def test_aborted_transactions_and_control_batches_are_skipped_but_move_the_offset():
    committed = build([(b"k", b"kept", [])], base_offset=0, producer_id=5, transactional=True)
    aborted = build([(b"k", b"aborted", [])], base_offset=1, producer_id=7, transactional=True)
    marker = build([(struct.pack(">hh", 0, 0), b"", [])], base_offset=2, producer_id=7,
                   transactional=True)  # fmt: skip
    attributes = struct.unpack_from(">h", marker, _ATTRIBUTES_AT)[0] | 0x20  # a control batch
    struct.pack_into(">h", marker, _ATTRIBUTES_AT, attributes)
    later = build([(b"k", b"after", [])], base_offset=3, producer_id=7, transactional=True)
    buffer = bytes(committed + aborted + marker + later)
    batches = list(_batches(buffer, [(7, 1)]))
    assert [b.next_offset for b in batches] == [1, 2, 3, 4]
    assert [v for _, _, _, v, _, _ in parsed(buffer, [(7, 1)])] == [b"kept", b"after"]


def test_a_batch_cut_short_by_the_fetch_size_is_left_for_the_next_fetch():
    first, second = build([(b"k", b"a", [])]), build([(b"k", b"b", [])], base_offset=1)
    buffer = bytes(first + second[:-3])
    assert [b.next_offset for b in _batches(buffer, [])] == [1]
