"""What a failure command's replies decide: the handover and release decisions."""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from gateway.contract.commands import Command
from gateway.contract.replies import (
    EFFECT_DONE,
    HANDED_OVER_BY_AN_UNNAMED_COPY,
    HELD_BY_LATER_ATTEMPT,
    MOVED,
    NO_LIVE_MARK,
    RELEASED,
    RELEASED_NOW,
)
from gateway.contract.tokens import dead_token, mark_digest, owner_token


class HandoverDecision(enum.Enum):
    ACT = "act"  # hand over, then retry or dead-letter
    SKIP = "skip"  # stale, another copy's, or done
    WAIT = "wait"  # no majority yet: the command is tried again later


class ReleaseDecision(enum.Enum):
    RELEASED = "released"  # free on a majority, released now by this command
    REPEATED = "repeated"  # released, every one before: delivered twice, or redone
    STALE = "stale"  # a majority does not hold that token
    WAIT = "wait"  # no majority yet: the command is tried again later

    @property
    def released(self) -> bool:
        return self in (ReleaseDecision.RELEASED, ReleaseDecision.REPEATED)


@dataclass(frozen=True)
class Handover:
    """One failure command's handover of a mark (scripts.HANDOVER)."""

    digest: bytes
    failed: str  # the token the failed attempt held
    next: str  # the next attempt's token, or the dead-letter token
    ref: str  # the command delivery's coordinates, noted with the handover
    # The same source record's earlier attempts' tokens: a member still holding one
    # missed a handover the majority made, and is handed over too.
    earlier: Sequence[str] = ()
    # Its later attempts' tokens and the dead letter's: a member holding one shows
    # that the command is stale.
    later: Sequence[str] = ()


ACT, SKIP, WAIT = HandoverDecision.ACT, HandoverDecision.SKIP, HandoverDecision.WAIT


def handover_decision(
    answers: Sequence[int | str], majority: int, ref: str, size: int
) -> HandoverDecision:
    """What to do with the failure command delivered as `ref`, from the counted members'
    HANDOVER replies (scripts.HANDOVER; another copy's handover answers that copy's
    ref) among `size` members: ACT, SKIP or WAIT (`HandoverDecision`).

    `EFFECT_DONE` is written only after the effect was acknowledged, so one member
    saying so settles it: a member that missed that note (it gave no answer to
    `mark_done`) says `HANDED_OVER_BEFORE` ("redo") instead, and with a third member
    recovering that tie would hold the command partition forever (chaos seed 1).
    `HELD_BY_LATER_ATTEMPT` settles it too: a later command acted, so this one had.
    A copy whose moves are a majority acts, and every other copy sees that majority
    under its ref and skips. When no copy has a majority alone but the members the
    copies moved together are one (two copies each took one of two counted members,
    three each one of three), the copy whose ref sorts first among those that moved a
    member acts: each sees the same refs. Both acting sent the retry twice under one
    token (chaos seed 20001); none acting would lose it. If the gateway of the one
    that acts crashes first, it acts when its command is replayed (its own moves then
    answer `HANDED_OVER_BEFORE`). A copy whose note is gone sorts after every ref.

    That rule needs every member's answer: a member that gave none, or that this
    gateway does not count (another gateway may count it: one run dropped fills for
    it, another did not), may hold another copy's move, which makes that copy a
    majority alone or puts a smaller ref among the movers. So with answers missing
    the split is decided only where every answer they could give decides it the same
    way: SKIP when this copy can be the one that acts in none of them, else WAIT
    until they are known (before, copy A seeing [1, B's ref] of three acted while
    B's gateway, counting the third member B had moved, saw [A's ref, 1, 1] and
    acted too)."""
    if EFFECT_DONE in answers or HELD_BY_LATER_ATTEMPT in answers:
        return SKIP
    mine = sum(1 for a in answers if a in MOVED)
    others = Counter(a for a in answers if isinstance(a, str))
    unnamed = answers.count(HANDED_OVER_BY_AN_UNNAMED_COPY)
    missing = max(0, size - len(answers))
    if mine >= majority:
        return ACT
    if unnamed >= majority or any(n >= majority for n in others.values()):
        return SKIP
    first = all(ref < other for other in others)
    if missing:
        # Could this copy act once the missing answers are known? Alone (they are its
        # moves), or as the first ref of a split (they are its own, or other copies'
        # with later refs, that make the movers a majority)?
        alone = mine + missing >= majority
        split = first and mine + unnamed + sum(others.values()) + missing >= majority
        return WAIT if alone or split else SKIP
    if mine + unnamed + sum(others.values()) >= majority:
        return ACT if mine and first else SKIP
    if len(answers) - mine >= majority:
        return SKIP
    return WAIT


def goes_to_dead_letter(cmd: Command, max_attempts: int) -> bool:
    """Whether the command's effect is the dead letter (its attempt was the last), not a retry."""
    return cmd.attempt >= max_attempts


def handover_of(cmd: Command, max_attempts: int) -> Handover:
    """The mark's handover from the command's failed attempt to the next one (or to
    the dead letter), with the source record's other attempts' tokens: a member still
    holding an earlier one missed a handover; one holding a later one (or the dead
    letter's) shows the command is stale."""
    src = (cmd.topic, cmd.partition, cmd.offset)
    dead = goes_to_dead_letter(cmd, max_attempts)
    nxt = dead_token(*src) if dead else owner_token(*src, cmd.attempt + 1)
    # No attempt past max_attempts is ever forwarded, whatever a command says.
    earlier = [owner_token(*src, k) for k in range(1, min(cmd.attempt, max_attempts + 1))]
    later = [] if dead else [
        *(owner_token(*src, k) for k in range(cmd.attempt + 2, max_attempts + 1)), dead_token(*src)
    ]  # fmt: skip
    return Handover(mark_digest(cmd.id), cmd.token, nxt, cmd.ref, earlier, later)


def release_decision(answers: Sequence[int | str], majority: int) -> ReleaseDecision:
    """What a release command did, from the counted members' RELEASE replies (1
    released now, 2 released before from that token, 3 no live mark, 0 held by
    another owner): RELEASED, REPEATED, STALE or WAIT (`ReleaseDecision`).

    Released means the id is free on a majority: released there, or never marked (a
    member that missed the claim and its fill). Counted as STALE instead, that
    member tied with one that released it while a third recovered, and the command
    partition waited forever, as a handover's did (see handover_decision)."""
    released = sum(1 for a in answers if a in RELEASED)
    if released and released + answers.count(NO_LIVE_MARK) >= majority:
        return ReleaseDecision.RELEASED if RELEASED_NOW in answers else ReleaseDecision.REPEATED
    if len(answers) - released >= majority:
        return ReleaseDecision.STALE
    return ReleaseDecision.WAIT
