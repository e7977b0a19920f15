"""Every id extractor, on any bytes: the id's bytes or BadRecord, never another exception."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.errors import BAD_RECORD_REASONS, BadRecord
from gateway.rules.ids import build_extractor

SPECS = ["header:message-id", "key", "json:a", "json:a.b", "hash"]


@dataclass
class Rec:
    key: bytes | None = None
    value: bytes | None = None
    headers: list[tuple[str, bytes | None]] = field(default_factory=list)


# JSON-ish bytes find the json extractor's corners faster than random bytes alone.
JSON_TEXT = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from("ab"), inner),
    max_leaves=8,
).map(lambda v: json.dumps(v).encode())
TRICKY = st.sampled_from(
    [b'{"a": "\\ud800"}', b'{"a": {"b": "\\udfff"}}', b'{"a": 1e999}', b'{"a": NaN}',
     b'{"a": ' + b"9" * 5000 + b"}", b"\xef\xbb\xbf{}", b'\x00{\x00"\x00a', b"[" * 100_000]
)  # fmt: skip
VALUES = st.none() | st.binary(max_size=200) | JSON_TEXT | TRICKY
HEADERS = st.lists(
    st.tuples(st.sampled_from(["message-id", "other", ""]), st.none() | st.binary(max_size=40)),
    max_size=3,
)


@settings(max_examples=400, deadline=None)
@given(
    spec=st.sampled_from(SPECS),
    max_bytes=st.integers(1, 64),
    key=st.none() | st.binary(max_size=80),
    value=VALUES,
    headers=HEADERS,
)
def test_any_record_yields_an_id_or_a_bad_record_with_a_known_reason(
    spec, max_bytes, key, value, headers
):
    extract = build_extractor(spec, max_bytes)
    try:
        message_id = extract(Rec(key, value, headers))
    except BadRecord as exc:
        assert exc.reason in BAD_RECORD_REASONS
    else:
        assert isinstance(message_id, bytes)
        assert 0 < len(message_id) <= max_bytes


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        (b"[" * 100_000 + b"]" * 100_000, "not_json"),  # RecursionError inside json.loads
        (b'{"a": {"b": ' + b"[" * 100_000 + b"}}", "not_json"),
        (b'{"a": {"b": "\\ud800"}}', "bad_id"),  # valid JSON, not encodable as UTF-8
    ],
)
def test_hostile_json_is_bad_input_not_a_crash(value, reason):
    with pytest.raises(BadRecord) as err:
        build_extractor("json:a.b", 1024)(Rec(value=value))
    assert err.value.reason == reason


JSON_OBJECTS = st.dictionaries(
    st.sampled_from(["a", "b", "id"]),
    st.none() | st.booleans() | st.integers() | st.text(max_size=20),
    max_size=3,
).map(lambda v: json.dumps(v).encode())


@settings(max_examples=300, deadline=None)
@given(value=JSON_OBJECTS, schema_id=st.integers(0, 2**32 - 1), path=st.sampled_from(["a", "id"]))
def test_a_confluent_framed_json_value_gives_the_same_id_as_the_plain_value(
    value: bytes, schema_id: int, path: str
) -> None:
    """Magic byte 0 + a 4-byte schema id + the JSON: the frame is skipped, whatever the id."""
    extract = build_extractor(f"json:{path}", 1024)
    framed = Rec(value=b"\x00" + schema_id.to_bytes(4, "big") + value)
    try:
        plain_id = extract(Rec(value=value))
    except BadRecord as plain_error:
        with pytest.raises(BadRecord) as framed_error:
            extract(framed)
        assert framed_error.value.reason == plain_error.reason
    else:
        assert extract(framed) == plain_id
