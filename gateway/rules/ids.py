"""Extract the message id of a raw record, by the configured strategy.

Strategies (`[dedup] id`):
- `header:NAME`: the value of header NAME (default `header:message-id`);
- `key`: the record key;
- `json:a.b.c`: the field at that dotted path of a JSON object value
  (strings are used as they are; numbers and booleans by their JSON text),
  plain or in Confluent's wire format (magic byte 0, 4-byte schema id, JSON:
  what Schema Registry's JSON Schema serializer writes; the schema is not read);
- `hash`: BLAKE2b-128 of the value bytes (identical payloads are duplicates).
A record whose id cannot be extracted raises `BadRecord` with the reason; the
pipeline sends it to the quarantine topic. Whatever the bytes (hostile JSON
nested deeper than the stack, a JSON string with a lone surrogate), an
extractor returns the id's bytes or raises `BadRecord`, nothing else
(tests/property/test_ids.py).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from hashlib import blake2b
from typing import Any, Protocol

from gateway.contract.records import CLEAN_HEADERS_BOUND, record_size
from gateway.errors import BadRecord


class RawRecord(Protocol):
    @property
    def key(self) -> bytes | None: ...
    @property
    def value(self) -> bytes | None: ...
    @property
    def headers(self) -> Sequence[tuple[str, bytes]]: ...


IdExtractor = Callable[[RawRecord], bytes]


def build_extractor(spec: str, max_bytes: int, max_record_bytes: int | None = None) -> IdExtractor:
    """The extractor for a validated `[dedup] id` spec.

    With `max_record_bytes` (the broker's limit), a record whose clean copy could
    outgrow it is bad input (`too_large`), judged before it claims a mark: a
    later, smaller copy of the same id is then new.
    """
    kind, _, arg = spec.partition(":")
    raw: IdExtractor
    if kind == "header":
        raw = _header(arg)
    elif kind == "key":
        raw = _key
    elif kind == "json":
        raw = _json_path(arg.split("."))
    elif kind == "hash":
        raw = _content_hash
    else:
        raise ValueError(f"unknown id strategy {spec!r}")

    def extract(record: RawRecord) -> bytes:
        message_id = raw(record)
        if not message_id:
            raise BadRecord("empty_id", f"id from {spec} is empty")
        if len(message_id) > max_bytes:
            raise BadRecord("oversize_id", f"id is {len(message_id)} bytes, limit {max_bytes}")
        if max_record_bytes is not None:
            size = record_size(record.key, record.value, record.headers)
            size += len(message_id) + CLEAN_HEADERS_BOUND
            if size > max_record_bytes:
                raise BadRecord(
                    "too_large",
                    f"the clean copy would be up to {size} bytes, limit {max_record_bytes}",
                )
        return message_id

    return extract


def _header(name: str) -> IdExtractor:
    def extract(record: RawRecord) -> bytes:
        for key, value in record.headers:
            if key == name:
                return value or b""
        raise BadRecord("missing_header", f"no header {name!r}")

    return extract


def _key(record: RawRecord) -> bytes:
    if record.key is None:
        raise BadRecord("missing_key", "record has no key")
    return record.key


def _json_path(path: list[str]) -> IdExtractor:
    dotted = ".".join(path)

    def extract(record: RawRecord) -> bytes:
        if record.value is None:
            raise BadRecord("not_json", "record has no value")
        value = unframed(record.value)
        try:
            node: Any = json.loads(value)
        except (ValueError, UnicodeDecodeError, RecursionError) as exc:
            # RecursionError: nesting deeper than the interpreter's stack (hostile input).
            raise BadRecord(
                "not_json", f"value is not JSON ({type(exc).__name__}: {exc})"[:300]
            ) from None
        for part in path:
            if not isinstance(node, dict) or part not in node:
                raise BadRecord("missing_field", f"no field {dotted!r} in the JSON value")
            node = node[part]
        if isinstance(node, str):
            try:
                return node.encode()
            except UnicodeEncodeError:  # a lone surrogate ("\\ud800") is valid JSON, not text
                raise BadRecord("bad_id", f"field {dotted!r} is not valid Unicode") from None
        if node is None or isinstance(node, dict | list):
            raise BadRecord("missing_field", f"field {dotted!r} is not a scalar")
        return json.dumps(node).encode()

    return extract


# Confluent's wire format (Schema Registry serializers, JSON Schema included): a zero
# magic byte, a 4-byte big-endian schema id, then the payload. No JSON text starts
# with a zero byte, so a framed value is told from a plain one by its first byte.
CONFLUENT_MAGIC = 0
CONFLUENT_HEADER_BYTES = 5


def unframed(value: bytes) -> bytes:
    """The JSON payload of a Confluent-framed value; any other value as it is."""
    if len(value) >= CONFLUENT_HEADER_BYTES and value[0] == CONFLUENT_MAGIC:
        return value[CONFLUENT_HEADER_BYTES:]
    return value


def _content_hash(record: RawRecord) -> bytes:
    if record.value is None:
        raise BadRecord("empty_id", "record has no value to hash")
    return blake2b(record.value, digest_size=16).hexdigest().encode()
