"""The majority vote over the instances' replies: a pure function.

Each instance replies, for one record, with MINE (the mark is held by this
record), another owner's token, or nothing (down, timed out, error). With N
instances and m = N//2 + 1:
- m or more hold this record's mark: FORWARD;
- m or more hold one other owner's mark: DUPLICATE of that owner;
- every counted instance answered, they are at least m, but no owner has m
  (copies claimed concurrently on different instances): the owner with the
  most marks wins, ties going to the smallest token. Every gateway that sees
  all those replies sees the same marks (a mark is set once, and only repair
  rewrites it, towards the winner), so every gateway picks the same winner
  and exactly one copy is forwarded;
- otherwise (too few answers to know): UNDECIDED, handled by `on_no_quorum`.

Instances that lost their marks (recovering) are not counted: their replies
come as None and `counted` says how many are. With one of three recovering, a
1:1 split of the other two is thus decided like a split of all three: without
that, two copies claimed at the same moment by two gateways stayed undecided
until a rebuild, blocking their partitions (found by the chaos schedule, seed
37). What it gives up: if one of the two had missed the first copy's mark (no
answer, its fill still queued) while the third lost its data, a later copy
can win the tie: two instances' faults at once, beyond the one-member
guarantee, and the same tie rule `dedup-gateway rebuild` applies.
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

MINE = 1
Reply = int | str | None  # MINE, another owner's token, or no answer


class Outcome(enum.Enum):
    FORWARD = "forward"
    DUPLICATE = "duplicate"
    UNDECIDED = "undecided"


@dataclass(frozen=True, slots=True)
class Decision:
    outcome: Outcome
    winner: str | None  # the owning token when decided


def decide(own: str, replies: Sequence[Reply], quorum: int, counted: int | None = None) -> Decision:
    """Decide one record from its per-instance replies (see module docstring).

    A reply that is not counted (an instance that lost its marks) is passed as
    None, and `counted` is the number of counted instances (default: all).
    """
    owners = Counter(own if reply == MINE else str(reply) for reply in replies if reply is not None)
    if not owners:
        return Decision(Outcome.UNDECIDED, None)
    winner, marks = leader(owners)
    expected = len(replies) if counted is None else counted
    if marks < quorum and (sum(owners.values()) < expected or expected < quorum):
        return Decision(Outcome.UNDECIDED, None)
    return Decision(Outcome.FORWARD if winner == own else Outcome.DUPLICATE, winner)


def leader(owners: Mapping[str, int]) -> tuple[str, int]:
    """The owner with the most marks and its count; among equals, the smallest token
    (a rule every gateway, and a rebuild, shares). `owners` must not be empty."""
    # (len, text) orders decimal tokens numerically without parsing foreign values.
    return min(owners.items(), key=lambda item: (-item[1], len(item[0]), item[0]))
