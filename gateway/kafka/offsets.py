"""The offsets a consumer loop took and may commit.

`PartitionOffsets` / `OffsetBook`: per assigned partition, the offsets taken and
not yet acknowledged downstream, and the commit point that follows from them
(the first one still in flight, else the next to read). Offsets are committed
only for partitions still assigned, and only once acknowledged; the commit itself
is the loop's (gateway/kafka/commits.py, `Commits`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from aiokafka import AIOKafkaConsumer, TopicPartition

P = TypeVar("P", bound="PartitionOffsets")


@dataclass(slots=True)
class PartitionOffsets:
    """One assigned partition's offsets, from the loop's side.

    Replaced when the partition is revoked: work started before then still points
    at the old object, which is how it knows the partition is no longer its own.
    """

    taken: deque[int] = field(default_factory=deque)  # in flight, in offset order
    moved: set[int] = field(default_factory=set)  # acknowledged, behind one still in flight
    next_offset: int | None = None  # first offset not taken
    committed: int | None = None

    def take(self, offset: int) -> None:
        self.taken.append(offset)

    def commit_point(self) -> int | None:
        """The first offset not yet acknowledged downstream (what may be committed)."""
        while self.taken and self.taken[0] in self.moved:
            self.moved.discard(self.taken.popleft())
        return self.taken[0] if self.taken else self.next_offset


def fetch_position(consumer: AIOKafkaConsumer, tp: TopicPartition) -> int | None:
    """Where `consumer` reads `tp` next, without waiting (None: not assigned, or no
    position yet). Past what `getmany` consumed and never returns: a transaction's
    commit or abort marker (an offset of its own) and an aborted transaction's
    records, so it can be beyond the last record's offset + 1. aiokafka's
    `position()` says the same but waits while there is none."""
    subscription = consumer._subscription.subscription
    assignment = subscription.assignment if subscription is not None else None
    state = assignment.state_value(tp) if assignment is not None else None
    return state.position if state is not None and state.has_valid_position else None


class OffsetBook(Generic[P]):
    """The loop's `PartitionOffsets` of each partition it took anything from."""

    def __init__(self, new: Callable[[], P]) -> None:
        self._new = new
        self.parts: dict[TopicPartition, P] = {}

    def of(self, tp: TopicPartition) -> P:
        part = self.parts.get(tp)
        if part is None:
            part = self.parts[tp] = self._new()
        return part

    def position(self, tp: TopicPartition) -> int | None:
        """Where the loop stands in `tp`: its next offset to take; None: nothing taken."""
        part = self.parts.get(tp)
        return part.next_offset if part is not None else None

    def read_on(self, tp: TopicPartition, offset: int) -> None:
        """The loop goes on reading `tp` at `offset` (past what it could not parse)."""
        self.of(tp).next_offset = offset

    def owns(self, consumer: AIOKafkaConsumer, tp: TopicPartition, part: P) -> bool:
        """Whether `part` is still the loop's state of `tp`, which is still assigned."""
        return self.parts.get(tp) is part and tp in consumer.assignment()

    def forget(self, partitions: set[TopicPartition]) -> None:
        for tp in partitions:
            self.parts.pop(tp, None)

    def due_commits(self, consumer: AIOKafkaConsumer) -> dict[TopicPartition, int]:
        """Commit points of the assigned partitions that moved since their last commit."""
        assigned = consumer.assignment()
        offsets = {}
        for tp, part in self.parts.items():
            point = part.commit_point()
            if tp in assigned and point is not None and point != part.committed:
                offsets[tp] = point
        return offsets

    def fencing_commits(self, consumer: AIOKafkaConsumer) -> dict[TopicPartition, int]:
        """Commit points of every assigned partition, moved since the last commit or not:
        what a step's transaction commits with its copies (`[kafka] exactly_once`). Its
        TxnOffsetCommit names the group generation, so a gateway stalled past its
        session has them refused and its transaction aborts. With `due_commits` alone,
        a step whose points did not move (a retry behind an older command still
        scheduled, a record moved ahead of an earlier one still held) sent no offsets,
        nothing checked the generation, and a zombie's copies were committed."""
        assigned = consumer.assignment()
        offsets = {}
        for tp, part in self.parts.items():
            point = part.commit_point()
            if tp in assigned and point is not None:
                offsets[tp] = point
        return offsets

    def committed(self, offsets: dict[TopicPartition, int]) -> None:
        for tp, point in offsets.items():
            if (part := self.parts.get(tp)) is not None:
                part.committed = point
