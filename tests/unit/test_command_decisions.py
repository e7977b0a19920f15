"""What the failure loop asks the members (the handover's tokens) and how it reads
their HANDOVER and RELEASE replies (gateway/failures/release.py, retry.py)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import pytest

from gateway.contract.commands import Command
from gateway.contract.tokens import dead_token, mark_digest, owner_token
from gateway.rules.commands import (
    ACT,
    WAIT,
    HandoverDecision,
    ReleaseDecision,
    handover_decision,
    handover_of,
    release_decision,
)

OWN, BEFORE, AFTER, LAST = "failures/0/5", "failures/0/1", "failures/1/2", "failures/1/9"


@pytest.mark.parametrize(
    ("answers", "majority", "size", "decision"),
    [
        ([1, 1, 1], 2, 3, "act"),  # handed over now
        ([2, 2], 2, 3, "act"),  # a replay whose effect is not done: redo it
        ([1, 2, 0], 2, 3, "act"),
        ([BEFORE, BEFORE, 1], 2, 3, "skip"),  # another copy handed it over on a majority
        ([AFTER, AFTER, 1], 2, 3, "skip"),  # whatever its ref: it acts on its own
        ([1, 1, AFTER], 2, 3, "act"),  # this copy's majority: the other sees it and skips
        ([0, 0], 2, 3, "skip"),  # stale
        ([2, 4], 2, 3, "skip"),  # done on one member: its note is written after the ack
        ([2, 2, 4], 2, 3, "skip"),
        ([6, 6, 1], 2, 3, "skip"),  # copies whose notes are gone took a majority
        # Moved on a majority only with other copies' members: the copy whose ref sorts
        # first among them acts, rather than two (a retry twice under one token) or
        # none until a member is counted again.
        ([1, AFTER], 2, 2, "act"),
        ([AFTER, 2], 2, 2, "act"),
        ([1, BEFORE], 2, 2, "skip"),
        ([BEFORE, 2], 2, 2, "skip"),
        ([1, 6], 2, 2, "act"),  # a copy whose note is gone sorts after
        ([1, AFTER, LAST], 2, 3, "act"),  # three copies, one member each
        ([BEFORE, 1, AFTER], 2, 3, "skip"),
        ([1, AFTER, BEFORE], 2, 3, "skip"),
        ([1, 1, AFTER, AFTER, 0], 3, 5, "act"),
        ([1, 1, AFTER, LAST, BEFORE], 3, 5, "skip"),  # none alone a majority of five
        ([1, AFTER, AFTER, LAST, LAST], 3, 5, "act"),
        ([AFTER, AFTER, AFTER, 1, 1], 3, 5, "skip"),
        # The same with a third member that gave no answer (or is not counted here): it
        # may hold another copy's move (a majority alone, or a smaller ref among the
        # movers), or this copy's.
        ([1, AFTER], 2, 3, "wait"),  # AFTER may hold it too, and acts
        ([AFTER, 2], 2, 3, "wait"),
        ([1, BEFORE], 2, 3, "wait"),  # this copy may hold it too: BEFORE then skips
        ([1, 6], 2, 3, "wait"),
        ([0, AFTER], 2, 3, "wait"),  # this copy may hold it: the first of two movers
        ([0, 6], 2, 3, "wait"),
        ([1, AFTER, LAST, 0], 3, 5, "wait"),
        ([0, BEFORE], 2, 3, "skip"),  # at most one move, and BEFORE sorts first
        ([1, AFTER, BEFORE, 0], 3, 5, "skip"),
        ([BEFORE, BEFORE, 1], 3, 5, "wait"),  # this copy may hold both missing ones
        ([BEFORE, BEFORE, 1, 0], 3, 5, "skip"),
        ([0, BEFORE], 2, 2, "skip"),
        ([0, AFTER], 2, 2, "skip"),
        ([0, 6], 2, 2, "skip"),
        ([1, 5], 2, 3, "skip"),  # a later attempt holds it: a later command acted
        ([2, 2, 5], 2, 3, "skip"),
        ([1, 0], 2, 3, "wait"),  # one each way, no third answer counted
        ([1], 2, 3, "wait"),
        ([], 2, 3, "wait"),
    ],
)
def test_a_done_note_settles_a_command_and_otherwise_a_majority_decides(
    answers: list[int | str], majority: int, size: int, decision: str
) -> None:
    assert handover_decision(answers, majority, OWN, size) is HandoverDecision(decision)


def test_copies_that_split_the_members_agree_on_exactly_one_that_acts() -> None:
    """Every way two to five copies can share out the members' handovers: each copy sees
    the others' refs, and exactly one acts (the one with a majority alone, else the
    first ref among those that moved a member)."""
    for members, copies in ((3, 2), (3, 3), (5, 3), (5, 4), (5, 5)):
        majority = members // 2 + 1
        refs = [f"failures/{n}/7" for n in range(copies)]
        for moved_by in itertools.product(range(copies), repeat=members):
            alone = [c for c in range(copies) if moved_by.count(c) >= majority]
            expected = refs[alone[0] if alone else min(moved_by)]
            acting = [
                ref for c, ref in enumerate(refs)
                if c in moved_by and handover_decision(
                    [1 if m == c else refs[m] for m in moved_by], majority, ref, members
                ) is ACT
            ]  # fmt: skip
            assert acting == [expected], (members, moved_by)


def _seen_by(
    c: int, seen: Sequence[int], moved_by: Sequence[int], refs: Sequence[str]
) -> list[int | str]:
    """Copy c's answers from the members `seen` (moved_by[m]: the copy that moved member
    m, len(refs) for none)."""
    return [1 if moved_by[m] == c else 0 if moved_by[m] == len(refs) else refs[moved_by[m]]
            for m in seen]  # fmt: skip


def test_the_copy_that_acts_is_the_one_every_member_s_answer_names_whatever_a_copy_misses() -> None:
    """Copies of one command that shared out the members (some moved by none), each
    on a gateway that may miss any of the members' answers (no answer, or not counted
    there: one run dropped fills for a member, another did not): a copy acts only if
    it is the one that acts with every answer known. Before, a copy that missed a
    member another copy moved acted beside it (copy A sees [1, B's ref] of three and
    acts, copy B sees [A's ref, 1, 1] and acts)."""
    for members, copies in ((3, 2), (3, 3), (5, 2), (5, 3)):
        majority = members // 2 + 1
        refs = [f"failures/{n}/7" for n in range(copies)]
        views = [
            seen for k in range(members + 1)
            for seen in itertools.combinations(range(members), k)
        ]  # fmt: skip
        for moved_by in itertools.product(range(copies + 1), repeat=members):  # copies: none
            every = range(members)
            full = [
                c for c in range(copies)
                if handover_decision(_seen_by(c, every, moved_by, refs), majority, refs[c],
                                     members) is ACT
            ]  # fmt: skip
            assert len(full) <= 1, moved_by
            movers = [c for c in moved_by if c < copies]
            if len(movers) >= majority:
                assert len(full) == 1, moved_by  # one acts: the retry is not lost
            for c in range(copies):
                for seen in views:
                    if (
                        handover_decision(
                            _seen_by(c, seen, moved_by, refs), majority, refs[c], members
                        )
                        is ACT
                    ):
                        assert [c] == full, (members, moved_by, c, seen)


def test_a_copy_that_misses_a_member_another_copy_moved_does_not_act_beside_it() -> None:
    """The issue's case: three members; copy A's gateway does not count member 2, which
    copy B moved; B's gateway counts all three."""
    ra, rb = "failures/0/7", "failures/1/3"
    assert handover_decision([1, rb], 2, ra, 3) is WAIT  # acted before
    assert handover_decision([ra, 1, 1], 2, rb, 3) is ACT


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
    assert release_decision(answers, majority) is ReleaseDecision(decision)


def command(attempt: int) -> Command:
    return Command(
        id=b"m-1", token=owner_token("raw", 2, 40, attempt), reason="boom", topic="raw",
        partition=2, offset=40, attempt=attempt, reasons=(), ref="failures/0/9",
    )  # fmt: skip


def test_a_handover_names_the_source_records_earlier_and_later_attempts() -> None:
    def tokens(*attempts: int) -> list[str]:
        return [owner_token("raw", 2, 40, k) for k in attempts]

    handover = handover_of(command(3), max_attempts=5)
    assert (handover.digest, handover.failed) == (mark_digest(b"m-1"), tokens(3)[0])
    assert handover.next == tokens(4)[0]
    assert list(handover.earlier) == tokens(1, 2)
    assert list(handover.later) == [*tokens(5), dead_token("raw", 2, 40)]
    first = handover_of(command(1), max_attempts=5)
    assert (list(first.earlier), list(first.later)) == (
        [],
        [*tokens(3, 4, 5), dead_token("raw", 2, 40)],
    )
    dead = handover_of(command(5), max_attempts=5)  # the last attempt failed: dead-lettered
    assert (dead.next, list(dead.earlier), list(dead.later)) == (
        dead_token("raw", 2, 40),
        tokens(1, 2, 3, 4),
        [],
    )
    # An attempt no gateway forwarded (past max_attempts) names no more tokens.
    assert list(handover_of(command(900), max_attempts=5).earlier) == tokens(1, 2, 3, 4, 5)
