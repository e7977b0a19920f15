"""`DueQueue`: the items a loop holds until their time, earliest first."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class DueQueue(Generic[T]):
    """Items waiting for their time (any clock the caller keeps), earliest first;
    items due at the same time in the order they were pushed."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, T]] = []
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[T]:
        return (item for _, _, item in self._heap)

    def push(self, at: float, item: T) -> None:
        heapq.heappush(self._heap, (at, next(self._seq), item))

    def next_at(self) -> float | None:
        return self._heap[0][0] if self._heap else None

    def pop_due(self, now: float) -> T | None:
        """The earliest item when its time is `now` or earlier, else None."""
        if self._heap and self._heap[0][0] <= now:
            return heapq.heappop(self._heap)[2]
        return None

    def drop(self, gone: Callable[[T], bool]) -> list[T]:
        """Remove the items `gone` says are; returns them."""
        kept = [entry for entry in self._heap if not gone(entry[2])]
        dropped = [entry[2] for entry in self._heap if gone(entry[2])]
        heapq.heapify(kept)
        self._heap = kept
        return dropped
