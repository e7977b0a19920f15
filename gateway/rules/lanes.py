"""Priority lanes as pure decisions: which lanes to hold, each lane's clean headers."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from gateway.config import LaneSettings, Settings
from gateway.contract.records import H_LANE, Headers


def plan(
    lanes: Sequence[LaneSettings],
    lag: Mapping[str, int],
    held_since: Mapping[str, float],
    now: float,
) -> tuple[set[str], set[str]]:
    """Which lanes to hold and which to let through as starved (pure).

    A lane is pressed while some lane of higher priority has a lag above its own
    `lag_threshold`. A pressed lane held since `held_since[name]` for at least
    its `max_starve` is starved (let through); any other pressed lane is held.
    """
    pressing = [lane.priority for lane in lanes if lag.get(lane.name, 0) > lane.lag_threshold]
    hold: set[str] = set()
    starved: set[str] = set()
    for lane in lanes:
        if not any(priority > lane.priority for priority in pressing):
            continue
        since = held_since.get(lane.name)
        if since is not None and now - since >= lane.max_starve.total_seconds():
            starved.add(lane.name)
        else:
            hold.add(lane.name)
    return hold, starved


def lane_headers(settings: Settings) -> dict[str, Headers]:
    """Per raw topic, the headers its clean copies gain: `dedup-lane` when there are lanes."""
    if len(settings.lanes) < 2:
        return {topic: [] for topic in settings.kafka.raw_topics}
    return {t: [(H_LANE, lane.name.encode())] for lane in settings.lanes for t in lane.raw_topics}
