"""Id extraction per strategy; bad records raise BadRecord with a reason."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from gateway.contract.records import parse_source_ref, source_ref
from gateway.contract.tokens import DIGEST_BYTES, mark_digest, owner_token
from gateway.errors import BadRecord
from gateway.rules.ids import build_extractor


@dataclass
class Rec:
    key: bytes | None = None
    value: bytes | None = None
    headers: list[tuple[str, bytes]] = field(default_factory=list)


def test_header_key_json_and_hash_strategies():
    rec = Rec(b"k1", b'{"order": {"id": "o-9", "n": 42}}', [("message-id", b"m-1")])
    assert build_extractor("header:message-id", 100)(rec) == b"m-1"
    assert build_extractor("key", 100)(rec) == b"k1"
    assert build_extractor("json:order.id", 100)(rec) == b"o-9"
    assert build_extractor("json:order.n", 100)(rec) == b"42"
    hashed = build_extractor("hash", 100)
    assert hashed(rec) == hashed(Rec(value=rec.value)) != hashed(Rec(value=b"other"))


@pytest.mark.parametrize(
    ("spec", "rec", "reason"),
    [
        ("header:message-id", Rec(value=b"x"), "missing_header"),
        ("header:message-id", Rec(headers=[("message-id", b"")]), "empty_id"),
        ("header:message-id", Rec(headers=[("message-id", b"x" * 65)]), "oversize_id"),
        ("key", Rec(value=b"x"), "missing_key"),
        ("json:order.id", Rec(value=b"not json"), "not_json"),
        ("json:order.id", Rec(value=b"\xff\xfe"), "not_json"),
        ("json:order.id", Rec(value=None), "not_json"),
        ("json:order.id", Rec(value=b'{"order": {}}'), "missing_field"),
        ("json:order.id", Rec(value=b"[1, 2]"), "missing_field"),
        ("json:order", Rec(value=b'{"order": {"id": 1}}'), "missing_field"),
        ("hash", Rec(value=None), "empty_id"),
    ],
)
def test_bad_records_raise_with_reason(spec, rec, reason):
    with pytest.raises(BadRecord) as err:
        build_extractor(spec, 64)(rec)
    assert err.value.reason == reason


def test_mark_digest_is_fixed_size_whatever_the_id_length():
    assert len(mark_digest(b"x" * 10_000)) == DIGEST_BYTES
    assert mark_digest(b"a") != mark_digest(b"b")


def test_owner_token_is_a_63_bit_decimal_that_differs_per_record_and_attempt():
    token = owner_token("raw", 3, 1042)
    assert token.isdigit() and int(token) < 2**63
    assert token == owner_token("raw", 3, 1042)
    assert len({token, owner_token("raw", 3, 1043), owner_token("raw", 3, 1042, 2)}) == 3


def test_source_ref_round_trips_topics_with_slashes():
    assert parse_source_ref(source_ref("a/b", 2, 7)) == ("a/b", 2, 7)
    with pytest.raises(ValueError, match="invalid literal"):
        parse_source_ref("raw/x/1")


def test_a_confluent_framed_json_value_is_read_past_its_frame_and_a_short_one_is_not_json():
    extract = build_extractor("json:order.id", 100)
    framed = b"\x00\x00\x00\x01\x2a" + b'{"order": {"id": "o-9"}}'
    assert extract(Rec(value=framed)) == b"o-9"
    for bad in (b"\x00\x00\x01", b"\x00\x00\x00\x00\x07not json"):
        with pytest.raises(BadRecord) as refused:
            extract(Rec(value=bad))
        assert refused.value.reason == "not_json"
