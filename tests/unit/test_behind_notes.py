"""Which members other gateway runs noted as behind (gateway/quorum/behind.py)."""

from __future__ import annotations

from gateway.quorum.behind import Noted, noted_by_others

LIFE, STALE = 10_000, 300


def test_only_live_notes_of_other_runs_count() -> None:
    notes = [
        b"127.0.0.1:7002/0|run-a", b"2000",  # another run, live
        b"127.0.0.1:7002/0|mine", b"2000",  # this run's own: its fills go out first
        b"127.0.0.1:7001/0|run-b", b"999",  # expired
        b"cluster:10.0.0.1:7000|run-c", b"1500",
        b"127.0.0.1:7003/0|run-d", b"not-a-time",
    ]  # fmt: skip
    written = [b"127.0.0.1:7002/0|run-a", b"900:300", b"cluster:10.0.0.1:7000|run-c", b"500:300"]
    assert noted_by_others(notes, written, 1000, "mine", LIFE, STALE) == {
        "127.0.0.1:7002/0": [Noted("run-a", 900, stale=False)],
        "cluster:10.0.0.1:7000": [Noted("run-c", 500, stale=True)],  # not written for 500 ms
    }
    assert noted_by_others([], [], 1000, "mine", LIFE, STALE) == {}


def test_a_note_without_its_written_time_was_written_a_life_before_it_ends() -> None:
    """An older gateway's note: no `behind-at` field."""
    notes = [b"127.0.0.1:7002/0|old", b"10900"]
    assert noted_by_others(notes, [], 1000, "mine", LIFE, STALE) == {
        "127.0.0.1:7002/0": [Noted("old", 900, stale=False)],
    }
    assert noted_by_others(notes, [], 1300, "mine", LIFE, STALE) == {
        "127.0.0.1:7002/0": [Noted("old", 900, stale=True)],
    }
