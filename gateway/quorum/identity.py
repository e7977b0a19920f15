"""Members that are one `redis-server`: a majority vote needs independent servers.

Three URLs naming three databases of one server (`redis://h:6379/0`, `/1`, `/2`)
pass every other check, and the gateway would count one machine three times: it
failing would lose every vote at once. A server names itself by `run_id` (INFO
server), which changes at each restart and differs between servers, so two
members answering with the same one are the same process. Refused by
`check-config --connect` and at start-up (`Quorum.wait_for_majority`).
"""

from __future__ import annotations

from collections.abc import Mapping


def shared(run_ids: Mapping[str, str | None]) -> list[list[str]]:
    """The members (by name) that answered with one run_id, each set of two or more."""
    by: dict[str, list[str]] = {}
    for name, run_id in run_ids.items():
        if run_id:
            by.setdefault(run_id, []).append(name)
    return [names for names in by.values() if len(names) > 1]


def describe(groups: list[list[str]]) -> str:
    """`redis.nodes: a, b are one redis-server (...)` for the error line."""
    return "; ".join(
        f"redis.nodes: {', '.join(names)} are one redis-server (the same run_id): a "
        "majority vote needs independent servers, one failing would take them all"
        for names in groups
    )


def run_id_of(info: object) -> str | None:
    """The run_id of an INFO server reply (a dict from redis-py)."""
    if isinstance(info, dict):
        value = info.get("run_id")
        return str(value) if value else None
    return None
