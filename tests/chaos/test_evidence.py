"""The report's log evidence: what the gateways logged about a record a rule names
(devtools/chaos/runner.py, `log_evidence`)."""

from __future__ import annotations

from devtools.chaos.checker import Violation
from devtools.chaos.runner import log_evidence

G0 = """=== chaos: g0 incarnation 1: run start
2026-11-25 23:57:50,863 INFO gateway.source partitions assigned: ["TopicPartition(topic='r', partition=0)", "TopicPartition(topic='r', partition=2)"]
2026-11-25 23:57:50,879 WARNING gateway.pipeline quarantined r/2/48: not_json: value is not JSON
2026-11-25 23:57:50,880 WARNING gateway.pipeline quarantined r/2/480: not_json: value is not JSON
2026-11-25 23:57:51,000 INFO gateway.source partitions assigned: ["TopicPartition(topic='r', partition=1)"]
"""  # noqa: E501


def test_the_lines_naming_a_violations_record_and_its_partitions_moves_are_kept() -> None:
    missing = Violation("quarantine", "nesting-bomb record raw 2/48 (reason not_json) is not on")
    evidence = log_evidence([missing], "r", {"g0.log": G0, "g1.log": "=== chaos: g1 start\n"})
    assert evidence == [
        "g0.log:1: === chaos: g0 incarnation 1: run start",
        "g0.log:2: " + G0.splitlines()[1],
        "g0.log:3: " + G0.splitlines()[2],  # not r/2/480, nor partition 1's assignment
        "g1.log:1: === chaos: g1 start",
    ]


def test_violations_naming_no_raw_record_bring_no_evidence() -> None:
    assert log_evidence([Violation("exit", "g0 exited 1")], "r", {"g0.log": G0}) == []
