"""What every section's values are made of: the environment variables' names, durations
(`parse_duration`, `format_duration`, the `Duration` type) and the `Section` base."""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    PlainSerializer,
    WithJsonSchema,
)

ENV_PREFIX = "GATEWAY_"
ENV_NESTED_DELIMITER = "__"  # GATEWAY_<SECTION>__<KEY>
CONFIG_ENV = "GATEWAY_CONFIG"  # the config file, when --config is not given


_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)")
_DURATION = re.compile(rf"^\s*(?:{_DURATION_PART.pattern}\s*)+$")
_UNIT_SECONDS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(value: Any) -> timedelta:
    """`"24h"`, `"500ms"`, `"1h30m"`, `"7d"`, a number of seconds, or a timedelta."""
    if isinstance(value, timedelta):
        return value
    if isinstance(value, int | float) and not isinstance(value, bool):
        return timedelta(seconds=value)
    if isinstance(value, str) and _DURATION.match(value):
        return sum(
            (timedelta(seconds=float(n) * _UNIT_SECONDS[unit])
             for n, unit in _DURATION_PART.findall(value)),
            timedelta(),
        )  # fmt: skip
    raise ValueError(f"expected a duration like '24h', '1h30m', '500ms' or '30s', got {value!r}")


def format_duration(value: timedelta) -> str | float:
    """The duration as `parse_duration` reads it back: `"1h30m"`, `"100ms"`, `"0s"`
    (a negative one as a number of seconds, which no unit spells)."""
    if value < timedelta(0):
        return value.total_seconds()
    micros = value // timedelta(microseconds=1)
    parts = []
    for unit, size in (("d", 86_400_000_000), ("h", 3_600_000_000), ("m", 60_000_000),
                       ("s", 1_000_000)):  # fmt: skip
        count, micros = divmod(micros, size)
        if count:
            parts.append(f"{count}{unit}")
    if micros:
        ms = f"{micros / 1000:.3f}".rstrip("0").rstrip(".")
        parts.append(f"{ms}ms")
    return "".join(parts) or "0s"


# Written out (`check-config`, JSON dumps) as `format_duration` spells it, so it loads back;
# in the JSON Schema (`config-schema`) as the text or number `parse_duration` reads.
Duration = Annotated[
    timedelta,
    BeforeValidator(parse_duration),
    PlainSerializer(format_duration, return_type=str | float, when_used="json"),
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "string", "pattern": _DURATION.pattern},
                {"type": "number", "description": "seconds"},
            ],
            "description": "a duration: '500ms', '30s', '1h30m', '7d', or a number of seconds",
        }
    ),
]


class Section(BaseModel):
    """A table of the settings file: an unknown key in it is an error."""

    model_config = ConfigDict(extra="forbid")


def env_name(*where: str) -> str:
    """The environment variable that overrides a setting: `env_name("kafka", "group_id")`
    is `GATEWAY_KAFKA__GROUP_ID`."""
    return ENV_PREFIX + ENV_NESTED_DELIMITER.join(part.upper() for part in where)
