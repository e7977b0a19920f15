"""parse_command: every failure-topic value gives a Command or InvalidCommand, never a crash."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest
from aiokafka import ConsumerRecord

from gateway.contract.commands import MAX_COMMAND_BYTES, MAX_REASON_CHARS, Command, parse_command
from gateway.contract.records import KEEP_REASONS
from gateway.errors import InvalidCommand

GOOD: dict[str, Any] = {
    "id": "m-1",
    "token": "12345",
    "reason": "boom",
    "source": {"topic": "raw", "partition": 0, "offset": 7},
    "attempt": 1,
    "reasons": [],
}


def record(value: bytes | None, key: bytes | None = b"k") -> ConsumerRecord[bytes, bytes]:
    return ConsumerRecord(
        topic="failures", partition=1, offset=42, timestamp=0, timestamp_type=0,
        key=key, value=value, checksum=None, serialized_key_size=0,
        serialized_value_size=0, headers=[],
    )  # fmt: skip


def parse(body: Any) -> Command:
    return parse_command(record(json.dumps(body).encode()))


def reason_of(value: bytes) -> str:
    with pytest.raises(InvalidCommand) as err:
        parse_command(record(value))
    return err.value.reason


def test_a_good_command_names_its_record_and_where_it_came_from():
    cmd = parse(GOOD)
    assert (cmd.id, cmd.token, cmd.topic, cmd.partition, cmd.offset) == (
        b"m-1", "12345", "raw", 0, 7,
    )  # fmt: skip
    assert cmd.ref == "failures/1/42"
    assert cmd.history == ["boom"]


def test_id_b64_gives_the_exact_bytes_of_an_id_that_is_not_utf8():
    exact = b"\xff\xfe-bin"
    cmd = parse({**GOOD, "id": "\ufffd\ufffd-bin", "id_b64": base64.b64encode(exact).decode()})
    assert cmd.id == exact
    assert cmd.readable_id == "\\xff\\xfe-bin"


@pytest.mark.parametrize("encoded", ["", "not base64!", "QUJ", "_-8=", 7, None])
def test_an_invalid_or_empty_id_b64_is_a_bad_field(encoded):
    body = {**GOOD, "id_b64": encoded}
    if encoded is None:  # null is "absent": the readable id is used
        assert parse(body).id == b"m-1"
        return
    assert reason_of(json.dumps(body).encode()) == "bad_field"


def test_a_lone_surrogate_in_the_id_is_a_bad_field_unless_id_b64_gives_the_bytes():
    value = json.dumps(GOOD).replace('"m-1"', '"m-\\ud800"').encode()
    assert reason_of(value) == "bad_field"
    with_bytes = json.loads(value)
    with_bytes["id_b64"] = base64.b64encode(b"m-\xed\xa0\x80").decode()
    assert parse(with_bytes).id == b"m-\xed\xa0\x80"


def test_a_lone_surrogate_in_reason_topic_or_reasons_comes_out_encodable():
    value = (
        json.dumps({**GOOD, "reasons": ["r"]})
        .replace('"boom"', '"bo\\ud800om"')
        .replace('"raw"', '"r\\udfffaw"')
        .replace('["r"]', '["\\ud83d"]')
        .encode()
    )
    cmd = parse_command(record(value))
    for text in (cmd.reason, cmd.topic, *cmd.reasons):
        text.encode()  # no UnicodeEncodeError: headers and logs can carry it
    assert cmd.reason == "bo\\ud800om"


@pytest.mark.parametrize(
    "value",
    [b"[" * 100_000, b'{"id": ' + b"[" * 100_000, b"{" * 50_000, b'{"a":' * 50_000],
    ids=["array", "in-a-field", "objects", "object-values"],
)
def test_deeply_nested_json_is_not_json_not_a_crash(value):
    assert reason_of(value) == "not_json"


def test_a_huge_value_is_too_large_before_parsing():
    padding = "x" * MAX_COMMAND_BYTES
    assert reason_of(json.dumps({**GOOD, "reason": padding}).encode()) == "too_large"


def test_long_reasons_are_cut_and_only_the_last_few_kept():
    long = "y" * (MAX_REASON_CHARS * 10)
    cmd = parse({**GOOD, "reason": long, "reasons": [str(i) for i in range(10_000)]})
    assert len(cmd.reason) == MAX_REASON_CHARS
    assert cmd.reasons == tuple(str(i) for i in range(10_000 - KEEP_REASONS, 10_000))


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"source": {"topic": "raw", "partition": 2**31, "offset": 0}}, "bad_field"),
        ({"source": {"topic": "raw", "partition": 0, "offset": 2**63}}, "bad_field"),
        ({"source": {"topic": "raw", "partition": True, "offset": 0}}, "bad_field"),
        ({"source": {"topic": "", "partition": 0, "offset": 0}}, "bad_field"),
        ({"source": "raw/0/7"}, "missing_field"),
        ({"source": ["raw", 0, 7]}, "missing_field"),
        ({"attempt": 0}, "bad_field"),
        ({"attempt": 1.5}, "bad_field"),
        ({"token": "\uff11\uff12\uff13"}, "bad_field"),  # full-width digits: isdigit, not ASCII
        ({"reasons": "boom"}, "bad_field"),
        ({"id": ""}, "bad_field"),
        ({"id": 7}, "bad_field"),
    ],
)
def test_fields_out_of_kafka_range_or_of_the_wrong_type_are_rejected(change, reason):
    assert reason_of(json.dumps({**GOOD, **change}).encode()) == reason


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        (None, "not_json"),
        (b"", "not_json"),
        (b"\xff\xfe", "not_json"),
        (b"1e999999", "not_object"),  # inf
        (b"1" * 5000, "not_json"),  # past Python's int digit limit
        (b"[1, 2]", "not_object"),
        (b'{"id": "m-1"}', "missing_field"),
    ],
)
def test_values_that_are_not_commands(value, reason):
    assert reason_of(value) == reason
