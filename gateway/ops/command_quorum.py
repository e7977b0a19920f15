"""The quorum an operator command talks to: as patient as a first contact."""

from __future__ import annotations

from datetime import timedelta

from gateway.config import RedisSettings
from gateway.metrics import Metrics
from gateway.quorum.epochs import FIRST_CONTACT_S
from gateway.quorum.quorum import Quorum


def command_quorum(redis: RedisSettings) -> Quorum:
    """A Quorum whose every call may take FIRST_CONTACT_S (or `[redis] timeout` if
    longer), not the data path's timeout: a command runs once, beside gateways that
    keep the members busy, and a member slow past the tests' 300 ms for one call made
    `pause` and `rebuild` give up ("did not answer", "stopped answering") in loaded runs.
    Scripts stay as short as on the data path (the copy's EXPORT_BUDGET), so a
    longer wait blocks no one.

    It writes no epoch (gives none by the fresh-deployment rule, spreads and
    promotes none): a command that only reads, such as `rebuild --dry-run`, once
    gave two emptied members `trusted` epochs while the member holding the marks
    was hung, and a copy was then forwarded."""
    patient = max(redis.timeout, timedelta(seconds=FIRST_CONTACT_S))
    return Quorum(redis.model_copy(update={"timeout": patient}), Metrics(), writes_epochs=False)
