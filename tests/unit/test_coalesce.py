"""Coalescing windows, the pure parts: versions order like (timestamp, coordinates), the
close decision over the instances' answers (grace, state gone), late updates, window
stamps bounded by the gateway's clock, window shapes and the `[coalesce]` settings."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.config import ConfigError, load_settings
from gateway.rules.windows import (
    ASK_AGAIN_MS,
    Verdict,
    WindowShape,
    agreed_start,
    at_close,
    late_by,
    parse_window,
    source_of,
    version,
    window_stamp,
)

FIXED = WindowShape("fixed", 3000, 30_000)
TRAILING = WindowShape("trailing", 3000, 10_000)

coords = st.tuples(
    st.integers(0, 2**41), st.sampled_from(["a", "b", "t.x"]), st.integers(0, 500),
    st.integers(0, 2**40),
)  # fmt: skip


@given(coords, coords)
def test_versions_compare_as_their_timestamps_then_their_coordinates(a, b):
    va, vb = version(*a), version(*b)
    assert len(va) == len(vb) and va.isdigit()
    if a[0] != b[0]:
        assert (va < vb) == (a[0] < b[0])
    elif a == b:
        assert va == vb
    else:
        assert va != vb  # a fixed order for ties


def test_fixed_windows_close_at_their_end_and_trailing_ones_after_the_newest_update():
    assert FIXED.close(6000, 8999) == 9000
    assert TRAILING.close(6000, 7000) == 10_000  # newest + window
    assert TRAILING.close(6000, 15_000) == 16_000  # capped at start + max_window


MINE = version(7000, "raw", 0, 5)
OLDER = version(6500, "raw", 1, 9)
NEWER = version(7500, "raw", 1, 2)


def test_a_newer_version_anywhere_drops_the_record_even_without_a_majority():
    answers = [(NEWER, 4, 7500), None, None]
    assert at_close(MINE, 6000, answers, 2, FIXED, 10_000).verdict is Verdict.DROP


def test_the_newest_version_emits_once_its_window_has_closed():
    answers = [(MINE, 3, 7000), (OLDER, 2, 6500), None]  # one missed the last update
    closing = at_close(MINE, 6000, answers, 2, FIXED, 9000)
    assert (closing.verdict, closing.close_ms, closing.updates) == (Verdict.EMIT, 9000, 3)
    assert at_close(MINE, 6000, answers, 2, FIXED, 8999).verdict is Verdict.WAIT


def test_a_window_closes_grace_after_its_end_and_emits_the_newest_then():
    answers = [(MINE, 3, 7000), (MINE, 3, 7000), None]
    waiting = at_close(MINE, 6000, answers, 2, FIXED, 9500, grace_ms=1000)
    assert (waiting.verdict, waiting.close_ms) == (Verdict.WAIT, 10_000)  # end 9000 + grace
    closing = at_close(MINE, 6000, answers, 2, FIXED, 10_000, grace_ms=1000)
    assert (closing.verdict, closing.close_ms, closing.closed_ms) == (Verdict.EMIT, 9000, 10_000)
    # An update stamped in the window's last millisecond, taken within grace, is merged.
    last = version(8999, "raw", 1, 3)
    merged = at_close(MINE, 6000, [(last, 4, 8999), (last, 4, 8999), None], 2, FIXED, 10_000,
                      grace_ms=1000)  # fmt: skip
    assert merged.verdict is Verdict.DROP


def test_trailing_windows_close_grace_after_a_window_past_their_newest_update():
    answers = [(MINE, 2, 9000)] * 3
    closing = at_close(MINE, 6000, answers, 2, TRAILING, 12_100, grace_ms=500)
    assert (closing.verdict, closing.close_ms) == (Verdict.WAIT, 12_500)
    assert at_close(MINE, 6000, answers, 2, TRAILING, 12_500, grace_ms=500).verdict is Verdict.EMIT


@pytest.mark.parametrize(
    "answers",
    [
        [("", 0, 0), ("", 0, 0), None],  # the state expired on every member
        [(OLDER, 1, 6500), ("", 0, 0), ("", 0, 0)],  # re-opened by a late older update
    ],
)
def test_a_close_that_finds_no_member_holding_its_version_is_lost_never_emitted(answers):
    # Its update reached a majority before it waited: a state without its version (or a
    # newer one) is not the one it wrote, and a newer version may have been sent already.
    assert at_close(MINE, 6000, answers, 2, FIXED, 20_000, grace_ms=1000).verdict is Verdict.LOST
    assert at_close(MINE, 6000, answers, 2, FIXED, 20_000).verdict is Verdict.LOST


def test_an_update_taken_after_its_windows_end_plus_grace_is_late_by_the_excess():
    # fixed: the window [6000, 9000) closes at 10_000 with a grace of 1000
    assert late_by(FIXED, 6000, 0, 10_000, 1000) == 0
    assert late_by(FIXED, 6000, 8500, 10_250, 1000) == 250
    # trailing: as the window stood before the update (newest 7000: closes 10_000 + 500)
    assert late_by(TRAILING, 6000, 7000, 10_400, 500) < 0
    assert late_by(TRAILING, 6000, 7000, 10_700, 500) == 200
    # an update that opened its trailing window is late by its own window's close
    assert late_by(TRAILING, 6000, 0, 9700, 500) == 200


@given(st.integers(0, 2**41), st.integers(0, 2**41), st.integers(0, 10**8))
def test_a_window_stamp_is_never_further_ahead_of_the_clock_than_allowed(ts, now, ahead):
    stamp = window_stamp(ts, now, ahead)
    assert stamp - now <= ahead
    assert stamp == (ts if ts - now <= ahead else now)


def test_fewer_than_a_majority_answering_is_asked_again_later():
    closing = at_close(MINE, 6000, [(MINE, 1, 7000), None, None], 2, FIXED, 9500)
    assert (closing.verdict, closing.close_ms) == (Verdict.ASK_AGAIN, 9500 + ASK_AGAIN_MS)


def test_a_window_that_closes_later_than_the_record_thought_makes_it_wait():
    # The instances' newest update (9000) is later than this record's own time (7000):
    # the trailing window closes at 9000 + window, not at 7000 + window.
    answers = [(MINE, 2, 9000), (MINE, 2, 9000), (MINE, 2, 9000)]
    closing = at_close(MINE, 6000, answers, 2, TRAILING, 10_500)
    assert (closing.verdict, closing.close_ms) == (Verdict.WAIT, 12_000)


def test_agreed_start_is_the_most_answered_then_the_earliest():
    assert agreed_start([5, 9, 9]) == 9
    assert agreed_start([9, 5]) == 5
    assert agreed_start([]) is None


def test_window_and_source_headers_parse_or_raise():
    assert parse_window([("x", b"1"), ("dedup-window", b"3000/6000")]) == (3000, 6000)
    assert parse_window([]) is None
    with pytest.raises(ValueError):
        parse_window([("dedup-window", b"soon")])
    assert source_of([("dedup-source", b"a/b/3/17")]) == ("a/b", 3, 17)
    with pytest.raises(ValueError):
        source_of([])


@pytest.mark.parametrize(
    ("sections", "named"),
    [
        ({"coalesce": {"enabled": True}}, "needs delay.enabled"),
        ({"delay": {"enabled": True},
          "coalesce": {"enabled": True, "mode": "trailing", "window": "10s", "max_window": "5s"}},
         "max_window"),
        ({"delay": {"enabled": True, "max_delay": "1m"},
          "coalesce": {"enabled": True, "mode": "trailing", "max_window": "2m"}}, "max_delay"),
        ({"coalesce": {"key": "body"}}, "coalesce.key"),
        ({"coalesce": {"window": "0s"}}, "coalesce.window"),
        ({"coalesce": {"grace": "-1s"}}, "coalesce.grace"),
        ({"coalesce": {"grace": "0.5ms"}}, "coalesce.grace"),
        # the wait (window + grace) must fit max_delay, and so the mark's life (ttl)
        ({"redis": {"ttl": "4s"}, "delay": {"enabled": True, "max_delay": "4s"},
          "coalesce": {"enabled": True, "window": "2s", "grace": "3s"}},
         "coalesce.window \\+ coalesce.grace"),
        ({"delay": {"enabled": True, "max_delay": "1m"},
          "coalesce": {"enabled": True, "mode": "trailing", "max_window": "1m"}},
         "coalesce.max_window \\+ coalesce.grace .* delay.max_delay"),
    ],
)  # fmt: skip
def test_bad_coalesce_settings_stop_start_up_naming_them(sections, named):
    with pytest.raises(ConfigError, match=named) as err:
        load_settings(**sections)
    assert "\n" not in str(err.value)


def test_grace_defaults_to_a_second_and_zero_is_allowed():
    assert load_settings().coalesce.grace.total_seconds() == 1
    settings = load_settings(delay={"enabled": True, "max_delay": "2s"},
                             coalesce={"enabled": True, "window": "2s", "grace": "0s"})  # fmt: skip
    assert settings.coalesce.grace.total_seconds() == 0
