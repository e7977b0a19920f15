"""A record the id extractor accepts under a size limit has a clean copy within it."""

from __future__ import annotations

import string

from aiokafka import ConsumerRecord
from aiokafka.record.default_records import DefaultRecordBatchBuilder
from hypothesis import example, given, settings
from hypothesis import strategies as st

from gateway.contract.records import (
    CLEAN_HEADERS_BOUND,
    H_UNCERTAIN,
    clean_headers,
    clean_record,
    record_size,
)
from gateway.contract.tokens import owner_token
from gateway.errors import BadRecord
from gateway.rules.ids import build_extractor

TOPIC = st.text(string.ascii_letters + string.digits + "._-", min_size=1, max_size=249)
HEADERS = st.lists(st.tuples(st.text(max_size=20), st.binary(max_size=400)), max_size=4)


@settings(max_examples=300, deadline=None)
@given(
    topic=TOPIC, partition=st.integers(0, 2**31 - 1), offset=st.integers(0, 2**63 - 1),
    key=st.none() | st.binary(max_size=300), headers=HEADERS,
    message_id=st.binary(min_size=1, max_size=300), limit=st.integers(1024, 8000),
    slack=st.integers(-3, 3), uncertain=st.booleans(),
)  # fmt: skip
@example(  # the longest source reference and token there are
    topic="t" * 249, partition=2**31 - 1, offset=2**63 - 1, key=None, headers=[],
    message_id=b"i", limit=1024, slack=0, uncertain=True,
)  # fmt: skip
def test_an_accepted_record_has_a_clean_copy_the_broker_takes(
    topic, partition, offset, key, headers, message_id, limit, slack, uncertain
):
    headers = [*headers, ("message-id", message_id)]
    # A value that puts the record at the edge of what the extractor accepts.
    empty = record_size(key, b"", headers)
    edge = max(0, limit - empty - len(message_id) - CLEAN_HEADERS_BOUND)
    edge -= record_size(key, b"v" * edge, headers) - empty - edge  # the length's varint grows
    value = b"v" * max(0, edge + slack)
    rec = ConsumerRecord(topic, partition, offset, 1_700_000_000_000, 0, key, value, None, 0, 0,
                         headers)  # fmt: skip
    try:
        got = build_extractor("header:message-id", 1024, limit)(rec)
    except BadRecord as exc:
        assert exc.reason == "too_large"
        return
    token = owner_token(topic, partition, offset, 2**31)  # the longest token there is
    extra = [(H_UNCERTAIN, b"1")] if uncertain else ()
    clean = clean_record(rec, clean_headers(rec, got, token, extra))
    builder = DefaultRecordBatchBuilder(2, 0, 0, -1, -1, -1, 10**7)
    builder.append(0, clean.timestamp_ms, clean.key, clean.value, list(clean.headers))
    assert len(builder.build()) <= limit
