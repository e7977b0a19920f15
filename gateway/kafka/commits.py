"""A loop's plain commit of its input offsets: bounded, never cancelled. A step's
commit, plain or in its transaction, goes through its `Completion`
(gateway/kafka/completion.py)."""

from __future__ import annotations

import asyncio
import functools
import logging

from aiokafka import AIOKafkaConsumer, TopicPartition

from gateway.contract.records import source_ref

logger = logging.getLogger(__name__)

COMMIT_TIMEOUT_S = 5.0  # a commit the broker does not answer within it is left under way


class Commits:
    """A loop's input offsets, committed plainly (`commit`)."""

    def __init__(self, consumer: AIOKafkaConsumer, what: str) -> None:
        self.consumer = consumer
        self.what = what  # "raw", "delay tier", "failure-topic"
        self._under_way: asyncio.Future[None] | None = None
        self._left: dict[TopicPartition, int] = {}  # kept back by a commit under way

    async def commit(self, offsets: dict[TopicPartition, int]) -> bool:
        """Commit `offsets` (next offset to read) of the partitions still assigned; True
        once the broker took them. Bounded, but never cancelled: aiokafka retries a
        commit for as long as the broker is away (the loop must go on meanwhile), and
        a cancelled commit leaves its own inner task to fail unobserved. While one is
        under way, the offsets wait for the next call. A partition that moved on is
        left to its new owner, which reads again from the last commit."""
        assigned = self.consumer.assignment()
        offsets = {tp: o for tp, o in {**self._left, **offsets}.items() if tp in assigned}
        self._left = {}
        if not offsets:
            return True
        if self._under_way is not None and not self._under_way.done():
            self._left = offsets
            return False
        where = {source_ref(tp.topic, tp.partition, o): o for tp, o in offsets.items()}
        task = asyncio.ensure_future(self.consumer.commit(offsets))
        self._under_way = task
        done, _ = await asyncio.wait([task], timeout=COMMIT_TIMEOUT_S)
        if not done:
            task.add_done_callback(functools.partial(_commit_done, self.what, where))
            logger.warning(
                "%s commit still under way after %.0fs; the next pass commits again",
                self.what, COMMIT_TIMEOUT_S, extra={"commit": where},
            )  # fmt: skip
            return False
        return _commit_done(self.what, where, task)


def _commit_done(what: str, where: dict[str, int], task: asyncio.Future[None]) -> bool:
    """Log a failed commit (its exception retrieved, never left unobserved); True when
    it succeeded."""
    if task.cancelled():
        return False
    if (exc := task.exception()) is None:
        return True
    # Revoked meanwhile (CommitFailedError, IllegalStateError), or a broker error: the
    # next pass commits again, or the new owner reads again from the last commit.
    logger.warning(
        "%s commit failed, left for the next pass: %r", what, exc, extra={"commit": where}
    )
    return False
