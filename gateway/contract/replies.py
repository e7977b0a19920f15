"""The reply codes of the quorum members' Lua scripts, one IntEnum per script.

The scripts (gateway/quorum/scripts.py) answer plain integers; these names are
what the Python side compares them with. An IntEnum equals its integer, so a
reply read from Redis compares equal to its name without conversion.
"""

from __future__ import annotations

from enum import IntEnum


class ReleaseReply(IntEnum):
    """RELEASE's reply per mark (scripts.RELEASE); `RELEASED` count towards a release."""

    HELD_BY_ANOTHER = 0
    RELEASED_NOW = 1
    RELEASED_BEFORE = 2
    NO_LIVE_MARK = 3


class HandoverReply(IntEnum):
    """HANDOVER's reply per mark (scripts.HANDOVER); `MOVED` count as this command's move."""

    NOT_OURS = 0
    HANDED_OVER_NOW = 1
    HANDED_OVER_BEFORE = 2
    # 3 is no longer answered: another copy's handover answers that copy's ref (a str).
    EFFECT_DONE = 4
    HELD_BY_LATER_ATTEMPT = 5
    HANDED_OVER_BY_AN_UNNAMED_COPY = 6  # another copy, whose note is gone


HELD_BY_ANOTHER, RELEASED_NOW, RELEASED_BEFORE, NO_LIVE_MARK = ReleaseReply
RELEASED = (RELEASED_NOW, RELEASED_BEFORE)
(NOT_OURS, HANDED_OVER_NOW, HANDED_OVER_BEFORE, EFFECT_DONE, HELD_BY_LATER_ATTEMPT,
 HANDED_OVER_BY_AN_UNNAMED_COPY) = HandoverReply  # fmt: skip
MOVED = (HANDED_OVER_NOW, HANDED_OVER_BEFORE)
