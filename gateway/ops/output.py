"""How operator commands print: aligned tables or one JSON document, ids and times readable."""

from __future__ import annotations

import base64
import json
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any, Literal

Output = Literal["text", "json"]


def readable(message_id: bytes) -> str:
    """An id as text for people: invalid UTF-8 shown as `\\xNN` escapes."""
    return message_id.decode("utf-8", "backslashreplace")


def id_fields(message_id: bytes) -> dict[str, str]:
    return {"id": readable(message_id), "id_b64": base64.b64encode(message_id).decode()}


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Columns padded to their widest cell, two spaces apart; nothing is cut
    (an owner token must be copied whole into `--token`)."""
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows, strict=True)]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(line, widths, strict=True)).rstrip()
             for line in (header, *rows)]  # fmt: skip
    return "\n".join(lines)


def per_member(members: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """An operator document's per-member list, each entry naming its `member`; and the
    same list under its former names, `instances` of `{"instance": ...}`, kept
    for one release (CHANGELOG.md: they go away in the next)."""
    old = [{"instance": m["member"], **{k: v for k, v in m.items() if k != "member"}}
           for m in members]  # fmt: skip
    return {"members": members, "instances": old}


def print_json(document: dict[str, Any]) -> None:
    print(json.dumps(document, indent=2))


def when_text(epoch_ms: int) -> str:
    return datetime.fromtimestamp(epoch_ms / 1000, UTC).isoformat(timespec="milliseconds")


def ttl_text(ttl_ms: int) -> str:
    if ttl_ms == -2:
        return "absent"
    if ttl_ms == -1:
        return "no TTL"
    return f"{ttl_ms / 1000:.1f}s"
