"""Whether a member's answers count, as a pure rule (gateway/quorum/epochs.py reads the
epochs and acts): the trust a member moves to from what its epoch and the other
gateway runs say, and the moves a trust may make."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Trust(enum.Enum):
    """Whether a member's answers count in votes (`decide_trust`).

    NEW -> UNKNOWN | RECOVERING | TRUSTED as its epoch is read; RECOVERING ->
    TRUSTED after a rebuild, a catch-up or a whole mark lifetime; TRUSTED ->
    RECOVERING when it lost its data (a new epoch) or missed marks (behind); any
    -> UNKNOWN when a script finds another epoch than the one read (it lost its
    data since), until the epochs are read again. Never back to NEW
    (`TRUST_MOVES`, checked by `MemberLink.set_trust`)."""

    NEW = ""  # not read yet
    UNKNOWN = "unknown"  # no epoch known: nothing is sent that needs one
    RECOVERING = "recovering"  # it lost its data: answers, but is not counted
    TRUSTED = "trusted"


# The moves a member's trust may make, from -> to (staying is a move too: every epoch
# read decides it again). UNKNOWN is the trust of a member whose epoch is not known,
# and only of one: RECOVERING and TRUSTED are decided from an epoch.
TRUST_MOVES: dict[Trust, frozenset[Trust]] = {
    Trust.NEW: frozenset({Trust.UNKNOWN, Trust.RECOVERING, Trust.TRUSTED}),
    Trust.UNKNOWN: frozenset({Trust.UNKNOWN, Trust.RECOVERING, Trust.TRUSTED}),
    Trust.RECOVERING: frozenset({Trust.RECOVERING, Trust.TRUSTED, Trust.UNKNOWN}),
    Trust.TRUSTED: frozenset({Trust.TRUSTED, Trust.RECOVERING, Trust.UNKNOWN}),
}


def epoch_served(trusted_state: bool, since_ms: int, now_ms: int, recovery_ms: int) -> bool:
    """Whether an epoch's data can be trusted: marked trusted on the member, or its data
    began a whole mark lifetime (`recovery_ms`) ago, so every mark it missed expired."""
    return trusted_state or now_ms - since_ms >= recovery_ms


@dataclass(frozen=True)
class TrustDecision:
    trust: Trust
    lagging: bool  # not counted only for marks it missed: a catch-up completes it


def decide_trust(
    epoch_known: bool, served: bool, missed: bool, trusted_state: bool
) -> TrustDecision:
    """A member's trust from its epoch read (pure): `served` from `epoch_served`;
    `missed` when another run noted it lacks marks that run held, or this run dropped
    fills for it; `trusted_state` when its epoch is marked trusted on the member (after
    any promotion this read made)."""
    if not epoch_known:
        return TrustDecision(Trust.UNKNOWN, lagging=False)
    if not served:
        return TrustDecision(Trust.RECOVERING, lagging=False)
    if missed:
        # Its data is whole but for the marks it missed: a catch-up completes it.
        return TrustDecision(Trust.RECOVERING, lagging=trusted_state)
    return TrustDecision(Trust.TRUSTED, lagging=False)
