"""The pure transforms and the example handler, on small DataFrames without a stream."""

from __future__ import annotations

import base64
import json
from datetime import datetime

import pytest
from aiokafka.structs import ConsumerRecord
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from devtools.handlers import failing_ids
from gateway.contract.commands import parse_command
from spark_sink.handlers import (
    HandlerError,
    check_result,
    customer_totals,
    orders,
    resolve_handler,
)
from spark_sink.transforms import (
    KAFKA_SCHEMA as SCHEMA,
)
from spark_sink.transforms import (
    all_failed,
    batch_time,
    delivery_key,
    parse_dedup_headers,
    release_commands,
    split_results,
)

pytestmark = [pytest.mark.spark, pytest.mark.spark_compat]


def kafka_rows(
    spark: SparkSession, *records: tuple[bytes | None, list[tuple[str, bytes]]]
) -> DataFrame:
    """Kafka-shaped rows (the source schema) from (value, headers) pairs."""
    when = datetime(2026, 1, 1)
    rows = [
        (None, value, "clean", 0, offset, when, 0, [{"key": k, "value": v} for k, v in headers])
        for offset, (value, headers) in enumerate(records)
    ]
    return spark.createDataFrame(rows, SCHEMA)


def gateway_headers(
    n: int, attempt: bytes | None = None, topic: str = "raw"
) -> list[tuple[str, bytes]]:
    headers = [("dedup-id", f"o-{n}".encode()), ("dedup-source", f"{topic}/3/{1000 + n}".encode()),
               ("dedup-token", f"{777 + n}".encode())]  # fmt: skip
    if attempt is not None:
        headers.append(("dedup-attempt", attempt))
    return headers


def order_value(n: int, **fields: object) -> bytes:
    body: dict[str, object] = {"order_id": f"o-{n}", "customer": f"c-{n % 2}", "amount": 10.0 + n}
    body.update(fields)
    return json.dumps({k: v for k, v in body.items() if v is not None}).encode()


def test_dedup_headers_become_columns_and_missing_attempt_means_one(spark):
    df = parse_dedup_headers(
        kafka_rows(
            spark,
            (b"x", gateway_headers(1)),
            (b"y", gateway_headers(2, attempt=b"3")),
            (b"z", [("other", b"1")]),
            (b"w", gateway_headers(4, attempt=b"garbage")),
        )
    )
    got = [
        tuple(r)
        for r in df.select(*("dedup_id", "dedup_source", "dedup_token", "dedup_attempt")).collect()
    ]
    assert got == [
        ("o-1", "raw/3/1001", "778", 1),
        ("o-2", "raw/3/1002", "779", 3),
        (None, None, None, 1),
        ("o-4", "raw/3/1004", "781", 1),
    ]


def test_orders_handler_fails_invalid_amounts_with_a_reason(spark):
    records = parse_dedup_headers(
        kafka_rows(
            spark,
            (order_value(1), gateway_headers(1)),
            (order_value(2, amount=-5), gateway_headers(2)),
            (order_value(3, amount=None), gateway_headers(3)),
            (order_value(4, amount="lots"), gateway_headers(4)),
            (b"not json", gateway_headers(5)),
            (order_value(6, customer=None), gateway_headers(6)),
            (order_value(7, amount="12.5"), gateway_headers(7)),
            (b"[1, 2]", gateway_headers(8)),
            (b'"o-9"', gateway_headers(9)),
            (b"", gateway_headers(10)),
            (None, gateway_headers(11)),
            (b"{}", gateway_headers(12)),
            (b'{"order_id": "o-13"', gateway_headers(13)),
        )
    )
    result = orders(records)
    check_result(result)
    reasons = {r.dedup_id: r.reason for r in result.collect()}
    assert reasons == {
        "o-1": None,
        "o-2": "negative amount: -5",
        "o-3": "missing amount",
        "o-4": "amount is not a number: lots",
        "o-5": "value is not a JSON object",
        "o-6": "missing customer",
        "o-7": None,
        **{f"o-{n}": "value is not a JSON object" for n in (8, 9, 10, 11, 13)},
        "o-12": "missing order_id",
    }
    ok, failed = split_results(result)
    assert sorted(r.order_id for r in ok.collect()) == ["o-1", "o-7"]
    assert "dedup_token" not in ok.columns and "reason" not in ok.columns
    assert failed.count() == 11
    totals = {r.customer: (r.orders, r.amount) for r in customer_totals(ok).collect()}
    assert totals == {"c-1": (2, 11.0 + 12.5)}


def test_release_command_carries_id_token_reason_source_and_attempt(spark):
    records = parse_dedup_headers(
        kafka_rows(
            spark,
            (order_value(2, amount=-1), gateway_headers(2, attempt=b"2", topic="team/raw")),
            (b"v", [("other", b"")]),
            (b"w", [("dedup-id", b"o-3"), ("dedup-token", b"1"), ("dedup-source", b"raw")]),
        )
    )
    commands = release_commands(all_failed(records, "boom")).collect()
    assert len(commands) == 1  # no id/token, or no source: the gateway could not act on it
    assert bytes(commands[0].key) == b"o-2"
    assert json.loads(bytes(commands[0].value)) == {
        "id": "o-2",
        "id_b64": base64.b64encode(b"o-2").decode(),
        "token": "779",
        "reason": "boom",
        "source": {"topic": "team/raw", "partition": 3, "offset": 1002},
        "attempt": 2,
        "reasons": [],
    }


def test_failing_ids_factory_fails_only_the_chosen_ids(spark):
    records = parse_dedup_headers(
        kafka_rows(spark, *((order_value(n), gateway_headers(n)) for n in range(4)))
    )
    handler = resolve_handler(
        "devtools.handlers:failing_ids", {"ids": ["o-1", "o-3"], "reason": "no"}
    )
    reasons = {r.dedup_id: r.reason for r in handler(records).collect()}
    assert reasons == {"o-0": None, "o-1": "no", "o-2": None, "o-3": "no"}
    assert failing_ids(["o-0"])(records).where("reason is not null").count() == 1


def test_bad_handler_specs_and_results_are_rejected(spark):
    with pytest.raises(HandlerError, match="cannot load"):
        resolve_handler("spark_sink.handlers:nope")
    with pytest.raises(HandlerError, match="lacks column"):
        check_result(spark.createDataFrame([(1,)], "dedup_id int"))


def test_release_command_carries_the_earlier_reasons_of_a_retried_record(spark):
    headers = [*gateway_headers(2, attempt=b"3"), ("dedup-reasons", b'["first", "second"]')]
    records = parse_dedup_headers(kafka_rows(spark, (order_value(2, amount=-1), headers)))
    (command,) = release_commands(all_failed(records, "third")).collect()
    body = json.loads(bytes(command.value))
    assert (body["reasons"], body["reason"], body["attempt"]) == (["first", "second"], "third", 3)


def test_delivery_key_names_the_source_record_and_attempt_by_token_else_by_source(spark):
    def dedup(source: bytes, token: bytes | None = None, attempt: bytes | None = None):
        headers = [("dedup-id", b"o-1"), ("dedup-source", source)]
        headers += [("dedup-token", token)] if token is not None else []
        return b"v", headers + ([("dedup-attempt", attempt)] if attempt is not None else [])

    records = parse_dedup_headers(
        kafka_rows(
            spark,
            dedup(b"raw/3/1", b"11"),  # 0: first delivery
            dedup(b"raw/3/1", b"11"),  # 1: a crash replay of it: same token
            dedup(b"raw/3/9", b"12"),  # 2: resent after a release (or redriven): new record
            dedup(b"raw/3/1", b"13", b"2"),  # 3: its retry: next attempt, new token
            dedup(b"raw/3/1"),  # 4: no token (not from the gateway): by id, source, attempt
            dedup(b"raw/3/1"),  # 5: same id, source and attempt as 4
            dedup(b"raw/3/9"),  # 6: another source
            dedup(b"raw/3/1", attempt=b"2"),  # 7: another attempt
            (b"v", []),  # 8: no dedup-id: its own clean-topic coordinates
            (b"v", []),  # 9
        )
    )
    keys = [r.key for r in records.select(delivery_key().alias("key")).collect()]
    assert keys[0] == keys[1] and keys[4] == keys[5]
    assert len(set(keys)) == 8
    assert None not in keys


@pytest.mark.parametrize(
    "raw_id",
    [b"\xff\xfe-bin", bytes(range(256)), "caf\u00e9 \u2603".encode()],
    ids=["invalid-utf8", "every-byte-value", "utf8"],
)
def test_release_command_carries_the_exact_id_bytes_whatever_they_are(spark, raw_id):
    headers = [("dedup-id", raw_id), ("dedup-source", b"raw/0/7"), ("dedup-token", b"5")]
    records = parse_dedup_headers(kafka_rows(spark, (b"v", headers)))
    assert bytes(records.first().dedup_id_bytes) == raw_id
    (command,) = release_commands(all_failed(records, "no")).collect()
    body = json.loads(bytes(command.value))
    assert base64.b64decode(body["id_b64"], validate=True) == raw_id  # one line, no MIME breaks
    assert bytes(command.key) == raw_id
    assert body["id"] == raw_id.decode(errors="replace")  # readable; exact when valid UTF-8
    # The gateway's parser (the one definition of a command) reads back the exact id.
    delivered = ConsumerRecord(
        topic="failures", partition=0, offset=9, timestamp=0, timestamp_type=0,
        key=bytes(command.key), value=bytes(command.value), checksum=None,
        serialized_key_size=0, serialized_value_size=0, headers=[],
    )  # fmt: skip
    parsed = parse_command(delivered)
    assert (parsed.id, parsed.token, parsed.topic, parsed.partition, parsed.offset) == (
        raw_id, "5", "raw", 0, 7
    )  # fmt: skip


def test_a_handler_result_without_the_id_bytes_still_gives_commands(spark):
    records = parse_dedup_headers(kafka_rows(spark, (b"v", gateway_headers(3))))
    (command,) = release_commands(all_failed(records, "no").drop("dedup_id_bytes")).collect()
    assert json.loads(bytes(command.value))["id_b64"] == base64.b64encode(b"o-3").decode()
    assert bytes(command.key) == b"o-3"


def test_passthrough_handler_succeeds_every_record_and_keeps_every_column(spark):
    records = parse_dedup_headers(
        kafka_rows(
            spark,
            (order_value(1), gateway_headers(1)),
            (b"not json", gateway_headers(2)),
            (None, [("other", b"")]),
        )
    )
    result = resolve_handler("spark_sink.handlers:passthrough")(records)
    check_result(result)
    assert result.columns == [*records.columns, "reason"]
    assert result.schema["reason"].dataType.simpleString() == "string"  # storable, not void
    ok, failed = split_results(result)
    assert failed.count() == 0
    assert [(r.offset, r.dedup_id) for r in ok.orderBy("offset").collect()] == [
        (0, "o-1"), (1, "o-2"), (2, None)
    ]  # fmt: skip


def test_batch_time_is_current_timestamp_to_the_microsecond(spark):
    """The dedup's processing time is `current_timestamp()` carried through `reflect`
    (so each micro-batch's generated code stays the same): no precision is lost."""
    rows = (
        spark.range(3)
        .select(
            F.unix_micros(batch_time()).alias("got"),
            F.unix_micros(F.current_timestamp()).alias("expected"),
        )
        .collect()
    )
    assert len(rows) == 3 and all(r.got == r.expected for r in rows)
    assert len({r.got for r in rows}) == 1  # one time for the whole query, as current_timestamp
