"""What to say about a topic the settings name and the broker does not have: the
nearest existing name (a typo is the usual cause) and the command that creates it.
Shared by /readyz's topic watch (gateway/service/topic_watch.py) and
`check-config --connect` (gateway/ops/check_kafka.py)."""

from __future__ import annotations

import difflib
from collections.abc import Collection
from pathlib import Path


def did_you_mean(name: str, existing: Collection[str]) -> str:
    """ " (did you mean 'orders'?)" for the nearest existing topic name, or ""."""
    candidates = [other for other in existing if not other.startswith("__")]
    near = difflib.get_close_matches(name, candidates, n=1, cutoff=0.6)
    return f" (did you mean {near[0]!r}?)" if near else ""


def create_hint(config: Path | str | None) -> str:
    where = str(config) if config is not None else "FILE"
    return f"create it: dedup-gateway topics --create --config {where}"


def missing_line(missing: dict[str, str], existing: Collection[str], config: Path | None) -> str:
    """One line: each missing topic (name -> role) and the nearest existing name, then
    the command that creates them."""
    parts = [f"{role} topic {name!r} does not exist{did_you_mean(name, existing)}"
             for name, role in missing.items()]  # fmt: skip
    return f"{'; '.join(parts)}: {create_hint(config)}"
