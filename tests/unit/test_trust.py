"""A member's trust moves only as `TRUST_MOVES` allows (gateway/quorum/link.py): any
other move is a bug in what decides it, and `set_trust` raises."""

from __future__ import annotations

import itertools

import pytest

from gateway.metrics import Metrics
from gateway.quorum.keys import EPOCH_RECOVERING, Epoch
from gateway.quorum.link import TRUST_MOVES, IllegalTrustMove, MemberLink, Trust
from gateway.quorum.members import groups_for

N, U, R, T = Trust.NEW, Trust.UNKNOWN, Trust.RECOVERING, Trust.TRUSTED
# Written out again, not read from TRUST_MOVES: a move added to or dropped from the
# table fails here. Every trust may be kept; none goes back to NEW.
LEGAL = {
    (N, U), (N, R), (N, T),
    (U, U), (U, R), (U, T),
    (R, R), (R, T), (R, U),
    (T, T), (T, R), (T, U),
}  # fmt: skip
EPOCH = Epoch("e1", 1_000, EPOCH_RECOVERING)


def member(trust: Trust, epoch: Epoch | None) -> MemberLink:
    # No client is needed: set_trust only sets a gauge and calls on_health.
    link = MemberLink(
        name="m:6379/0", client=None,  # type: ignore[arg-type]
        scripts={}, groups=groups_for(b"p:", (1, 1, 1), 1), metrics=Metrics(), timeout=1.0,
    )  # fmt: skip
    link.trust, link.epoch = trust, epoch
    return link


def test_the_table_is_the_one_written_here():
    assert {(a, b) for a, moves in TRUST_MOVES.items() for b in moves} == LEGAL
    assert set(TRUST_MOVES) == set(Trust)


@pytest.mark.parametrize(("before", "after"), list(itertools.product(Trust, Trust)))
def test_a_move_is_made_when_legal_and_raised_otherwise(before: Trust, after: Trust):
    # The epoch agrees with the trust moved to: UNKNOWN exactly when none is known.
    link = member(before, None if after is U else EPOCH)
    health = []
    link.on_health = lambda: health.append(link.trust)
    if (before, after) in LEGAL:
        link.set_trust(after)
        assert link.trust is after and health == [after]
        recovering = link.metrics.redis_recovering.labels(link.name)._value.get()
        assert recovering == (0 if after is T else 1)
    else:
        with pytest.raises(IllegalTrustMove, match=f"trust {before.name} -> {after.name}"):
            link.set_trust(after)
        assert link.trust is before and health == []


@pytest.mark.parametrize("after", [R, T])
def test_recovering_or_trusted_without_an_epoch_is_raised(after: Trust):
    link = member(U, None)
    with pytest.raises(IllegalTrustMove, match="no epoch known"):
        link.set_trust(after)
    assert link.trust is U


def test_unknown_with_an_epoch_known_is_raised():
    link = member(T, EPOCH)
    with pytest.raises(IllegalTrustMove, match="epoch e1:1000:recovering"):
        link.set_trust(U)
    assert link.trust is T
