"""Which members other gateway runs noted as behind (gateway/quorum/behind.py)."""

from __future__ import annotations

from gateway.quorum.behind import noted_by_others


def test_only_live_notes_of_other_runs_count() -> None:
    notes = [
        b"127.0.0.1:7002/0|run-a", b"2000",  # another run, live
        b"127.0.0.1:7002/0|mine", b"2000",  # this run's own: its fills go out first
        b"127.0.0.1:7001/0|run-b", b"999",  # expired
        b"cluster:10.0.0.1:7000|run-c", b"1500",
        b"127.0.0.1:7003/0|run-d", b"not-a-time",
    ]  # fmt: skip
    assert noted_by_others(notes, 1000, "mine") == {
        "127.0.0.1:7002/0": {"run-a"},
        "cluster:10.0.0.1:7000": {"run-c"},
    }
    assert noted_by_others([], 1000, "mine") == {}
