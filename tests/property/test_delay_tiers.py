"""Properties of the tier arithmetic: a record routed by `pick_tier` and stepped by
`next_step_ms`, as the router and the delay loop do, reaches the clean topic
never before its due time, at most one step's processing time after it, and in a
bounded number of moves when tiers are at most 4x apart."""

from __future__ import annotations

import re

from hypothesis import given
from hypothesis import strategies as st

from gateway.contract.records import H_DELIVER_AT, H_TIER_AT, H_WINDOW
from gateway.errors import BadRecord
from gateway.rules.tiers import next_step_ms, pick_tier, read_tier_record

EPOCH = re.compile(rb"\d{1,15}")


@st.composite
def tier_lists(draw):
    """Tier delays in ms, smallest first, each 2-4x the one before (as the defaults)."""
    tiers = [draw(st.integers(10, 5000))]
    for _ in range(draw(st.integers(0, 8))):
        tiers.append(tiers[-1] * draw(st.integers(2, 4)))
    return tiers


def deliver(remaining: int, tiers: list[int], overhead: int) -> tuple[int, int]:
    """(when it reaches the clean topic, moves into tiers) for a record due `remaining`
    ms after it was decided; every step is acted on `overhead` ms after its time."""
    due, now, moves = remaining, 0, 0
    if due <= now:
        return now, moves
    tier = pick_tier(due - now, tiers) or 0  # the router: the smallest when none fits
    while True:
        moves += 1
        now = next_step_ms(now, tiers[tier], due) + overhead  # the delay loop wakes
        if due <= now:
            return now, moves
        if (fits := pick_tier(due - now, tiers)) is None:
            return due + overhead, moves  # held in memory until due
        tier = fits


@st.composite
def cases(draw, least=-10_000):
    """(tiers, remaining): up to 8 times the largest tier, past which moves only repeat."""
    tiers = draw(tier_lists())
    return tiers, draw(st.integers(least, 8 * tiers[-1]))


@given(cases(), st.integers(0, 200))
def test_never_early_and_late_by_at_most_one_step(case, overhead):
    tiers, remaining = case
    delivered, _ = deliver(remaining, tiers, overhead)
    assert max(remaining, 0) <= delivered <= max(remaining, 0) + overhead


@given(cases(least=1))
def test_exactly_on_time_without_overhead_and_few_moves(case):
    tiers, remaining = case
    delivered, moves = deliver(remaining, tiers, 0)
    assert delivered == remaining
    # At most 3 moves per tier (4x apart), plus one past the largest per its length.
    assert moves <= 3 * len(tiers) + remaining // tiers[-1] + 1


@given(cases(least=1))
def test_a_record_that_fits_a_tier_steps_at_its_tier_delay_so_arrival_order_is_step_order(case):
    tiers, remaining = case
    tier = pick_tier(remaining, tiers)
    if tier is None:
        assert remaining < tiers[0]  # only then the smallest tier holds it until due
    else:
        assert next_step_ms(0, tiers[tier], remaining) == tiers[tier]
        assert tier == len(tiers) - 1 or remaining < tiers[tier + 1]  # the largest that fits


HEADER_VALUES = st.one_of(
    st.integers(0, 10**15 - 1).map(lambda n: str(n).encode()),
    st.binary(max_size=20),
    st.none(),
)


@given(
    st.dictionaries(st.sampled_from([H_DELIVER_AT, H_TIER_AT, H_WINDOW, "other"]), HEADER_VALUES),
    st.integers(1, 10**7),
    st.integers(0, 10**13),
    st.integers(0, 10**9),
)
def test_a_tier_record_is_read_as_its_headers_say_or_refused(headers, tier_ms, now, ahead):
    """`read_tier_record` never takes headers a gateway did not write for times: both
    times epoch milliseconds (1-15 digits), else ValueError; due further than
    `ahead` from now, BadRecord `delay_too_long`; else its step is `next_step_ms`'s, and
    it waits for a window exactly when it carries `dedup-window`."""
    pairs = list(headers.items())
    due, tier_at = headers.get(H_DELIVER_AT), headers.get(H_TIER_AT)

    def epoch(value: bytes | None) -> int | None:
        return int(value) if value is not None and EPOCH.fullmatch(value) else None

    try:
        read = read_tier_record(pairs, tier_ms, now, ahead)
    except BadRecord as exc:
        assert exc.reason == "delay_too_long"
        assert epoch(due) is not None and epoch(due) - now > ahead  # type: ignore[operator]
        return
    except ValueError:
        assert epoch(due) is None or epoch(tier_at) is None
        return
    assert (read.due_ms, read.window) == (epoch(due), H_WINDOW in headers)
    assert read.step_ms == next_step_ms(epoch(tier_at), tier_ms, read.due_ms)  # type: ignore[arg-type]
    assert read.step_ms <= read.due_ms
