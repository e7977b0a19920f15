"""The chaos harness's progress gate (devtools/chaos/runner.py, `progressed`)."""

from __future__ import annotations

from devtools.chaos.runner import progressed


def test_commits_of_batches_decided_before_the_fault_are_not_progress() -> None:
    """Seed 9101: right after a fault the gateway committed what it had decided before
    it; read as progress, the next fault landed on a state that never moved."""
    produced_before_the_fault = {0: 10, 1: 10}
    committed_since = {0: 10, 1: 9}  # the batches in flight at the fault, committed
    assert not progressed(committed_since, produced_before_the_fault)
    assert progressed({0: 11, 1: 9}, produced_before_the_fault)  # a record from after it


def test_before_the_first_fault_any_commit_is_progress() -> None:
    assert not progressed({0: 0, 1: 0}, {})
    assert progressed({0: 0, 1: 1}, {})
