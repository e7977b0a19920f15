"""Properties of a member's trust decision (gateway/rules/trust.py) over every epoch
read hypothesis finds: the move it makes is one `TRUST_MOVES` allows, UNKNOWN exactly
when no epoch is known, and a member is counted only when its data is whole."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from gateway.rules.trust import TRUST_MOVES, Trust, decide_trust, epoch_served

RECOVERY_MS = 60_000


@given(
    before=st.sampled_from(list(Trust)),
    known=st.booleans(),
    trusted_state=st.booleans(),
    age_ms=st.integers(0, 3 * RECOVERY_MS),
    missed=st.booleans(),
    promoted=st.booleans(),
)
def test_a_member_is_counted_only_when_its_data_is_whole(
    before, known, trusted_state, age_ms, missed, promoted
):
    now = 10**12
    served = known and epoch_served(trusted_state, now - age_ms, now, RECOVERY_MS)
    # after a promotion (only of a served epoch) the epoch is marked trusted on the member
    marked = known and (trusted_state or (served and promoted))
    decided = decide_trust(known, served, missed, marked)
    assert decided.trust in TRUST_MOVES[before]
    assert (decided.trust is Trust.UNKNOWN) == (not known)
    whole = known and (trusted_state or age_ms >= RECOVERY_MS) and not missed
    assert (decided.trust is Trust.TRUSTED) == whole
    # lagging: recovering only for the marks it missed, its epoch marked trusted
    assert decided.lagging == (known and served and missed and marked)
    assert not decided.lagging or decided.trust is Trust.RECOVERING


def test_an_epoch_is_served_at_exactly_one_mark_lifetime():
    assert not epoch_served(False, 1_000, 1_000 + RECOVERY_MS - 1, RECOVERY_MS)
    assert epoch_served(False, 1_000, 1_000 + RECOVERY_MS, RECOVERY_MS)
    assert epoch_served(True, 1_000, 1_000, RECOVERY_MS)
