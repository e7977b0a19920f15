"""Priority lanes, the pure parts: which lanes are held or let through, the `[[lanes]]`
settings, the lane header and clean topic of each partition's clean copies."""

from __future__ import annotations

import pytest
from aiokafka import ConsumerRecord, TopicPartition
from hypothesis import given
from hypothesis import strategies as st

from gateway.config import ConfigError, LaneSettings, load_settings
from gateway.contract.records import H_LANE
from gateway.rules.classify import PartitionBatch, classify
from gateway.rules.lanes import lane_headers, plan
from gateway.rules.vote import Outcome


def lane(name: str, priority: int, threshold: int = 10, starve: str = "30s") -> LaneSettings:
    return LaneSettings(
        name=name, raw_topics=[name], priority=priority, lag_threshold=threshold,
        max_starve=starve,
    )  # fmt: skip


LANES = [lane("urgent", 20), lane("normal", 10), lane("bulk", 0)]


def test_a_lane_is_held_while_a_higher_lane_has_lag_above_its_threshold():
    assert plan(LANES, {"urgent": 11, "normal": 500, "bulk": 500}, {}, 0.0) == (
        {"normal", "bulk"}, set(),
    )  # fmt: skip
    assert plan(LANES, {"urgent": 10, "normal": 11, "bulk": 500}, {}, 0.0) == ({"bulk"}, set())
    assert plan(LANES, {"urgent": 10, "normal": 10, "bulk": 10**6}, {}, 0.0) == (set(), set())


def test_a_lane_held_for_max_starve_is_let_through_and_the_others_stay_held():
    lag = {"urgent": 1000}
    held_since = {"normal": 100.0, "bulk": 100.0}
    assert plan(LANES, lag, held_since, 129.9) == ({"normal", "bulk"}, set())
    assert plan(LANES, lag, held_since, 130.0) == (set(), {"normal", "bulk"})
    assert plan(LANES, lag, {"normal": 120.0, "bulk": 100.0}, 130.0) == ({"normal"}, {"bulk"})


lanes_st = st.lists(
    st.tuples(st.integers(0, 3), st.integers(0, 5), st.integers(0, 10)), min_size=1, max_size=5
)


@given(lanes_st, st.floats(0, 100))
def test_only_a_lane_below_a_pressing_lane_is_held_and_the_top_lane_never_is(spec, now):
    lanes = [lane(f"l{i}", priority, threshold) for i, (priority, threshold, _) in enumerate(spec)]
    lag = {f"l{i}": lag for i, (_, _, lag) in enumerate(spec)}
    hold, starved = plan(lanes, lag, dict.fromkeys(lag, 50.0), now)
    assert not hold & starved
    top = max(lane.priority for lane in lanes)
    for x in lanes:
        pressed = any(y.priority > x.priority and lag[y.name] > y.lag_threshold for y in lanes)
        assert (x.name in hold | starved) == pressed
        assert x.priority < top or x.name not in hold | starved


def test_without_lanes_the_raw_topics_are_one_lane_and_gain_no_header():
    settings = load_settings(kafka={"raw_topics": ["a", "b"]})
    assert [(x.name, x.raw_topics) for x in settings.lanes] == [("default", ["a", "b"])]
    assert lane_headers(settings) == {"a": [], "b": []}
    assert settings.clean_topic_of("a") == "clean"


def test_lanes_name_the_raw_topics_their_header_and_clean_topic():
    settings = load_settings(
        kafka={"clean_topic": "c"},
        lanes=[
            {"name": "hi", "raw_topics": ["x"], "priority": 1, "clean_topic": "c-hi"},
            {"name": "lo", "raw_topics": ["y", "z"]},
        ],
    )
    assert settings.kafka.raw_topics == ["x", "y", "z"]
    assert lane_headers(settings)["z"] == [(H_LANE, b"lo")]
    assert [settings.clean_topic_of(t) for t in ("x", "y")] == ["c-hi", "c"]


@pytest.mark.parametrize(
    ("sections", "named"),
    [
        ({"kafka": {"raw_topics": ["x"]}, "lanes": [{"name": "a", "raw_topics": ["y"]}]},
         "not both"),
        ({"lanes": [{"name": "a", "raw_topics": ["x"]}, {"name": "a", "raw_topics": ["y"]}]},
         "own name"),
        ({"lanes": [{"name": "a", "raw_topics": ["x"]}, {"name": "b", "raw_topics": ["x"]}]},
         "one lane only"),
        ({"delay": {"enabled": True},
          "lanes": [{"name": "a", "raw_topics": ["x"], "clean_topic": "c2"}]},
         "delay.enabled"),
        ({"lanes": [{"name": "a b", "raw_topics": ["x"]}]}, "lanes.0.name"),
        ({"lanes": [{"name": "a", "raw_topics": []}]}, "lanes.0.raw_topics"),
    ],
)  # fmt: skip
def test_bad_lanes_stop_start_up_naming_the_problem(sections, named):
    with pytest.raises(ConfigError, match=named):
        load_settings(**sections)


def test_classify_gives_a_partition_its_lane_header_and_clean_topic():
    tp = TopicPartition("x", 0)
    rec = ConsumerRecord("x", 0, 5, 1, 0, None, b"v", None, 0, 1, ())
    part = PartitionBatch([rec], [b"id"], ["7"], 0, [Outcome.FORWARD],
                          extra=[(H_LANE, b"hi")], to="c-hi")  # fmt: skip
    decided = classify({tp: part}, "block")
    assert decided.forward == []
    ((_, _, _, headers, _),) = decided.forward_to["c-hi"]
    assert headers[-1] == (H_LANE, b"hi")
