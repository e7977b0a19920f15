"""The majority vote over the members' replies: a pure function.

Each member replies, for one record, with MINE (the mark is held by this
record), another owner's token, or nothing (down, timed out, error). With N
members and m = N//2 + 1:
- m or more hold this record's mark: FORWARD;
- m or more hold one other owner's mark: DUPLICATE of that owner;
- every counted member answered, they are at least m, but no owner has m
  (copies claimed concurrently on different members): the owner with the
  most marks wins, ties going to the smallest token. Every gateway that sees
  all those replies sees the same marks (a mark is set once, and only repair
  rewrites it, towards the winner), so every gateway picks the same winner
  and exactly one copy is forwarded. One exception: a released mark is taken
  over by the next copy, so two copies taking the same tombstone at once on
  different members can, in rare orders, each win on some gateway;
- otherwise (too few answers to know): UNDECIDED, handled by `on_no_quorum`.

Released marks (release mode, gateway/quorum/keys.py) hold `-<token>`: the id is
free, and `token` must never own it again. A member may not have seen the
release yet (it runs on each member in turn, racing claims), so a token
whose release any answer shows counts as released everywhere: a tombstone
`-T` on one member and `T` on another are two tombstones; a claim that took
a tombstone answers `=T` (mine, and `T` was released). Tombstones never beat a
live owner. Without this, a replay of the released record racing its release
won a 1:1 tie (`T` is one character shorter than `-T`) and was forwarded with
the token the job had already processed, and the repair brought `T` back: the
id was never processed again (chaos seed 19).

Members that lost their marks (recovering) are not counted: their replies
come as None and `counted` says how many are. With one of three recovering, a
1:1 split of the other two is thus decided like a split of all three: without
that, two copies claimed at the same moment by two gateways stayed undecided
until a rebuild, blocking their partitions (found by the chaos schedule, seed
37). What it gives up: if one of the two had missed the first copy's mark (no
answer, its fill still queued) while the third lost its data, a later copy
can win the tie: two members' faults at once, beyond the one-member
guarantee, and the same tie rule `dedup-gateway rebuild` applies.

`tally` is the vote over a whole claimed batch: each record's outcome, the marks to
repair towards the winner and the winner's marks to fill on members that gave no
answer (the data path hands those to `Quorum.settle`).
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import cast

from gateway.contract.tokens import TOMBSTONE

MINE = 1
# MINE, another owner's token (a tombstone: `-<token>`), `=<token>` (mine, taken
# over <token>'s tombstone), or no answer.
Reply = int | str | None
TOOK_OVER = "="


class Outcome(enum.Enum):
    FORWARD = "forward"
    DUPLICATE = "duplicate"
    UNDECIDED = "undecided"
    # Not a vote's: the batch's fills could not be noted (gateway/quorum/behind.py), so
    # the whole batch is tried again, whatever `on_no_quorum` says.
    RETRY = "retry"


@dataclass(frozen=True, slots=True)
class Decision:
    outcome: Outcome
    winner: str | None  # the owning token when decided


def decide(
    own: str, replies: Sequence[Reply], majority: int, counted: int | None = None
) -> Decision:
    """Decide one record from its per-member replies (see module docstring).

    `majority` is the count of marks that decides (N // 2 + 1 of N members). A reply
    that is not counted (a member that lost its marks) is passed as None, and
    `counted` is the number of counted members (default: all).
    """
    answered = [reply for reply in replies if reply is not None]
    if not answered:
        return Decision(Outcome.UNDECIDED, None)
    released = {r[1:] for r in answered if type(r) is str and r[:1] == TOOK_OVER}
    owners = Counter(holder(own, reply) for reply in answered)
    winner, marks = leader(owners, released)
    expected = len(replies) if counted is None else counted
    if marks < majority and (len(answered) < expected or expected < majority):
        return Decision(Outcome.UNDECIDED, None)
    return Decision(Outcome.FORWARD if winner == own else Outcome.DUPLICATE, winner)


def holder(own: str, reply: Reply) -> str:
    """Who holds the mark on a member that answered `reply` to `own`'s claim."""
    if reply == MINE or (type(reply) is str and reply[:1] == TOOK_OVER):
        return own
    return str(reply)


def leader(owners: Mapping[str, int], released: Iterable[str] = ()) -> tuple[str, int]:
    """The owner with the most marks and its count; among equals, the smallest token
    (a rule every gateway, and a rebuild, shares). `owners` must not be empty.

    A token in `released`, or whose tombstone is among `owners`, counts as its
    tombstone; tombstones come after every live owner, whatever their counts.
    """
    dead = {o[1:] for o in owners if o[:1] == TOMBSTONE}.union(released)
    if dead:
        folded: Counter[str] = Counter()
        for owner, count in owners.items():
            folded[TOMBSTONE + owner if owner in dead else owner] += count
        owners = folded
    # (len, text) orders decimal tokens numerically without parsing foreign values.
    return min(
        owners.items(),
        key=lambda item: (item[0][:1] == TOMBSTONE, -item[1], len(item[0]), item[0]),
    )


FORWARD, DUPLICATE = Outcome.FORWARD, Outcome.DUPLICATE
# Per member: (digest, the owner it holds, the winner) to repair, or (digest, the
# winner, the record's own owner) to fill.
Marks = list[list[tuple[bytes, str, str]]]


@dataclass(slots=True)
class Tally:
    """A claimed batch decided: each record's outcome, and per member what to repair
    and what to fill."""

    outcomes: list[Outcome]
    repairs: Marks
    fills: Marks


def tally(
    digests: Sequence[bytes],
    owners: Sequence[str],
    replies: Sequence[Sequence[Reply]],
    counted: Sequence[bool],
    majority: int,
) -> Tally:
    """Decide every record of a batch (`decide`) from `replies` (per member, per
    record); a member not `counted` (it lost its marks) answers, but does not count."""
    masked = not all(counted)
    trusted = sum(counted)
    repairs: Marks = [[] for _ in replies]
    fills: Marks = [[] for _ in replies]

    def settle(k: int, row: Sequence[Reply]) -> Outcome:
        """Record k by the rule (`decide`), with its repairs and fills."""
        owner = owners[k]
        votes = [r if c else None for r, c in zip(row, counted, strict=True)] if masked else row
        decision = decide(owner, votes, majority, trusted)
        if decision.winner is not None:
            for i, reply in enumerate(row):
                if reply is None:
                    fills[i].append((digests[k], decision.winner, owner))
                    continue
                seen = holder(owner, reply)
                if seen != decision.winner:
                    repairs[i].append((digests[k], seen, decision.winner))
        return decision.outcome

    # The common cases need no counting, and leave nothing to repair: a record every
    # counted member holds for it is forwarded, one every member holds for one
    # other owner (a live one or a tombstone, not taken over) is a duplicate.
    size = len(replies)
    first = replies[0]
    outcomes: list[Outcome | None]
    if not masked and replies.count(first) == size:  # every member answered alike
        outcomes = [
            FORWARD if r == MINE else DUPLICATE if type(r) is str and r[0] != TOOK_OVER
            else None for r in first
        ]  # fmt: skip
        for k, outcome in enumerate(outcomes):
            if outcome is None:  # no answer, or taken over a tombstone: by the rule
                outcomes[k] = settle(k, (first[k],) * size)
    else:
        outcomes = []
        all_mine = (MINE,) * size
        for k, row in enumerate(zip(*replies, strict=True)):
            if not masked:
                if row == all_mine:
                    outcomes.append(FORWARD)
                    continue
                held = row[0]
                if type(held) is str and held[0] != TOOK_OVER and row.count(held) == size:
                    outcomes.append(DUPLICATE)
                    continue
            outcomes.append(settle(k, row))
    return Tally(cast(list[Outcome], outcomes), repairs, fills)  # every None was settled
