"""Failure commands: what the Spark job sends back when processing a clean record failed.

A command is a record on the failure topic: key = the id's bytes, value = JSON

    {"id", "id_b64", "token", "reason", "source": {"topic", "partition", "offset"},
     "attempt", "reasons"}

`id` is the readable id; `id_b64` (base64 of the exact `dedup-id` bytes) is
what the gateway uses when present, so ids that are not UTF-8 survive the
round trip through Spark. Whatever the value holds, parsing returns a
`Command` whose text fields can be encoded again (lone surrogates escaped),
whose numbers fit Kafka's types and whose reasons are bounded, or raises
`InvalidCommand` with a reason code. One wire format, both sides: the field names are
`Fields`', which the gateway reads here (`gateway.failures.loop` parses with
`parse_command`) and the Spark job writes with (`spark_sink.transforms`).
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass

from gateway.contract.records import KEEP_REASONS, Record, source_ref
from gateway.errors import InvalidCommand

MAX_COMMAND_BYTES = 1_048_576  # larger values are not commands we sent
MAX_REASON_CHARS = 1_000  # a reason rides on every later retry's headers: keep it short
MAX_PARTITION = 2**31 - 1  # Kafka's int32
MAX_OFFSET = 2**63 - 1  # Kafka's int64


class Fields:
    """The command's JSON field names."""

    ID = "id"
    ID_B64 = "id_b64"
    TOKEN = "token"
    REASON = "reason"
    SOURCE = "source"
    TOPIC = "topic"
    PARTITION = "partition"
    OFFSET = "offset"
    ATTEMPT = "attempt"
    REASONS = "reasons"


@dataclass(frozen=True)
class Command:
    id: bytes  # the exact id bytes
    token: str
    reason: str
    topic: str
    partition: int
    offset: int
    attempt: int
    reasons: tuple[str, ...]
    ref: str  # failure-topic coordinates of this delivery

    @property
    def history(self) -> list[str]:
        return [*self.reasons, self.reason][-KEEP_REASONS:]

    @property
    def readable_id(self) -> str:
        return self.id.decode("utf-8", "backslashreplace")


def parse_command(rec: Record) -> Command:
    """Validate one failure-topic record; raise InvalidCommand with a reason code."""
    if rec.value is not None and len(rec.value) > MAX_COMMAND_BYTES:
        raise InvalidCommand("too_large", f"{len(rec.value)} bytes")
    try:
        body = json.loads(rec.value or b"")
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise InvalidCommand("not_json", f"{type(exc).__name__}: {exc}"[:200]) from None
    if not isinstance(body, dict):
        raise InvalidCommand("not_object", "command is not a JSON object")
    source = body.get(Fields.SOURCE)
    try:
        readable, token = body[Fields.ID], body[Fields.TOKEN]
        topic = source[Fields.TOPIC]  # type: ignore[index]
        partition, offset = source[Fields.PARTITION], source[Fields.OFFSET]  # type: ignore[index]
    except (KeyError, TypeError):
        raise InvalidCommand(
            "missing_field", "needs id, token, source.topic/partition/offset"
        ) from None
    attempt = body.get(Fields.ATTEMPT, 1)
    reasons = body.get(Fields.REASONS, [])
    reason = body.get(Fields.REASON, "")
    checks = [
        isinstance(readable, str) and readable != "",
        isinstance(token, str) and token.isascii() and token.isdigit(),
        isinstance(topic, str) and topic != "",
        type(partition) is int and 0 <= partition <= MAX_PARTITION,
        type(offset) is int and 0 <= offset <= MAX_OFFSET,
        type(attempt) is int and 1 <= attempt <= MAX_PARTITION,
        isinstance(reasons, list) and all(isinstance(r, str) for r in reasons),
        reason is None or isinstance(reason, str),
    ]
    if not all(checks):
        raise InvalidCommand("bad_field", f"a field has the wrong type or value: {body!r:.200}")
    return Command(
        id=_id_bytes(body, readable),
        token=token,
        reason=_text(reason or "")[:MAX_REASON_CHARS],
        topic=_text(topic),
        partition=partition,
        offset=offset,
        attempt=attempt,
        reasons=tuple(_text(r)[:MAX_REASON_CHARS] for r in reasons[-KEEP_REASONS:]),
        ref=source_ref(rec.topic, rec.partition, rec.offset),
    )


def _id_bytes(body: dict[str, object], readable: str) -> bytes:
    """The exact id: `id_b64` when present, else `id` as UTF-8 (a lone surrogate is bad input)."""
    encoded = body.get(Fields.ID_B64)
    if encoded is not None:
        if not isinstance(encoded, str):
            raise InvalidCommand("bad_field", "id_b64 is not a string")
        try:
            raw = base64.b64decode(encoded, validate=True)
        except (binascii.Error, ValueError):
            raise InvalidCommand("bad_field", "id_b64 is not base64") from None
        if not raw:
            raise InvalidCommand("bad_field", "id_b64 is empty")
        return raw
    try:
        return readable.encode()
    except UnicodeEncodeError:
        raise InvalidCommand("bad_field", "id is not encodable as UTF-8 (lone surrogate)") from None


def _text(value: str) -> str:
    """Text that can always be encoded again (a lone surrogate becomes an escape)."""
    return value.encode("utf-8", "backslashreplace").decode()
