"""Where a decided raw batch's copies go, chosen once by the composition root
(gateway/service/app.py): straight to their clean topics (`Direct`), or through
scheduled delivery and coalescing windows first (gateway/delay/routes.py,
`Scheduled`). The pipeline holds a `Routes` and never asks which."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Protocol

from gateway.contract.records import OutRow, Record
from gateway.kafka.sink import Sink

# A decided batch's copies, ready to go: sending them waits for the broker's
# acknowledgements and returns the source timestamps of the copies that reached a
# clean topic (for the forward latency; one waiting in a delay tier is not there yet).
Send = Callable[[], Awaitable[list[int | None]]]


class Routes(Protocol):
    def checked(self, extract: Callable[[Record], bytes]) -> Callable[[Record], bytes]:
        """`extract`, also refusing (BadRecord) a record this route cannot carry, so it
        is quarantined before it claims its id."""

    async def ready(self, clean: Sequence[OutRow], lanes: Mapping[str, Sequence[OutRow]]) -> Send:
        """At the vote's end: how a batch's decided-new rows go out, those for
        `[kafka] clean_topic` (`clean`) and those for a lane's own topic (`lanes`)."""


class Direct:
    """Every decided-new row to its clean topic. The produce batches are built at the
    vote's end, while the records are in the CPU's cache (`Sink.prepare`), and sent in
    fetch order as always."""

    def __init__(self, sink: Sink, clean_topic: str) -> None:
        self.sink = sink
        self.clean_topic = clean_topic

    def checked(self, extract: Callable[[Record], bytes]) -> Callable[[Record], bytes]:
        return extract

    async def ready(self, clean: Sequence[OutRow], lanes: Mapping[str, Sequence[OutRow]]) -> Send:
        targets = [(self.clean_topic, clean), *lanes.items()]
        prepared = [await self.sink.prepare(topic, rows) for topic, rows in targets if rows]
        timestamps = [row[2] for _, rows in targets for row in rows]

        async def send() -> list[int | None]:
            await asyncio.gather(*(self.sink.shipped(batches) for batches in prepared))
            return timestamps

        return send
