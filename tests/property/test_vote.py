"""Properties of the majority vote, over every reply pattern hypothesis finds."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from gateway.contract.tokens import mark_digest
from gateway.rules.vote import MINE, Decision, Outcome, decide, holder, tally

N = st.sampled_from([1, 3, 5, 7])
TOKENS = st.sampled_from(["11", "22", "333", "4"])


@st.composite
def marks(draw):
    """The mark each instance holds (an owner token, or None when down), for N instances."""
    n = draw(N)
    return [draw(st.one_of(st.none(), TOKENS)) for _ in range(n)]


def replies_of(own, held):
    return [None if h is None else MINE if h == own else h for h in held]


@given(marks())
def test_at_most_one_copy_is_forwarded_for_any_marks(held):
    """Whatever the instances hold, at most one of the competing owners is forwarded."""
    n = len(held)
    forwarded = [
        own for own in ["11", "22", "333", "4"]
        if decide(own, replies_of(own, held), n // 2 + 1).outcome is Outcome.FORWARD
    ]  # fmt: skip
    assert len(forwarded) <= 1


@given(marks())
def test_with_every_instance_answering_exactly_one_owner_is_forwarded(held):
    held = [h if h is not None else "11" for h in held]
    n = len(held)
    outcomes = {own: decide(own, replies_of(own, held), n // 2 + 1).outcome for own in set(held)}
    assert list(outcomes.values()).count(Outcome.FORWARD) == 1
    assert Outcome.UNDECIDED not in outcomes.values()


@given(N, st.data())
def test_majority_for_own_mark_forwards_and_majority_for_other_is_duplicate(n, data):
    m = n // 2 + 1
    down = data.draw(st.integers(0, n - m))
    own_replies = [MINE] * (n - down) + [None] * down
    assert decide("11", own_replies, m).outcome is Outcome.FORWARD
    other_replies = ["22"] * (n - down) + [None] * down
    decision = decide("11", other_replies, m)
    assert (decision.outcome, decision.winner) == (Outcome.DUPLICATE, "22")


@given(N, st.data())
def test_too_few_answers_without_a_majority_is_undecided(n, data):
    m = n // 2 + 1
    answered = data.draw(st.integers(0, m - 1))
    replies = [MINE] * answered + [None] * (n - answered)
    assert decide("11", replies, m).outcome is Outcome.UNDECIDED


def test_three_way_split_with_all_answering_goes_to_the_smallest_token():
    held = ["22", "11", "333"]
    assert decide("11", replies_of("11", held), 2).outcome is Outcome.FORWARD
    assert decide("22", replies_of("22", held), 2).outcome is Outcome.DUPLICATE
    assert decide("333", replies_of("333", held), 2).winner == "11"


@given(marks(), st.data())
def test_with_instances_not_counted_at_most_one_copy_is_forwarded_and_one_when_the_rest_answer(
    held, data
):
    """Instances that lost their marks (recovering) are passed as None, `counted`
    the others. Whatever every instance holds, at most one owner is forwarded; when
    every counted instance answers and they are a majority, exactly one is."""
    n = len(held)
    m = n // 2 + 1
    lost = data.draw(st.sets(st.integers(0, n - 1)))
    counted = n - len(lost)
    forwarded, undecided = [], []
    for own in ["11", "22", "333", "4"]:
        replies = [None if i in lost else r for i, r in enumerate(replies_of(own, held))]
        outcome = decide(own, replies, m, counted).outcome
        forwarded += [own] if outcome is Outcome.FORWARD else []
        undecided += [own] if outcome is Outcome.UNDECIDED else []
    assert len(forwarded) <= 1
    answering = [h for i, h in enumerate(held) if i not in lost and h is not None]
    if counted >= m and len(answering) == counted:
        assert len(forwarded) == 1 and not undecided
        assert forwarded[0] in answering  # the winner holds a counted mark


def test_an_answer_not_counted_never_makes_a_majority():
    # Instance 2 restarted empty and took y's claim: (x, MINE, MINE). Counted, y
    # would be forwarded although x has been.
    assert decide("22", ["11", MINE, MINE], 2).outcome is Outcome.FORWARD
    assert decide("22", ["11", MINE, None], 2, counted=2).outcome is Outcome.DUPLICATE
    # With one counted instance down too, nothing is known: wait.
    assert decide("22", [None, MINE, None], 2, counted=2).outcome is Outcome.UNDECIDED
    # A 1:1 split of the two counted instances goes to the smaller token, as when
    # all three answer: both copies' gateways pick it.
    assert decide("11", ["22", MINE, None], 2, counted=2).outcome is Outcome.FORWARD
    assert decide("22", [MINE, "11", None], 2, counted=2).winner == "11"
    # Fewer counted instances than a majority decide nothing, even in agreement.
    assert decide("11", [MINE, None, None], 2, counted=1).outcome is Outcome.UNDECIDED


# What a member may answer a claim by "9": nothing, mine, another owner, a tombstone
# (to the released record itself: "-9"), or mine over another's tombstone.
REPLIES = st.one_of(st.none(), st.just(MINE), TOKENS, st.sampled_from(["-9", "-11", "=11", "=22"]))


@given(st.lists(REPLIES, min_size=1, max_size=7), st.data())
def test_a_released_token_never_wins_and_never_beats_a_live_owner(replies, data):
    """Whichever members the release reached first: a token whose release any answer
    shows is not forwarded or made the winner, and a tombstone wins only where no
    live owner answered."""
    n = len(replies)
    counted = data.draw(st.integers(len([r for r in replies if r is not None]), n))
    decision = decide("9", replies, n // 2 + 1, counted)
    released = {r[1:] for r in replies if isinstance(r, str) and r[0] in "-="}
    assert decision.winner not in released
    if "9" in released:
        assert decision.outcome is not Outcome.FORWARD
    holders = {"9" if r == MINE or str(r)[0] == "=" else str(r) for r in replies if r is not None}
    if holders - released - {h for h in holders if h[0] == "-"} and decision.winner is not None:
        assert not decision.winner.startswith("-")


def test_a_replay_racing_its_release_is_a_duplicate_and_a_copy_racing_it_wins():
    # Chaos seed 19: two counted members, the release reached one. Before, "9" won
    # the 1:1 tie (shorter than "-9") and was forwarded again.
    assert decide("9", ["-9", MINE, None], 2, counted=2) == Decision(Outcome.DUPLICATE, "-9")
    # Another copy took the tombstone on one member and met "9" on the other.
    assert decide("22", ["=9", "9", None], 2, counted=2) == Decision(Outcome.FORWARD, "22")
    assert decide("11", ["22", "-9", "-9"], 2) == Decision(Outcome.DUPLICATE, "22")


# Rows of three replies: any, or every member answering each record alike (the vote's
# whole-batch shortcut).
ROWS = st.one_of(
    st.lists(st.lists(REPLIES, min_size=3, max_size=3), min_size=1, max_size=30),
    st.lists(REPLIES.map(lambda reply: [reply] * 3), min_size=1, max_size=30),
)


def _tallied(rows, counted):
    ids = [f"id-{n}".encode() for n in range(len(rows))]
    replies = [list(member) for member in zip(*rows, strict=True)]
    return ids, tally([mark_digest(i) for i in ids], ["9"] * len(rows), replies, counted, 2)


@given(ROWS)
def test_the_batch_tally_decides_every_row_as_decide_does(rows):
    """`tally` skips the counting for unanimous rows (and for a batch every member
    answered alike): the outcomes are still `decide`'s, and a row held by one other
    owner everywhere is neither repaired nor filled."""
    ids, voted = _tallied(rows, [True, True, True])
    assert voted.outcomes == [decide("9", row, 2, 3).outcome for row in rows]
    unanimous = {mark_digest(i) for i, row in zip(ids, rows, strict=True)
                 if row[0] not in (None, MINE) and row.count(row[0]) == 3}  # fmt: skip
    touched = {digest for member in [*voted.repairs, *voted.fills] for digest, _, _ in member}
    assert not unanimous & touched


@given(ROWS, st.lists(st.booleans(), min_size=3, max_size=3))
def test_a_tally_decides_on_the_counted_members_and_fills_only_those_that_gave_no_answer(
    rows, counted
):
    """A member not counted (it lost its marks) answers but does not count: each row
    is `decide` on the counted answers. A decided row's winner is filled on every
    member that gave no answer, and repaired on every one that holds another owner."""
    ids, voted = _tallied(rows, counted)
    votes = [[r if c else None for r, c in zip(row, counted, strict=True)] for row in rows]
    decisions = [decide("9", v, 2, sum(counted)) for v in votes]
    assert voted.outcomes == [d.outcome for d in decisions]
    for k, (row, decision) in enumerate(zip(rows, decisions, strict=True)):
        digest = mark_digest(ids[k])
        for member, reply in enumerate(row):
            filled = [m for m in voted.fills[member] if m[0] == digest]
            repaired = [m for m in voted.repairs[member] if m[0] == digest]
            if decision.winner is None:
                assert not filled and not repaired
            elif reply is None:
                assert filled == [(digest, decision.winner, "9")] and not repaired
            else:
                seen = holder("9", reply)
                assert not filled
                assert repaired == ([] if seen == decision.winner
                                    else [(digest, seen, decision.winner)])  # fmt: skip
