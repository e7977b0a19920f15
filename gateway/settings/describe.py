"""How a bad setting is said: one phrase per problem, naming the setting and the
environment variable it came from (`describe`, `env_not_json`)."""

from __future__ import annotations

import difflib
import json
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any, get_args, get_origin

from pydantic import (
    BaseModel,
    ValidationError,
)
from pydantic_settings import (
    SettingsError,
)

from gateway.masking import masked_text
from gateway.settings.values import ENV_NESTED_DELIMITER, ENV_PREFIX, env_name

Loc = tuple[int | str, ...]


def describe(
    exc: ValidationError, cls: type[BaseModel], overrides: Mapping[str, Any] | None = None
) -> str:
    """One phrase per problem, `; `-joined on one line: `invalid setting redis.nodes: needs an
    odd number of members ...`, `unknown key `bootstrap_server` in [kafka]; did you mean
    `bootstrap_servers`?`, each naming the environment variable the value came from."""
    lines = []
    for error in exc.errors():
        loc = tuple(error["loc"])
        variable = _env_origin(loc, overrides or {})
        origin = f" (environment variable {variable})" if variable else ""
        if error["type"] == "extra_forbidden" and loc:
            lines.append(_unknown(cls, loc, error["input"], origin))
            continue
        where = ".".join(str(part) for part in loc)
        # A validator's message may quote a URL: shown masked (gateway/masking.py).
        message = masked_text(error["msg"].removeprefix("Value error, "))
        # A rule across sections has no one location; its message names the settings.
        lines.append(
            f"invalid setting {where}{origin}: {message}" if where else f"invalid: {message}"
        )
    return "; ".join(lines)


def _unknown(cls: type[BaseModel], loc: Loc, value: Any, origin: str) -> str:
    """`unknown key `bootstrap_server` in [kafka]; did you mean `bootstrap_servers`?`"""
    *parent, key = loc
    model = _model_at(cls, parent)
    known = [] if model is None else _keys(model)
    close = difflib.get_close_matches(str(key), known, n=1, cutoff=0.6)
    if not parent:
        kind = "section" if isinstance(value, dict) else "top-level key"
        text = f"unknown {kind} [{key}]" if kind == "section" else f"unknown {kind} `{key}`"
        return text + origin + (f"; did you mean [{close[0]}]?" if close else "")
    return f"unknown key `{key}` in {_table(parent)}{origin}" + (
        f"; did you mean `{close[0]}`?" if close else ""
    )


def _table(parent: Sequence[int | str]) -> str:
    """How the TOML names a table: `[kafka]`, `[kafka.client]`, `[[lanes]] #2`."""
    names = [str(part) for part in parent if not isinstance(part, int)]
    items = [part for part in parent if isinstance(part, int)]
    if items:
        return f"[[{'.'.join(names)}]] #{items[-1] + 1}"
    return f"[{'.'.join(names)}]"


def _keys(model: type[BaseModel]) -> list[str]:
    """Every key a section takes: field names and their aliases."""
    return sorted(
        {name for name in model.model_fields}
        | {f.alias for f in model.model_fields.values() if f.alias}
    )


def _field_annotation(model: type[BaseModel], key: str) -> Any:
    for name, field in model.model_fields.items():
        if key in (name, field.alias):
            return field.annotation
    return None


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The settings model an annotation holds: itself, or the item of a list or optional."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in get_args(annotation):
        found = _model_in(arg)
        if found is not None:
            return found
    return None


def _model_at(cls: type[BaseModel], path: Sequence[int | str]) -> type[BaseModel] | None:
    """The section model at `path` (list indices skipped), or None (a free-form table)."""
    model: type[BaseModel] | None = cls
    for part in path:
        if isinstance(part, int):
            continue
        if model is None:
            return None
        model = _model_in(_field_annotation(model, part))
    return model


def _holds(data: Any, path: Sequence[int | str]) -> bool:
    """Whether `path` (keys and list indices) leads somewhere in `data`."""
    for part in path:
        in_list = isinstance(part, int) and isinstance(data, list) and 0 <= part < len(data)
        if not (in_list or (isinstance(data, dict) and part in data)):
            return False
        data = data[part]
    return True


def _environment() -> dict[str, str]:
    """Lower-cased name -> name, for the variables with the prefix (matched without case,
    as pydantic-settings does)."""
    return {name.lower(): name for name in os.environ if name.upper().startswith(ENV_PREFIX)}


def _env_origin(loc: Loc, overrides: Mapping[str, Any]) -> str | None:
    """The environment variable the value at `loc` came from, or None (file or default).

    `GATEWAY_REDIS__TTL` for `redis.ttl`; for a deeper location, a variable holding JSON
    for a table or list above it (`GATEWAY_REDIS__NODES` for `redis.nodes.0`) when the
    JSON has that location. Overrides given to `load` win over the environment."""
    if _holds(overrides, loc):
        return None
    environment = _environment()
    for end in range(len(loc), 0, -1):
        head = loc[:end]
        if any(isinstance(part, int) for part in head):
            continue
        variable = environment.get(env_name(*(str(part) for part in head)).lower())
        if variable is None:
            continue
        if end == len(loc):
            return variable
        try:
            value = json.loads(os.environ[variable])
        except ValueError:
            return None
        return variable if _holds(value, loc[end:]) else None
    return None


def _takes_json(annotation: Any) -> bool:
    """Whether pydantic-settings reads this field's environment variable as JSON."""
    if _model_in(annotation) is not None:
        return True
    if get_origin(annotation) in (list, dict, set, tuple):
        return True
    return any(_takes_json(arg) for arg in get_args(annotation) if arg is not type(None))


def env_not_json(exc: SettingsError, cls: type[BaseModel]) -> str:
    """Which variable is not the JSON its field takes (never its value: it may be secret)."""
    field = re.search(r'field "(\w+)"', str(exc))
    if field is None:
        return str(exc)
    prefix = env_name(field[1]).lower()
    culprits = []
    for lowered, variable in sorted(_environment().items()):
        if lowered != prefix and not lowered.startswith(prefix + ENV_NESTED_DELIMITER.lower()):
            continue
        path = lowered.removeprefix(ENV_PREFIX.lower()).split(ENV_NESTED_DELIMITER.lower())
        *parent, key = path
        model = _model_at(cls, parent)
        annotation = None if model is None else _field_annotation(model, key)
        if annotation is None or not _takes_json(annotation):
            continue
        try:
            json.loads(os.environ[variable])
        except ValueError as not_json:
            culprits.append(
                f"environment variable {variable} must be JSON for {'.'.join(path)} "
                f"(a list or table): {not_json}"
            )
    return "; ".join(culprits) or str(exc)
