"""Settings written back as TOML that `load_settings` reads again (`check-config`).

Values come from `config.effective` (durations already spelled `1h30m`), so this
only has to write TOML: tables as `[section]`, lists of tables as `[[name]]`,
unset values as comments.
"""

from __future__ import annotations

import json
import re
from typing import Any

_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


def to_toml(data: dict[str, Any], section: str = "") -> str:
    """`data` as TOML; `section` is the dotted name of the table it sits in."""
    lines: list[str] = []
    tables = {k: v for k, v in data.items() if isinstance(v, dict)}
    arrays = {k: v for k, v in data.items() if _table_list(v)}
    for key, value in data.items():
        if key in tables or key in arrays:
            continue
        lines.append(f"# {key} is not set" if value is None else f"{_key(key)} = {_value(value)}")
    for key, value in tables.items():
        name = f"{section}.{_key(key)}" if section else _key(key)
        body = to_toml(value, name)
        lines += ["", f"[{name}]", *([body] if body else [])]
    for key, items in arrays.items():
        name = f"{section}.{_key(key)}" if section else _key(key)
        for item in items:
            lines += ["", f"[[{name}]]", to_toml(item, name)]
    return "\n".join(lines).strip("\n")


def _table_list(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(v, dict) for v in value)


def _key(key: str) -> str:
    return key if _BARE_KEY.match(key) else json.dumps(key, ensure_ascii=False)


def _value(value: Any) -> str:
    """A TOML value. JSON's strings, numbers, booleans and arrays are TOML's too
    (with ensure_ascii off: TOML's `\\u` escapes take no surrogate halves)."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_key(k)} = {_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    return json.dumps(value, ensure_ascii=False)
