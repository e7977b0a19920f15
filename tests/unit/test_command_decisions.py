"""How the failure loop reads the members' HANDOVER and RELEASE replies
(gateway/failures.py)."""

from __future__ import annotations

import pytest

from gateway.failures import handover_decision, release_decision


@pytest.mark.parametrize(
    ("answers", "majority", "decision"),
    [
        ([1, 1, 1], 2, "act"),  # handed over now
        ([2, 2], 2, "act"),  # a replay whose effect is not done: redo it
        ([1, 2, 0], 2, "act"),
        ([3, 3, 1], 2, "skip"),  # another copy of the command handed it over
        ([0, 0], 2, "skip"),  # stale
        ([2, 4], 2, "skip"),  # done on one member: its note is written after the ack
        ([2, 2, 4], 2, "skip"),
        ([1, 3], 2, "wait"),  # one each way, no third answer counted
        ([1], 2, "wait"),
        ([], 2, "wait"),
    ],
)
def test_a_done_note_settles_a_command_and_otherwise_a_majority_decides(
    answers: list[int], majority: int, decision: str
) -> None:
    assert handover_decision(answers, majority) == decision


@pytest.mark.parametrize(
    ("answers", "majority", "decision"),
    [
        ([1, 1, 1], 2, "released"),
        ([1, 2, 0], 2, "released"),  # released now on one, before (a redo) on another
        ([2, 2, 2], 2, "repeated"),  # every counted member had released it: a repeat
        ([2, 2, 0], 2, "repeated"),
        ([0, 0, 1], 2, "stale"),  # the id is held by another token on a majority
        ([0, 0], 2, "stale"),
        ([1, 0], 2, "wait"),  # one each way, no third answer counted
        ([2], 2, "wait"),
        ([], 2, "wait"),
        ([1, 1, 0, 0, 0], 3, "stale"),
        ([1, 2, 2, 0, 0], 3, "released"),
        ([1, 3], 2, "released"),  # the other member has no live mark: free there too
        ([2, 3], 2, "repeated"),
        ([1, 0, 3], 2, "released"),
        ([3, 3], 2, "stale"),  # no member holds it (expired): nothing to release
        ([0, 3], 2, "stale"),
        ([3], 2, "wait"),
    ],
)
def test_a_release_is_decided_by_a_majority_and_a_repeat_is_told_apart(
    answers: list[int], majority: int, decision: str
) -> None:
    assert release_decision(answers, majority) == decision
