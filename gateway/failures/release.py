"""Release mode (`[failures] mode = "release"`, the patent): a command releases the
id's mark where it still holds the failed record's token (compare-and-set to the
tombstone `-token` on every member; released when a majority did, or had before:
a redone command). The next copy the producer sends is then new."""

from __future__ import annotations

import asyncio
import logging

from aiokafka import TopicPartition

from gateway.contract.commands import Command
from gateway.contract.tokens import mark_digest
from gateway.failures.loop import CommandPartition, Valid, command_fields, stale, undecided
from gateway.metrics import Metrics
from gateway.quorum.quorum import Quorum
from gateway.rules.commands import ReleaseDecision, release_decision

logger = logging.getLogger(__name__)


class Releases:
    """Releases each command's mark; nothing is scheduled."""

    raw_only = False  # a release needs only the token, whatever the topic

    def __init__(self, quorum: Quorum, metrics: Metrics) -> None:
        self.quorum = quorum
        self.metrics = metrics

    async def act(self, tp: TopicPartition, part: CommandPartition, valid: Valid) -> int | None:
        digests = [mark_digest(c.id) for _, c in valid]
        replies = await self.quorum.release(digests, [c.token for _, c in valid])
        for j, (rec, cmd) in enumerate(valid):
            answers = [a for r in replies if (a := r[j]) is not None]
            decision = release_decision(answers, self.quorum.majority)
            if (
                decision is ReleaseDecision.REPEATED
            ):  # counted stale, as a handover's second copy is
                stale(self.metrics, cmd, "repeated release", "released before")
            elif decision is ReleaseDecision.RELEASED:
                self.metrics.releases.labels("released").inc()
                logger.info(
                    "released %s (%s): %s",
                    cmd.readable_id,
                    cmd.ref,
                    cmd.reason,
                    extra=command_fields(cmd),
                )
            elif decision is ReleaseDecision.STALE:
                stale(self.metrics, cmd, "stale release", "token no longer holds")
            else:
                return undecided(self.metrics, part, rec, cmd, answers, self.quorum.majority)
        return None

    def has_due(self) -> bool:
        return False

    async def noted_done(self, commands: list[Command]) -> None:
        """Nothing is scheduled: a release is done when decided."""

    async def run_due(self, stop: asyncio.Event, budget_s: float | None = None) -> list[Command]:
        """Nothing is scheduled in release mode."""
        return []

    def busy(self) -> bool:
        return False

    def forget(self, partitions: set[TopicPartition]) -> None:
        """Nothing is scheduled in release mode."""
