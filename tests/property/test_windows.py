"""Properties of the coalescing windows' close decision (gateway/rules/windows.py),
over every pattern of member answers hypothesis finds: of one window's waiting
versions, only the newest may emit, only once its window has closed, only when a
counted majority answered and one holds it."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from gateway.rules.windows import Verdict, WindowShape, at_close, place, version

SHAPES = st.sampled_from(
    [WindowShape("fixed", 3000, 30_000), WindowShape("trailing", 3000, 10_000)]
)
START = 6000
VERSIONS = st.integers(START, START + 9000).map(lambda ts: version(ts, "raw", 0, ts))


@st.composite
def answers(draw):
    """Per member (1, 3 or 5): no answer, or (newest version, updates, newest timestamp)."""
    n = draw(st.sampled_from([1, 3, 5]))
    held = st.tuples(VERSIONS, st.integers(1, 9)).map(lambda v: (v[0], v[1], int(v[0][:15])))
    return [draw(st.one_of(st.none(), held)) for _ in range(n)]


@given(answers(), SHAPES, st.integers(0, 30_000), st.integers(0, 2000))
def test_only_the_newest_version_held_may_emit_and_only_after_its_window_closed(
    said, shape, now, grace
):
    majority = len(said) // 2 + 1
    waiting = {held for a in said if a is not None for held in [a[0]]}
    emitted = []
    for mine in waiting:
        closing = at_close(mine, START, said, majority, shape, START + now, grace)
        if closing.verdict is Verdict.EMIT:
            emitted.append(mine)
            assert START + now >= closing.closed_ms == closing.close_ms + grace
            assert sum(a is not None for a in said) >= majority
        if any(a is not None and a[0] > mine for a in said):
            assert closing.verdict is Verdict.DROP
    assert len(emitted) <= 1
    if emitted:
        assert emitted[0] == max(waiting)


@given(answers(), SHAPES, VERSIONS, st.integers(0, 30_000))
def test_a_version_no_counted_member_holds_is_never_emitted(said, shape, mine, now):
    held = [a for a in said if a is not None]
    closing = at_close(mine, START, said, len(said) // 2 + 1, shape, START + now)
    if all(a[0] != mine for a in held):
        assert closing.verdict is not Verdict.EMIT


@st.composite
def update_answers(draw):
    """The counted members' answers to one row's update: (window start, opened, the
    window's newest timestamp before it), starts from a few candidates so they agree
    as often as not."""
    n = draw(st.sampled_from([0, 1, 2, 3, 5]))
    starts = st.sampled_from([START, START + 3000, START + 6000])
    answer = st.tuples(starts, st.booleans(), st.integers(0, START + 9000))
    return [draw(answer) for _ in range(n)]


@given(update_answers(), SHAPES, st.integers(0, 20_000), st.integers(0, 30_000))
def test_a_row_is_placed_in_the_window_most_answers_name(said, shape, stamp, now):
    placed = place(shape, said, stamp, now, 500)
    if said:
        starts = [s for s, _, _ in said]
        top = max(starts.count(s) for s in starts)
        # the most answered start, the earliest of a tie: never one fewer members named
        assert starts.count(placed.start) == top
        assert placed.start == min(s for s in starts if starts.count(s) == top)
    elif shape.mode == "fixed":  # no answer: the row's own window
        assert placed.start <= stamp < placed.start + shape.window_ms
        assert placed.start % shape.window_ms == 0
    else:
        assert placed.start == stamp
    assert placed.opened == (sum(o for _, o, _ in said) * 2 > len(said))
    # the window closes after its start and after the row (unless a trailing window hit
    # its longest span), and lateness is measured from the window as it stood before
    newest = max([stamp, *(p for s, _, p in said if s == placed.start)])
    assert placed.close == shape.close(placed.start, newest)
    assert placed.close > placed.start
    prev = max((p for s, _, p in said if s == placed.start), default=0)
    assert placed.lateness == now - (shape.close(placed.start, prev) + 500)
