"""Offset planning of the Python Kafka source: pure functions, no broker."""

from __future__ import annotations

import pytest

from tests.integration.spark.session import PYTHON_SOURCE, skip_module_without_python_source

skip_module_without_python_source()

from spark_sink.kafka_source import (  # noqa: E402 (needs PySpark 4.2)
    fair_shares,
    offsets_from_json,
    offsets_to_json,
    plan_end,
    plan_ranges,
)

pytestmark = list(PYTHON_SOURCE)


def test_offsets_round_trip_through_spark_json_form():
    offsets = {"clean": {0: 5, 10: 7}, "other": {}}
    assert offsets_to_json(offsets) == {"clean": {"0": 5, "10": 7}, "other": {}}
    assert offsets_from_json(offsets_to_json(offsets)) == offsets


def test_budget_is_shared_fairly_and_short_partitions_leave_room_for_others():
    shares = fair_shares({("t", 0): 100, ("t", 1): 2, ("t", 2): 100, ("t", 3): 0}, 50)
    assert sum(shares.values()) == 50
    assert shares[("t", 1)] == 2 and shares[("t", 3)] == 0
    assert abs(shares[("t", 0)] - shares[("t", 2)]) <= 1


@pytest.mark.parametrize("budget", [1, 2, 3, 7, 1000])
def test_budget_never_exceeded_and_progress_always_made(budget):
    available = {("t", p): n for p, n in enumerate([5, 0, 3, 9])}
    shares = fair_shares(available, budget)
    assert sum(shares.values()) == min(budget, sum(available.values()))
    assert all(0 <= shares[k] <= available[k] for k in available)


def test_end_is_capped_by_max_records_and_never_moves_backwards():
    start = {"t": {0: 10, 1: 50}}
    latest = {"t": {0: 30, 1: 40}}  # partition 1 reports less than we already read
    assert plan_end(start, latest, None) == {"t": {0: 30, 1: 50}}
    assert plan_end(start, latest, 5) == {"t": {0: 15, 1: 50}}


def test_new_partition_is_read_from_its_beginning():
    """A partition added while the query runs is not in `start`: it starts at 0."""
    start = {"t": {0: 10}}
    latest = {"t": {0: 10, 1: 4}}
    end = plan_end(start, latest, None)
    assert end == {"t": {0: 10, 1: 4}}
    assert plan_ranges(start, end) == [("t", 1, 0, 4)]


def test_available_now_target_caps_ends_and_hides_later_partitions():
    start = {"t": {0: 0}}
    target = {"t": {0: 8}}
    latest = {"t": {0: 20, 1: 5}}
    assert plan_end(start, latest, None, target) == {"t": {0: 8}}
    assert plan_end({"t": {0: 8}}, latest, None, target) == {"t": {0: 8}}


def test_ranges_skip_partitions_without_new_offsets():
    assert plan_ranges({"t": {0: 3, 1: 4}}, {"t": {0: 3, 1: 9}}) == [("t", 1, 4, 9)]
    assert plan_ranges({}, {}) == []
